"""torchrun worker (1 GPU, fp32): the hybrid engine's one native engine across rollouts, with CUDA graphs.

Three rollouts with an optimizer step after each. Argument 2, ``keep`` or ``offload``: the hybrid
engine's offload setting. Per rollout: the engine's cumulative graph captures, the KV cache's
address, and whether its tokens and log-probs equal those of an engine built afresh (capturing its
own graphs) on the same weights with the same seed. Every sequence stays within one KV-length
bucket, so an engine captures one graph per KV cache. Figures go to OUT/results.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.launch import WorkerSession, worker_session


def main(session: WorkerSession) -> None:
    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role
    from megatron_rlhf.hybrid.engine import HybridEngine
    from megatron_rlhf.metrics.phases import PhaseTimer
    from megatron_rlhf.rollout.native import NativeEngine
    from megatron_rlhf.rollout.native_config import NativeEngineConfig
    from megatron_rlhf.rollout.sampling import SamplingParams
    from megatron_rlhf.training.objectives import sft_loss
    from megatron_rlhf.training.optim import OptimConfig, make_train_state
    from megatron_rlhf.training.train import train_step

    env, results = session.env, session.results
    mode = session.args[0]
    role = build_role(
        "actor",
        ModelConfig(path="builtin:tiny-llama"),
        architecture_of("builtin:tiny-llama"),
        world_size=1,
        dtype=torch.float32,
        device=env.device,
    )
    state = make_train_state(role, OptimConfig(lr=1e-3))
    engine_cfg = NativeEngineConfig(max_batch_size=8, max_seq_len=64, graph_kv_bucket=64)
    hybrid = HybridEngine(state, generation_tp=1, engine_cfg=engine_cfg, offload=mode == "offload")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 16, 9, 12)]
    results.update(captures=[], capture_report_s=[], kv_pointer=[], mismatches=[], tokens=[])
    for rollout in range(3):
        params = SamplingParams(temperature=1.0, n=3, max_new_tokens=16, ignore_eos=True, seed=rollout)
        timer = PhaseTimer(torch.device("cuda"))
        completions = hybrid.generate(prompts, params, timer)
        results["captures"].append(hybrid.engine.graph_captures)
        results["capture_report_s"].append(timer.step_metrics()["timing_s/cuda_graph_capture"])
        cache = hybrid.engine.kv_cache
        results["kv_pointer"].append(None if cache is None else cache.data.data_ptr())
        fresh = NativeEngine(role, engine_cfg)
        expected = fresh.generate(prompts, params)
        assert fresh.graph_captures == 1, fresh.graph_captures
        results["mismatches"].append(
            sum(
                (c.token_ids, c.logprobs) != (e.token_ids, e.logprobs)
                for c, e in zip(completions, expected, strict=True)
            )
        )
        results["tokens"].append([c.token_ids for c in completions])
        del fresh
        ids = torch.randint(3, 512, (8, 32), generator=g)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
        train_step(state, batch, sft_loss(role), max_tokens_per_micro_batch=256)
    again = hybrid.generate(prompts, SamplingParams(temperature=1.0, n=3, max_new_tokens=16, ignore_eos=True, seed=0))
    results["weights_changed_tokens"] = [c.token_ids for c in again] != results["tokens"][0]


if __name__ == "__main__":
    with worker_session("cuda") as session:
        main(session)
