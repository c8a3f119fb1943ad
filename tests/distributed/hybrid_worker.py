"""torchrun worker (2 ranks, gloo): the hybrid engine with a TP2 actor generating at TP1 x DP2.

Greedy completions from the hybrid engine equal those of a TP1 model built independently from the
same weights, before and after an optimizer step (the step's weights are exported to HF and
reloaded), and every rank receives all completions in order. Both of the hybrid engine's offload
settings run, one after the other on a fresh actor: ``offload`` frees the generation copy and KV
cache after each rollout, ``keep`` keeps them (the same storage every rollout). OUT/results.json
holds each setting's figures under its name.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.launch import WorkerSession, worker_session


def main(session: WorkerSession) -> None:
    for mode in ("offload", "keep"):
        session.results[mode] = follow_training(session, mode)


def follow_training(session: WorkerSession, mode: str) -> dict[str, object]:
    """Two rounds of generation with an optimizer step between them, in the offload setting ``mode``."""
    from megatron_rlhf.checkpoint.hf import save_hf_checkpoint
    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role
    from megatron_rlhf.hybrid.engine import HybridEngine
    from megatron_rlhf.metrics.phases import PhaseTimer
    from megatron_rlhf.rollout.native import NativeEngine
    from megatron_rlhf.rollout.native_config import NativeEngineConfig
    from megatron_rlhf.rollout.sampling import SamplingParams
    from megatron_rlhf.training.objectives import sft_loss
    from megatron_rlhf.training.optim import OptimConfig, make_train_state
    from megatron_rlhf.training.train import train_step

    env, out = session.env, session.out / mode
    results: dict[str, object] = {}
    path = "builtin:tiny-llama"
    arch = architecture_of(path)
    actor = build_role(
        "actor", ModelConfig(path=path, tp=2), arch, world_size=2, dtype=torch.float32, device=env.device
    )
    state = make_train_state(actor, OptimConfig(lr=1e-2))
    engine_cfg = NativeEngineConfig(max_batch_size=3, max_seq_len=48)
    hybrid = HybridEngine(state, generation_tp=1, engine_cfg=engine_cfg, offload=mode == "offload")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (4, 7, 2, 9, 5)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)

    def reference(model_path: str) -> list[list[int]]:
        """Greedy tokens of an independently built TP1 (DP2) model; each rank generates them all."""
        role = build_role(
            "ref",
            ModelConfig(path=model_path, tp=1),
            architecture_of(model_path),
            world_size=2,
            dtype=torch.float32,
            device=env.device,
        )
        return [c.token_ids for c in NativeEngine(role, engine_cfg).generate(prompts, greedy)]

    tokens_by_round = []
    for round_ in range(2):
        timer = PhaseTimer(env.device)
        completions = hybrid.generate(prompts, greedy, timer)
        tokens_by_round.append([c.token_ids for c in completions])
        assert [c.prompt_index for c in completions] == list(range(len(prompts)))
        expected = reference(path if round_ == 0 else str(out / "after-step"))
        results[f"round{round_}_mismatches"] = sum(c.token_ids != e for c, e in zip(completions, expected, strict=True))
        results[f"round{round_}_phases"] = list(timer.step_metrics())
        # What the generation copy and the KV cache hold once the rollout is over (freed, or kept).
        copy = list(hybrid.resharder.target.model.parameters())
        results[f"round{round_}_copy_bytes_after"] = sum(p.untyped_storage().nbytes() for p in copy)
        results[f"round{round_}_copy_pointer"] = copy[0].data_ptr()
        cache = hybrid.engine.kv_cache
        results[f"round{round_}_kv_pointer"] = None if cache is None else cache.data.data_ptr()
        ids = torch.randint(3, 512, (4, 24), generator=torch.Generator().manual_seed(round_))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
        train_step(state, batch, sft_loss(actor), max_tokens_per_micro_batch=64)
        save_hf_checkpoint(actor.model, arch, actor.groups, out / "after-step")
    # The step must have changed what the actor generates, or round 1 would prove nothing.
    results["tokens_changed_by_step"] = tokens_by_round[0] != tokens_by_round[1]
    assert results["round0_mismatches"] == 0 and results["round1_mismatches"] == 0, results
    assert results["tokens_changed_by_step"], results
    return results


if __name__ == "__main__":
    with worker_session() as session:
        main(session)
