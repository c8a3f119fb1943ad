"""Issue 14's 8-GPU layout in CPU mode (8 gloo processes, one torchrun launch of
``eight_ranks_worker.py``): the actor trained at TP4 x PP2 and generating at TP2 x DP4.

* Generation from the resharded copy equals an unsharded (TP1 x PP1) model built from the same
  checkpoint: greedy and sampled tokens, log-probs to 1e-5, also after an optimizer step.
* ``megatron-rlhf ppo`` runs 2 steps of PPO with a critic (GAE), one epoch, actor and critic at
  TP4 x PP2, the reference at TP2 x DP4 and the reward model at PP2 x DP4, generation at TP2 x DP4.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from tests.launch import command, run, worker_results

WORKER = Path(__file__).with_name("eight_ranks_worker.py")
TOLERANCE = 1e-5
PPO_ARGS = (
    "device=cpu",
    "max_steps=2",
    "log_every=1",
    "loggers=[console,jsonl]",
    "save_hf=false",
    # builtin:arith-llama: 4 heads, 4 KV heads, 4 layers (builtin:tiny-llama's 2 KV heads refuse TP4)
    "actor.path=builtin:arith-llama",
    "actor.tp=4",
    "actor.pp=2",
    "critic.path=builtin:arith-llama-rm",
    "critic.tp=4",
    "critic.pp=2",
    "reference.path=builtin:arith-llama",
    "reference.tp=2",
    "reference.pp=1",
    "reward.path=builtin:arith-llama-rm",
    "reward.tp=1",
    "reward.pp=2",
    "rollout.tp=2",
    "rollout.sampling.n=1",
    "rollout.sampling.max_new_tokens=8",
    "rollout.engine.max_seq_len=64",
    "data.train=[builtin:arithmetic-prompts]",
    "data.extra_keys=[answer]",
    "data.max_prompt_length=24",
    "scoring.use_reward_model=true",
    "scoring.rules=[arithmetic_answer]",
    "algorithm.advantage_estimator=gae",
    "algorithm.kl_penalty.coef=0.05",
    "algorithm.loss.kl_loss_coef=0",
    "prompts_per_step=8",
    "mini_batch_size=8",
    "ppo_epochs=1",
)
LAYOUT_LINE = (
    "layouts: actor TP4xPP2xDP1, critic TP4xPP2xDP1, reference TP2xPP1xDP4, reward TP1xPP2xDP4; "
    "generation TP2xPP1xDP4 (resharded from the actor's TP4xPP2xDP1)"
)


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("eight")
    proc = run(command(8, str(out), f"output_dir={out / 'run'}", *PPO_ARGS, script=WORKER), timeout=600)
    return out, proc


@pytest.mark.distributed
@pytest.mark.parametrize("model", ["llama", "arith"])
def test_tp2_dp4_generation_equals_the_unsharded_model(
    launch: tuple[Path, subprocess.CompletedProcess], model: str
) -> None:
    """The hybrid engine's TP2 x DP4 copy of a TP4 x PP2 actor against a TP1 x PP1 model."""
    results = worker_results(launch[0])
    assert results[f"{model}/layouts"] == ["TP4xPP2xDP1", "TP2xPP1xDP4"]
    assert "timing_s/generation_weights_reshard" in results[f"{model}/phases"]
    for case in ("greedy", "sampled", *(("after_step_greedy",) if model == "llama" else ())):
        assert results[f"{model}/{case}/sequences"] > 0
        assert results[f"{model}/{case}/token_mismatches"] == 0, case
        assert results[f"{model}/{case}/logprob_max_abs_diff"] < TOLERANCE, case
    assert results[f"{model}/sampled_differs_from_greedy"]
    if model == "llama":
        assert results["llama/step_changed_tokens"]


@pytest.mark.distributed
def test_ppo_trains_at_tp4_pp2_and_generates_at_tp2_dp4(launch: tuple[Path, subprocess.CompletedProcess]) -> None:
    out, proc = launch
    lines = proc.stdout.splitlines()
    assert LAYOUT_LINE in lines, proc.stdout[-3000:]
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2]
    for record in records:
        numbers = {k: v for k, v in record.items() if k not in ("split", "step")}
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in numbers.values()), record
        assert "timing_s/gen/generation_weights_reshard" in record
        assert record["actor/update_skipped"] == 0 and record["critic/update_skipped"] == 0
        assert "critic/vf_loss" in record and "values/mean" in record  # PPO with a critic
        # The engine's log-probs (TP2 x DP4 copy) equal the trainer's recomputation at TP4 x PP2.
        assert record["rollout/logprob_max_abs_diff"] < TOLERANCE
    assert records[0]["kl/per_sequence"] == pytest.approx(0.0, abs=TOLERANCE)  # reference (TP2) = actor at step 1
    assert (out / "run" / "checkpoints" / "step_2").is_dir()
