"""The health watch in the loop (``loop._Steps``), with a task of numbers (no model: checkpoints hold
the loop's state only): a signal in ``roll_back_on`` rolls back to the newest checkpoint from before
its run of steps and applies the recovery; the validation patience, with its rollbacks spent, stops
with exit code 3 after loading the best evaluation's checkpoint."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from megatron_rlhf.trainer.health import HealthConfig
from megatron_rlhf.trainer.loop import LoopConfig, run_loop
from megatron_rlhf.trainer.stop import RunStopped


class _Task:
    name = "numbers"
    num_examples = 64
    batch_size = 2
    batch_description = "numbers, 2 per step"
    layouts = "none"
    headline = ("value", "value")
    eval_every = 1
    eval_before_train = False
    export_role = None
    tokenizer = None

    def __init__(self, kl: dict[int, float], validation: list[float] | None = None) -> None:
        self.kl = kl
        """step -> the KL the step reports on its first visit (else 1.0)."""
        self.validation = None if validation is None else iter(validation)
        self.steps: list[int] = []
        self.recovered: list[tuple[float, float]] = []

    @property
    def evaluate(self) -> Any:
        figures = self.validation
        return None if figures is None else lambda: ({"score": next(figures)}, {})

    def step(self, step: int, epoch: int, indices: list[int]) -> tuple[dict[str, float], dict]:
        kl = self.kl.get(step, 1.0) if step not in self.steps else 1.0
        self.steps.append(step)
        return {"value": float(step), "kl/per_sequence": kl}, {}

    def progress(self, metrics: dict[str, float]) -> str:
        return f"value {metrics['value']}"

    def train_states(self) -> dict:
        return {}

    def changing_weights(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def recover(self, lr_scale: float, kl_scale: float) -> None:
        self.recovered.append((lr_scale, kl_scale))


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_signal_rolls_back_to_the_checkpoint_before_it_with_the_recovery(world_of_one, tmp_path: Path) -> None:
    task = _Task(kl={5: 50.0, 6: 60.0, 7: 70.0})
    health = HealthConfig(max_kl=10.0, signal_steps=2, roll_back_on=["kl_blowup"], lr_factor=0.25, kl_coef_factor=3)
    cfg = LoopConfig(
        output_dir=str(tmp_path), save_hf=False, loggers=["jsonl"], max_steps=8, save_every=2, health=health
    )
    run_loop(cfg, task)
    # KL above 10 at steps 5 and 6: two in a row, back to step 4's checkpoint (step 6's is later);
    # at step 7 only once: a warning, no rollback.
    assert task.steps == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]
    assert task.recovered == [(0.25, 3.0)]
    records = _records(tmp_path)
    train = [r for r in records if r["split"] == "train"]
    assert [r["health/kl_blowup"] for r in train] == [0, 0, 0, 0, 1, 1, 0, 0, 1, 0]
    (rollback,) = [r for r in records if r["split"] == "rollback"]
    assert rollback == {
        "split": "rollback",
        "step": 6,
        "to_step": 4,
        "health/rollbacks": 1,
        "health/lr_scale": 0.25,
        "health/kl_scale": 3.0,
    }
    saved = json.loads((tmp_path / "checkpoints" / "step_8" / "run_state.json").read_text())
    assert saved["loop"]["health"]["rollbacks"] == 1 and saved["loop"]["health"]["lr_scale"] == 0.25
    assert saved["loop"]["reseeded"] == [[5, 6]]


def test_validation_patience_spent_stops_with_exit_3_at_the_best(world_of_one, tmp_path: Path) -> None:
    # Evaluations after steps 1-5: the best at step 2, then three below it.
    task = _Task(kl={}, validation=[0.2, 0.6, 0.5, 0.4, 0.3, 0.6])
    health = HealthConfig(val_patience=3, max_rollbacks=0)
    cfg = LoopConfig(
        output_dir=str(tmp_path),
        save_hf=False,
        loggers=["jsonl"],
        max_steps=8,
        save_every=1,
        keep_last=1,
        health=health,
    )
    with pytest.raises(RunStopped, match=r"after health\.max_rollbacks=0 rollbacks: stopping") as stopped:
        run_loop(cfg, task)
    assert stopped.value.code == 3
    assert task.steps == [1, 2, 3, 4, 5]
    validation = [r for r in _records(tmp_path) if r["split"] == "validation"]
    assert [r["health/val_below_best"] for r in validation] == [0, 0, 1, 2, 3]
    assert [r["health/val_best"] for r in validation] == [0.2, 0.6, 0.6, 0.6, 0.6]
    result = json.loads((tmp_path / "result.json").read_text())
    # The best evaluation's checkpoint, kept by keep_last=1's pruning beside the newest, is what the
    # run ends on; evaluated again (the task's next figure) for the record.
    assert result["exported_step"] == 2 and result["stopped"]["step"] == 5
    assert result["exported_validation"] == {"score": 0.6}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_2", "step_4"]


def test_a_resumed_run_keeps_the_watch_and_its_recovery(world_of_one, tmp_path: Path) -> None:
    """The watch's state is in every checkpoint: a run resumed after a rollback sets the learning
    rates and KL coefficients at the recovered factors before its first step, and counts on from
    its rollbacks (here the only one allowed is spent: the next trigger stops)."""
    health = HealthConfig(max_kl=10.0, roll_back_on=["kl_blowup"], max_rollbacks=1, lr_factor=0.5)
    cfg = LoopConfig(
        output_dir=str(tmp_path), save_hf=False, loggers=["jsonl"], max_steps=4, save_every=1, health=health
    )
    first = _Task(kl={3: 50.0})
    run_loop(cfg, first)
    assert first.steps == [1, 2, 3, 3, 4] and first.recovered == [(0.5, 2.0)]
    again = _Task(kl={6: 50.0})
    with pytest.raises(RunStopped, match=r"after health\.max_rollbacks=1 rollbacks") as stopped:
        run_loop(dataclasses.replace(cfg, max_steps=8), again)
    assert stopped.value.code == 3
    assert again.steps == [5, 6] and again.recovered[0] == (0.5, 2.0)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["stopped"]["rollbacks"] == 1 and result["exported_step"] == 5
