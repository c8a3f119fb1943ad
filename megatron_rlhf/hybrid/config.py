"""The hybrid engine's settings (``hybrid``) and the reference's (``reference``), apart from the
engine so that reading and checking a config imports no megatron-core."""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_rlhf.checkpoint.sources import ModelConfig
from megatron_rlhf.config.fields import at_least, check_on_init

OffloadMode = Literal["auto", "always", "never"]


@dataclasses.dataclass(kw_only=True)
class HybridConfig:
    offload: OffloadMode = "auto"
    """Move the actor's optimizer state and gradient buffers off the GPU while generating: always,
    never, or auto (only when generation's KV cache and weights would not fit beside them; the
    decision and its figures are printed at start-up). Without offloading, generation's memory (KV
    cache, CUDA graphs, a resharded copy) stays allocated through training, so that the run
    captures its graphs once; with it, that memory is freed after every rollout."""

    def __post_init__(self) -> None:
        check_on_init(self)

    def errors(self) -> list[str]:
        return []


@dataclasses.dataclass(kw_only=True)
class ReferenceConfig(ModelConfig):
    """The reference model, its layout, and whether it follows the actor during RL."""

    update: Literal["none", "periodic", "ema"] = "none"
    """none: fixed reference; periodic: copy the actor into it every update_every steps; ema: after
    every step ref <- ema_decay * ref + (1 - ema_decay) * actor. Needs the actor's architecture."""
    update_every: int = 100
    """periodic: RL steps between copies (the copy follows the actor update of steps N, 2N, ...)."""
    ema_decay: float = 0.99
    """ema: weight of the current reference in each step's mix (in [0, 1))."""

    def __post_init__(self) -> None:
        check_on_init(self)

    def errors(self) -> list[str]:
        errors = super().errors() + at_least(self, 1, "update_every")
        if not 0 <= self.ema_decay < 1:
            errors.append(f"ema_decay={self.ema_decay} must be in [0, 1)")
        return errors
