"""The hybrid engine: TP2 training -> TP1 x DP2 generation, equal to an independently built model;
one generation engine per run, its memory freed after each rollout or kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.launch import run_worker

WORKER = Path(__file__).with_name("hybrid_worker.py")


@pytest.fixture(scope="module")
def by_mode(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both offload settings' figures, from one launch."""
    return run_worker(WORKER, 2, tmp_path_factory.mktemp("hybrid"))


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["offload", "keep"])
def test_hybrid_generation_follows_training(mode: str, by_mode: dict) -> None:
    results = by_mode[mode]
    assert results["round0_mismatches"] == 0 and results["round1_mismatches"] == 0
    assert results["tokens_changed_by_step"]
    assert "timing_s/generation_weights_reshard" in results["round1_phases"]
    if mode == "offload":  # the generation copy and the KV cache exist only while generating
        assert results["round0_copy_bytes_after"] == 0 and results["round1_copy_bytes_after"] == 0
        assert results["round0_kv_pointer"] is None and results["round1_kv_pointer"] is None
    else:  # kept, and refreshed in place: the addresses a CUDA graph would read stay valid
        assert (
            results["round0_copy_bytes_after"] > 0 and "timing_s/free_generation_memory" not in results["round1_phases"]
        )
        assert results["round0_copy_pointer"] == results["round1_copy_pointer"]
        assert results["round0_kv_pointer"] == results["round1_kv_pointer"] is not None


@pytest.mark.parametrize("offload", [False, True])
def test_one_engine_serves_every_rollout(offload: bool, world_of_one) -> None:
    """Rollouts with an optimizer step between them, in one process (zero copy): every rollout uses
    the run's one engine, whose KV cache stays in the same storage without offloading and is freed
    with it; each rollout's sampled tokens and log-probs equal those of an engine built afresh on
    the same weights with the same seed."""
    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role
    from megatron_rlhf.hybrid.engine import HybridEngine
    from megatron_rlhf.metrics.phases import PhaseTimer
    from megatron_rlhf.rollout.native import NativeEngine
    from megatron_rlhf.rollout.native_config import NativeEngineConfig
    from megatron_rlhf.rollout.sampling import SamplingParams
    from megatron_rlhf.training.objectives import sft_loss
    from megatron_rlhf.training.optim import OptimConfig, make_train_state
    from megatron_rlhf.training.train import train_step

    role = build_role(
        "actor",
        ModelConfig(path="builtin:tiny-llama"),
        architecture_of("builtin:tiny-llama"),
        world_size=1,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    state = make_train_state(role, OptimConfig(lr=1e-2))
    engine_cfg = NativeEngineConfig(max_batch_size=4, max_seq_len=32)  # fewer slots than samples: slots are reused
    hybrid = HybridEngine(state, generation_tp=1, engine_cfg=engine_cfg, offload=offload)
    engine = hybrid.engine
    assert hybrid.layout_description == "generation TP1xPP1xDP1 (zero copy: the actor's training layout)"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (4, 7, 2)]
    caches, kv_pointers, tokens = [], set(), []
    for rollout in range(3):
        params = SamplingParams(temperature=1.0, n=2, max_new_tokens=10, ignore_eos=True, seed=rollout)
        timer = PhaseTimer(torch.device("cpu"))
        completions = hybrid.generate(prompts, params, timer)
        assert hybrid.engine is engine
        if offload:
            assert engine.kv_cache is None and "timing_s/free_generation_memory" in timer.step_metrics()
        else:
            caches.append(engine.kv_cache)
            kv_pointers.add(engine.kv_cache.data.data_ptr())
        fresh = NativeEngine(role, engine_cfg).generate(prompts, params)
        assert [c.token_ids for c in completions] == [c.token_ids for c in fresh]
        assert [c.logprobs for c in completions] == [c.logprobs for c in fresh]
        tokens.append([c.token_ids for c in completions])
        ids = torch.randint(3, 512, (4, 24), generator=g)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
        train_step(state, batch, sft_loss(role), max_tokens_per_micro_batch=64)
    assert len(kv_pointers) == (0 if offload else 1) and all(cache is caches[0] for cache in caches)
    # Generating again with the first rollout's seed gives other tokens: the steps changed the weights.
    again = hybrid.generate(prompts, SamplingParams(temperature=1.0, n=2, max_new_tokens=10, ignore_eos=True, seed=0))
    assert [c.token_ids for c in again] != tokens[0]
