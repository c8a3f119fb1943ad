"""``RunConfig``: the settings every command has (where it runs, in what dtype, its seed and output).

Each command's config derives from it (``SmokeConfig``, ``PPOConfig``, the SFT and RM configs).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Literal

import torch

from megatron_rlhf.parallel.distributed import DEFAULT_TIMEOUT_S, Device

Dtype = Literal["auto", "bf16", "fp16", "fp32"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The torch dtype of each ``Dtype`` but auto."""


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """A config's dtype name; ``auto`` is bf16 on GPU and fp32 in CPU mode."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The ``Dtype`` that names ``dtype`` (fp32, bf16, fp16)."""
    return next(name for name, known in DTYPES.items() if known == dtype)


@dataclasses.dataclass(kw_only=True)
class DeviceConfig:
    """Where a command runs and in what dtype: every trainer's, and ``generate``'s."""

    device: Device = "auto"
    """auto (cuda when a GPU is visible, else cpu), cuda, or cpu (gloo CPU mode)."""
    dtype: Dtype = "auto"
    """Parameter dtype: auto (bf16 on GPU, fp32 on CPU), bf16, fp16 or fp32."""


@dataclasses.dataclass(kw_only=True)
class RunConfig(DeviceConfig):
    seed: int = 1234
    """Seeds the data order, sampling and everything random."""
    output_dir: str = "runs/default"
    """Where config.yaml, metrics.jsonl, result.json, tb/ (TensorBoard) and the models go."""
    dist_timeout_s: float = DEFAULT_TIMEOUT_S
    """Seconds a rank waits in a collective for the others before failing: a hung or stopped rank
    then ends the job non-zero instead of hanging it."""

    host_threads: int = 0
    """torch's intra-op threads for this process's work on the host. 0 (auto): 1 on a GPU, where
    that work is many small ops (a rollout's batch, micro-batch layouts, advantages) and waking a
    pool of threads for each costs milliseconds (docs/benchmarks.md, "Host overheads"); torch's default
    in CPU mode, where the models run on those threads, and on a GPU when an optimizer keeps state
    on the host (``cpu_offload_fraction``: its Adam step runs there). OMP_NUM_THREADS, where set,
    decides instead of auto."""

    def errors(self) -> list[str]:
        errors = [] if self.host_threads >= 0 else [f"host_threads={self.host_threads} must be >= 0 (0: auto)"]
        return errors + ([] if self.dist_timeout_s > 0 else [f"dist_timeout_s={self.dist_timeout_s} must be > 0"])

    def host_thread_count(self, device: torch.device) -> int | None:
        """The intra-op thread count ``host_threads`` asks for on ``device``; None: leave torch's."""
        if self.host_threads:
            return self.host_threads
        if device.type != "cuda" or "OMP_NUM_THREADS" in os.environ or _offloads_optimizer(self):
            return None
        return 1

    def output_dir_errors(self) -> list[str]:
        """Why ``output_dir`` cannot be made: checked by each command's up-front checks, with the
        other settings, so that a run stops before it builds anything (``errors()`` checks values
        only, not the file system)."""
        path = Path(self.output_dir)
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir():
            return [f"output_dir={self.output_dir!r}: {existing} is a file, not a directory"]
        try:  # permission bits do not stop root; a read-only file system does: try it
            tempfile.NamedTemporaryFile(dir=existing).close()
        except OSError as err:
            return [f"output_dir={self.output_dir!r}: cannot write in {existing} ({err.strerror})"]
        return []


def _offloads_optimizer(cfg: object) -> bool:
    """Whether any optimizer setting in the config tree keeps state on the host."""
    if getattr(cfg, "cpu_offload_fraction", 0) > 0:
        return True
    return dataclasses.is_dataclass(cfg) and any(
        _offloads_optimizer(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
    )
