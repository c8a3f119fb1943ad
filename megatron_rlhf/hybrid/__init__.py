"""Hybrid engine: the actor trains in one layout and generates in another, in the same ranks."""

from megatron_rlhf.hybrid.engine import HybridEngine, PhaseReport
from megatron_rlhf.hybrid.memory import TrainingMemory
from megatron_rlhf.hybrid.reshard import WeightResharder, generation_layout

__all__ = ["HybridEngine", "PhaseReport", "TrainingMemory", "WeightResharder", "generation_layout"]
