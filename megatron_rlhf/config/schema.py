"""The run configuration: typed dataclasses, one per component, with a docstring per field.

YAML presets and command-line dotlist overrides (``actor.tp=2 seed=7``) are merged onto these by
``megatron_rlhf.config.loader``; ``megatron_rlhf.config.validate`` checks them against the world
size and the models before anything is built.
"""

from __future__ import annotations

import dataclasses

ROLES = ("actor", "critic", "reference", "reward")


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """One of the four models and its parallel layout (dp = world_size / (tp * pp))."""

    path: str = "builtin:tiny-llama"
    """An HF model directory, a megatron-rlhf model checkpoint, or ``builtin:NAME``."""
    tp: int = 1
    """Tensor-parallel size: must divide the number of attention heads and of query groups."""
    pp: int = 1
    """Pipeline-parallel size: must divide the number of layers."""


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    device: str = "auto"
    """auto (cuda when a GPU is visible, else cpu), cuda, or cpu (gloo CPU mode)."""
    dtype: str = "auto"
    """Parameter dtype: auto (bf16 on GPU, fp32 on CPU), bf16, fp16 or fp32."""
    seed: int = 1234
    output_dir: str = "runs/default"
    """Where logs, TensorBoard events and checkpoints go."""
    actor: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(path="builtin:tiny-llama"))
    critic: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(path="builtin:tiny-llama-rm"))
    reference: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(path="builtin:tiny-llama"))
    reward: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(path="builtin:tiny-llama-rm"))

    def role(self, name: str) -> ModelConfig:
        return getattr(self, name)
