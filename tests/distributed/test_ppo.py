"""``megatron-rlhf ppo`` as a user runs it (CPU mode, subprocesses, files on disk).

References: the trainer's log-prob recomputation against the engine's sampling log-probs; KL 0
at step 1 where the actor is the reference; every sample's reward recomputed from its text; a
TP1 single-process run against the same run sharded over two ranks; transformers loading the
exported actor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, load_all_tensors, run_torchrun, subprocess_env

MAIN = REPO / "megatron_rlhf" / "__main__.py"
PHASES = ("rollout", "rewards", "reference log-probs", "old log-probs", "advantages", "actor update")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_rlhf", *args], env=subprocess_env(),
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def _records(out_dir: Path, name: str = "metrics") -> list[dict]:
    return [json.loads(line) for line in (out_dir / f"{name}.jsonl").read_text().splitlines()]


def _lowercase_fraction(text: str) -> float:
    return sum(c in "abcdefghijklmnopqrstuvwxyz" for c in text) / len(text) if text else 0.0


@pytest.mark.distributed
def test_default_grpo_run_learns_its_rule_reward(tmp_path: Path) -> None:
    """The built-in run (GRPO, tiny random actor, lowercase-letter reward): the mean reward climbs."""
    out = tmp_path / "run"
    proc = _cli("ppo", f"output_dir={out}", "max_steps=30", "log_every=10")
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "step 30/30" in proc.stdout and "ppo done: mean reward" in proc.stdout
    records = _records(out)
    assert [r["step"] for r in records] == list(range(1, 31))
    assert records[0]["kl/per_sequence"] == 0.0  # the actor still equals the reference
    assert max(r["rollout/logprob_max_abs_diff"] for r in records) < 1e-5
    assert all(f"time/{phase}" in r for r in records for phase in PHASES)
    assert all(r["time/rollout: generation weights (zero copy)"] >= 0 for r in records)
    first, last = (sum(r["reward/mean"] for r in part) / 5 for part in (records[:5], records[-5:]))
    assert last > first + 0.03, (first, last)
    samples = _records(out, "samples")
    assert len(samples) == 30 * 4
    for sample in samples:
        assert sample["reward"] == pytest.approx(_lowercase_fraction(sample["response"]), abs=1e-6)
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out / "hf")
    initial = load_all_tensors(_builtin_dir())
    changed = [name for name, p in exported.state_dict().items() if not torch.equal(p, initial[name])]
    assert changed, "the exported actor equals the initial weights"
    assert json.loads((out / "result.json").read_text())["last_reward_mean"] == records[-1]["reward/mean"]


def _builtin_dir() -> Path:
    from megatron_rlhf.models.builtin import builtin_checkpoint

    return builtin_checkpoint("builtin:tiny-llama")


PPO_ARGS = ("max_steps=2", "prompts_per_step=4", "mini_batch_size=8", "algorithm.advantage_estimator=gae",
            "scoring.use_reward_model=true", "algorithm.kl_penalty.coef=0.05", "algorithm.loss.kl_loss_coef=0",
            "rollout.sampling.max_new_tokens=12")  # fmt: skip
COMPARED = ("reward/mean", "reward/reward_model", "reward/rule/lowercase_fraction", "kl/per_sequence",
            "advantages/mean", "returns/mean", "values/mean", "actor/loss", "actor/grad_norm", "critic/loss",
            "critic/grad_norm", "response/length_mean")  # fmt: skip


@pytest.mark.distributed
def test_ppo_sharded_over_two_ranks_equals_one_process(tmp_path: Path) -> None:
    """PPO with a critic (PP2), reward model and KL penalty: every model sharded over 2 ranks
    (data-parallel size 1 everywhere, so the rollout is the same) gives the TP1 run's figures."""
    single = _cli("ppo", f"output_dir={tmp_path / 'one'}", *PPO_ARGS)
    assert single.returncode == 0, single.stderr[-6000:]
    sharded = run_torchrun(MAIN, 2, "ppo", f"output_dir={tmp_path / 'two'}", *PPO_ARGS, "actor.tp=2", "reference.tp=2",
                           "reward.tp=2", "critic.pp=2", "rollout.tp=2")  # fmt: skip
    assert sharded.returncode == 0, sharded.stderr[-6000:]
    for one, two in zip(_records(tmp_path / "one"), _records(tmp_path / "two"), strict=True):
        for key in COMPARED:
            assert two[key] == pytest.approx(one[key], rel=1e-3, abs=1e-4), (one["step"], key)


@pytest.mark.distributed
def test_ppo_generates_from_resharded_weights(tmp_path: Path) -> None:
    """Actor trained at TP2, generation at TP1 x DP2 from resharded weights: the engine's log-probs
    equal the trainer's recomputation, and the reference (TP1) agrees with the actor at step 1."""
    proc = run_torchrun(MAIN, 2, "ppo", f"output_dir={tmp_path}", "max_steps=2", "actor.tp=2", "rollout.tp=1")
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = _records(tmp_path)
    assert all("time/rollout: generation weights (reshard)" in r for r in records)
    assert max(r["rollout/logprob_max_abs_diff"] for r in records) < 1e-5
    assert records[0]["kl/per_sequence"] < 1e-5
