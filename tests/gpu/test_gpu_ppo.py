"""GPU tier: ``megatron-rlhf ppo`` on GPUs, fp32 so the engine's log-probs can be held to the
trainer's recomputation; one GPU (zero-copy generation), and two (TP2 training, TP1 x DP2
generation from resharded weights) when present."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, run_torchrun

MAIN = REPO / "megatron_rlhf" / "__main__.py"
ARGS = ("device=cuda", "dtype=fp32", "max_steps=3", "algorithm.advantage_estimator=gae", "scoring.use_reward_model=true",
        "algorithm.kl_penalty.coef=0.05")  # fmt: skip


def _check(out: Path, generation: str) -> None:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    print(json.dumps({k: v for k, v in records[-1].items() if k.startswith(("timing_s/", "rollout/", "reward/"))}, indent=1))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert max(r["rollout/logprob_max_abs_diff"] for r in records) < 1e-4
    assert records[0]["kl/per_sequence"] < 1e-5
    assert all(f"timing_s/gen/generation_weights_{generation}" in r for r in records)
    assert all(r["critic/vf_loss"] > 0 and r["actor/grad_norm"] > 0 for r in records)


@pytest.mark.gpu
def test_ppo_on_one_gpu(tmp_path: Path) -> None:
    proc = run_torchrun(MAIN, 1, "ppo", f"output_dir={tmp_path}", *ARGS)
    assert proc.returncode == 0, proc.stderr[-6000:]
    _check(tmp_path, "zero_copy")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ppo_on_two_gpus_with_resharded_generation(tmp_path: Path) -> None:
    proc = run_torchrun(MAIN, 2, "ppo", f"output_dir={tmp_path}", *ARGS, "actor.tp=2", "rollout.tp=1", "critic.pp=2")
    assert proc.returncode == 0, proc.stderr[-6000:]
    _check(tmp_path, "reshard")
