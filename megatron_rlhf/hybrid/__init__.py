"""Hybrid engine: the actor trains in one layout and generates in another, in the same ranks."""

from megatron_rlhf.hybrid.reshard import WeightResharder, generation_layout

__all__ = ["WeightResharder", "generation_layout"]
