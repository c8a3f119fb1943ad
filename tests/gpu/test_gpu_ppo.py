"""GPU tier: ``megatron-rlhf ppo`` on GPUs, fp32 so the engine's log-probs can be held to the
trainer's recomputation; one GPU (zero-copy generation), and two (TP2 training, TP1 x DP2
generation from resharded weights) when present. The hybrid engine's one native engine keeps its
CUDA graphs across steps (captured once) unless it offloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.launch import run_cli, run_worker

ARGS = (
    "device=cuda",
    "dtype=fp32",
    "max_steps=3",
    "algorithm.advantage_estimator=gae",
    "scoring.use_reward_model=true",
    "algorithm.kl_penalty.coef=0.05",
)
ONE_BUCKET = ("rollout.engine.graph_kv_bucket=4096", "rollout.sampling.ignore_eos=true")
"""Every decode step in one KV-length bucket (the bucket is capped at max_seq_len): one graph per capture."""


def _check(out: Path, generation: str, *, captured_once: bool = False, warmed_up: bool = False) -> None:
    """The engine's log-probs against the trainer's at every step (a graph reading stale weights
    would break it from step 2 on) and, with ``captured_once``, graphs captured once: at step 1, or
    before it when ``warmed_up`` (the start-up warm-up captured every bucket)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    print(
        json.dumps(
            {k: v for k, v in records[-1].items() if k.startswith(("timing_s/", "rollout/", "reward/"))}, indent=1
        )
    )
    assert [r["step"] for r in records] == [1, 2, 3]
    assert max(r["rollout/logprob_max_abs_diff"] for r in records) < 1e-4
    assert records[0]["kl/per_sequence"] < 1e-5
    assert all(f"timing_s/gen/generation_weights_{generation}" in r for r in records)
    assert all(r["critic/vf_loss"] > 0 and r["actor/grad_norm"] > 0 for r in records)
    if captured_once:
        captures = [r["timing_s/gen/cuda_graph_capture"] for r in records]
        assert (captures[0] == 0) == warmed_up and captures[1:] == [0.0] * (len(records) - 1), captures


@pytest.mark.gpu
@pytest.mark.parametrize("warmup", ["auto", "never"])
def test_ppo_on_one_gpu(warmup: str, tmp_path: Path) -> None:
    run_cli(
        "ppo",
        "--config",
        "ppo-tiny",
        f"output_dir={tmp_path}",
        *ARGS,
        *ONE_BUCKET,
        "hybrid.offload=never",
        f"warmup={warmup}",
    )
    _check(tmp_path, "zero_copy", captured_once=True, warmed_up=warmup == "auto")


@pytest.mark.gpu
def test_ppo_offloading_frees_and_recaptures_the_graphs(tmp_path: Path) -> None:
    run_cli("ppo", "--config", "ppo-tiny", f"output_dir={tmp_path}", *ARGS, *ONE_BUCKET, "hybrid.offload=always")
    _check(tmp_path, "zero_copy")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["timing_s/gen/cuda_graph_capture"] > 0 and "timing_s/gen/free_generation_memory" in r for r in records)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["keep", "offload"])
def test_hybrid_engine_captures_once_and_matches_a_fresh_engine(mode: str, tmp_path: Path) -> None:
    """The hybrid engine's one native engine over three rollouts with optimizer steps between them:
    kept, it captures its graph once and keeps its KV cache; offloading, it captures every rollout.
    Either way each rollout equals an engine built afresh on the same weights and seed."""
    results = run_worker(Path(__file__).with_name("engine_reuse_worker.py"), 1, tmp_path, mode)
    assert results["mismatches"] == [0, 0, 0] and results["weights_changed_tokens"]
    if mode == "keep":
        assert results["captures"] == [1, 1, 1], results["captures"]
        assert results["capture_report_s"][0] > 0 and results["capture_report_s"][1:] == [0.0, 0.0]
        assert len(set(results["kv_pointer"])) == 1 and results["kv_pointer"][0] is not None
    else:
        assert results["captures"] == [1, 2, 3] and results["kv_pointer"] == [None, None, None], results


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ppo_on_two_gpus_with_resharded_generation(tmp_path: Path) -> None:
    run_cli(
        "ppo",
        "--config",
        "ppo-tiny",
        f"output_dir={tmp_path}",
        *ARGS,
        *ONE_BUCKET,
        "hybrid.offload=never",
        "actor.tp=2",
        "rollout.tp=1",
        "critic.pp=2",
        nproc=2,
    )
    _check(tmp_path, "reshard", captured_once=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_grpo_with_a_lora_actor_merged_in_place(dtype: str, tmp_path: Path) -> None:
    """A LoRA actor generating in its own layout on one GPU: its adapters merged into its weights in
    place and the kept base copied back (``tests/distributed/ppo_lora_worker.py``). The base after
    three steps equals a model built without LoRA bit for bit, in bf16 too, where subtracting the
    delta would not give it back; the engine follows the adapters (random B: the trainer's log-probs
    with the adapters unmerged), also when it frees and rebuilds its generation memory."""
    worker = Path(__file__).parents[1] / "distributed" / "ppo_lora_worker.py"
    results = run_worker(worker, 1, tmp_path, "device=cuda", f"dtype={dtype}", timeout=600)
    print(json.dumps(results, indent=1))
    assert results["resharded"] == 0.0 and results["weights_timed"] == 1.0
    assert results["reference_model_built"] == 0.0 and results["reference_is_actor_base"] == 1.0
    assert results["kl_step1"] < 1e-6 and results["base_exact"] == 1.0 and results["adapters_moved"] == 1.0
    # fp32: as for full fine-tuning (_check above); bf16: the engine's kernels round otherwise than the
    # trainer's, so the bar is that the adapters move the log-probs far more than that
    tolerance = 1e-4 if dtype == "fp32" else results["random_b/adapters_effect"] / 4
    for key in ("logprob_max_abs_diff", "random_b/logprob_max_abs_diff", "freeing/logprob_max_abs_diff"):
        assert results[key] < tolerance, (key, results[key], tolerance)
