"""The hybrid engine: the actor's train -> generate -> train switch, in one object made once.

``generate`` runs, in order: release the training memory when offloading (``hybrid.offload``: grad
buffers freed once the model has taken an optimizer step, optimizer state to pinned CPU), bring the
generation weights up to date (zero copy when the layouts match, else a resharding copy written in
place into the generation layout), generate with the run's one native engine on this rank's share
of the prompts (data parallel over the generation layout; a LoRA actor's generation weights are
the merged ``W + scale * B @ A``, and where they are the actor's own weights its base is put back
bit-exactly right after), and when offloading free the KV cache,
the CUDA graphs and the generation copy and restore the training memory. Every rank gets all
completions. Each of these parts is timed into the caller's phase timer, under the phase it
has open (ppo's ``timing_s/gen/<part>``). No process group is created after construction.

What stays allocated between rollouts follows the offload decision. Without offloading (the
generation memory fits beside the training memory; always on CPU) the engine keeps its KV cache,
its CUDA graphs and the generation copy from one rollout to the next and the weights are refreshed
into the same storage: graphs are captured once per run (again only for a rollout with another
slot count, e.g. validation, or a KV-length bucket not reached before). With offloading that memory
is what the optimizer state comes back into, so it is freed after each rollout and the next one
allocates and captures again: a graph records raw addresses, and the allocator gives no way to get
the same addresses back (the engine recaptures whenever the weights it read have moved).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_rlhf.hybrid.memory import TrainingMemory
from megatron_rlhf.hybrid.reshard import WeightResharder
from megatron_rlhf.metrics.phases import PhaseTimer
from megatron_rlhf.rollout.engine import Agent, Completion
from megatron_rlhf.rollout.native import NativeEngine, generate_data_parallel
from megatron_rlhf.rollout.native_config import NativeEngineConfig
from megatron_rlhf.rollout.sampling import SamplingParams
from megatron_rlhf.training.optim import TrainState


class HybridEngine:
    """The ``RolloutEngine`` of the actor trained here: generation in the actor's own memory."""

    def __init__(
        self, actor: TrainState, generation_tp: int, engine_cfg: NativeEngineConfig, *, offload: bool = True
    ) -> None:
        self.actor = actor
        self.memory = TrainingMemory(actor) if offload else None
        self.resharder = WeightResharder(actor.role, generation_tp)
        self.engine = NativeEngine(self.resharder.target, engine_cfg)
        self.device = next(actor.role.model.parameters()).device

    @property
    def layout_description(self) -> str:
        """Where generation runs, for the start-up report: ``generation TP2xPP1xDP4 (resharded
        from the actor's TP4xPP2xDP1)``, or ``(zero copy: the actor's training layout)``."""
        train, generation = self.actor.role.groups.layout, self.resharder.target.groups.layout
        how = (
            "zero copy: the actor's training layout"
            if self.resharder.zero_copy
            else f"resharded from the actor's {train}"
        )
        return f"generation {generation} ({how})"

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        timer: PhaseTimer | None = None,
        agent: Agent | None = None,
    ) -> list[Completion]:
        """All completions (every rank gets all of them, ordered; multi-turn trajectories with
        ``agent``); ``timer`` gets the switch's parts (release, generation weights, generate, CUDA
        graph capture, free, restore)."""
        parts = timer if timer is not None else PhaseTimer(self.device)

        if self.memory is not None:
            with parts.part("release training memory"):
                self.memory.to_generation()

        with parts.part("generation weights" + (" (zero copy)" if self.resharder.zero_copy else " (reshard)")):
            self.resharder.refresh()

        captured = self.engine.graph_capture_seconds
        try:
            with parts.part("generate"):
                completions = generate_data_parallel(self.engine, prompts, params, agent=agent)
        finally:
            if self.resharder.merges_in_place:  # a LoRA actor generating from its own weights
                with parts.part("lora base weights back"):
                    self.resharder.restore()
        if self.device.type == "cuda" and self.engine.cfg.cuda_graphs:  # part of generate
            parts.add("cuda graph capture", self.engine.graph_capture_seconds - captured)

        if self.memory is not None:
            with parts.part("free generation memory"):
                self.engine.release()  # KV cache and graphs (emptying the allocator's cache)
                self.resharder.release()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

            with parts.part("restore training memory"):
                self.memory.to_training()
        return completions
