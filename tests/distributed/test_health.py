"""The health watch on a real run (``health.*``, ``trainer/health.py``): a reward that turns hostile
after a number of steps (through a reward function that reads the run's step counter) makes the
validation fall; the watch rolls back to the best evaluation's checkpoint with the recovery, then
stops with exit code 3 and exports the best evaluation's model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rlhf.data.builtin import BUILTIN_DATASETS
from tests.distributed.test_ppo import _check_keys
from tests.launch import run_cli, run_cli_here

HOSTILE_AFTER = 12


@pytest.mark.distributed
def test_a_reward_without_spread_is_named_at_steps_1_2_and_4_and_samples_show_several_prompts(tmp_path: Path) -> None:
    """Before: 40 steps of reward 0.0000 and actor loss 0.0000, and no word of why; samples.jsonl
    showed the first prompt's group only."""
    out = tmp_path / "run"
    proc = run_cli_here(
        "ppo", "--config", "ppo-tiny", f"output_dir={out}", "max_steps=4", "samples_per_step=3", "save_hf=false",
        "scoring.rules=[tests.distributed.reward_fixtures:constant]",
    )  # fmt: skip
    notices = [line for line in proc.stdout.splitlines() if ": every advantage is 0" in line]
    assert [line.split("step ")[1].split(":")[0] for line in notices] == ["1", "2", "4"], notices
    assert "(2 steps in a row; next notice at 4)" in notices[1] and "rollout/uniform_group_fraction 1.00" in notices[0]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["group"] for s in samples if s["step"] == 1] == [0, 1, 2]  # the first sample of three prompts


@pytest.mark.distributed
def test_a_hostile_reward_rolls_back_to_the_best_evaluation_then_stops_with_exit_3(tmp_path: Path) -> None:
    rows = BUILTIN_DATASETS["lowercase-prompts"]()
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("".join(json.dumps({**row, "split": "train"}) + "\n" for row in rows))
    val.write_text("".join(json.dumps({**row, "split": "validation"}) + "\n" for row in rows[:64]))
    out = tmp_path / "run"
    proc = run_cli(
        "ppo",
        "--config",
        "ppo-tiny",
        f"output_dir={out}",
        "max_steps=45",
        f"data.train=[{train}]",
        f"data.validation=[{val}]",
        "data.extra_keys=[split]",
        "scoring.rules=[tests.distributed.reward_fixtures:hostile_after]",
        "eval.n=4",
        "eval_every=3",
        "actor_optim.lr=1e-3",
        "algorithm.kl_penalty.coef=0.001",  # the recovery doubles it
        "health.val_patience=2",
        "health.val_metric=sampled_reward",
        "health.max_rollbacks=1",
        exit_code=3,  # one process (under torchrun a rank's exit 3 becomes the launcher's 1)
        env={"HOSTILE_METRICS": str(out / "metrics.jsonl"), "HOSTILE_AFTER_STEPS": str(HOSTILE_AFTER)},
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    _check_keys(records)  # the health/ figures are documented
    rollbacks = [r for r in records if r["split"] == "rollback"]
    assert len(rollbacks) == 1
    first = records[: records.index(rollbacks[0])]
    validations = {r["step"]: r["sampled_reward"] for r in first if r["split"] == "validation"}
    best_step = max(validations, key=lambda step: validations[step])
    assert best_step <= HOSTILE_AFTER + 6  # the validation falls soon after the reward has turned
    rollback = rollbacks[0]
    assert rollback["to_step"] == best_step
    assert (rollback["health/rollbacks"], rollback["health/lr_scale"], rollback["health/kl_scale"]) == (1, 0.5, 2.0)
    # Redone after the best evaluation at half the learning rate, with other prompts.
    after = records[records.index(rollback) + 1 :]
    redone = [r for r in after if r["split"] == "train"]
    assert redone[0]["step"] == best_step + 1
    assert redone[0]["actor/lr"] == pytest.approx(0.5e-3) and first[1]["actor/lr"] == pytest.approx(1e-3)
    assert first[1]["kl/coef"] == pytest.approx(0.001) and redone[0]["kl/coef"] == pytest.approx(0.002)
    # The actor loss's KL coefficient too (the preset's algorithm.loss.kl_loss_coef=0.001).
    assert first[1]["actor/kl_loss_coef"] == pytest.approx(0.001)
    assert redone[0]["actor/kl_loss_coef"] == pytest.approx(0.002)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    shown = [s["prompt"] for s in samples if s["step"] == best_step + 1 and "split" not in s]
    assert len(shown) == 8 and shown[:4] != shown[4:]  # the step's first prompt, then the redone step's

    log = proc.stdout + proc.stderr
    assert f"rolled back to {out / 'checkpoints' / f'step_{best_step}'} (rollback 1 of health.max_rollbacks=1)" in log
    assert "after health.max_rollbacks=1 rollbacks: stopping; exported" in log
    result = json.loads((out / "result.json").read_text())
    assert result["exported_step"] == best_step
    # The exported model is the best evaluation's: evaluated again, it scores that evaluation's figures.
    assert result["exported_validation"]["sampled_reward"] == pytest.approx(validations[best_step], abs=1e-6)
    assert (out / "hf" / "config.json").is_file()
    assert (out / "checkpoints" / f"step_{best_step}").is_dir()  # kept by keep_last's pruning
