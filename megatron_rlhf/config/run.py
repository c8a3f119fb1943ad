"""``RunConfig``: the settings every command has (where it runs, in what dtype, its seed and output).

Each command's config derives from it (``SmokeConfig``, ``PPOConfig``, the SFT and RM configs).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from megatron_rlhf.config.fields import one_of
from megatron_rlhf.parallel.distributed import DEFAULT_TIMEOUT_S, DEVICES

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """A config's dtype name; ``auto`` is bf16 on GPU and fp32 in CPU mode."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    device: str = "auto"
    """auto (cuda when a GPU is visible, else cpu), cuda, or cpu (gloo CPU mode)."""
    dtype: str = "auto"
    """Parameter dtype: auto (bf16 on GPU, fp32 on CPU), bf16, fp16 or fp32."""
    seed: int = 1234
    """Seeds the data order, sampling and everything random."""
    output_dir: str = "runs/default"
    """Where config.yaml, metrics.jsonl, result.json, tb/ (TensorBoard) and the models go."""
    dist_timeout_s: float = DEFAULT_TIMEOUT_S
    """Seconds a rank waits in a collective for the others before failing: a hung or stopped rank
    then ends the job non-zero instead of hanging it."""

    def errors(self) -> list[str]:
        errors = one_of(self, "device", DEVICES) + one_of(self, "dtype", ["auto", *DTYPES])
        return errors + ([] if self.dist_timeout_s > 0 else [f"dist_timeout_s={self.dist_timeout_s} must be > 0"])

    def output_dir_errors(self) -> list[str]:
        """Why ``output_dir`` cannot be made: checked by each command's up-front checks, with the
        other settings, so that a run stops before it builds anything (``errors()`` checks values
        only, not the file system)."""
        path = Path(self.output_dir)
        existing = next(p for p in (path, *path.parents) if p.exists())
        if existing.is_dir():
            return []
        return [f"output_dir={self.output_dir!r}: {existing} is a file, not a directory"]
