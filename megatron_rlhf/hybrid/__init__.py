"""Hybrid engine: the actor trains in one layout and generates in another, in the same ranks; the
reference follows the actor (in its own layout) when ``reference.update`` says so."""

from megatron_rlhf.hybrid.engine import HybridEngine
from megatron_rlhf.hybrid.memory import TrainingMemory
from megatron_rlhf.hybrid.reference import ReferenceConfig, ReferenceUpdater
from megatron_rlhf.hybrid.reshard import LayoutCopy, WeightResharder, generation_layout

__all__ = [
    "HybridEngine",
    "LayoutCopy",
    "ReferenceConfig",
    "ReferenceUpdater",
    "TrainingMemory",
    "WeightResharder",
    "generation_layout",
]
