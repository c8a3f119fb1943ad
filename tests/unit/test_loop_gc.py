"""The training loop freezes the objects set-up left for the cyclic GC during its steps, and
gives them back to it when the run ends."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

from megatron_rlhf.trainer.loop import LoopConfig, run_loop


class _Node:
    """A reference cycle: only the cyclic GC frees it."""

    def __init__(self) -> None:
        self.me = self


class _CountingTask:
    name = "count"
    num_examples = 4
    batch_size = 2
    batch_description = "numbers, 2 per step"
    layouts = "none"
    headline = ("value", "value")
    evaluate = None
    eval_every = 0
    eval_before_train = False
    export_role = None
    tokenizer = None

    def __init__(self) -> None:
        self.frozen_during_steps: list[int] = []

    def step(self, step: int, epoch: int, indices: list[int]):
        self.frozen_during_steps.append(gc.get_freeze_count())
        return {"value": float(sum(indices))}, {}

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


def test_set_up_objects_are_frozen_during_steps_and_collectable_after(world_of_one, tmp_path: Path) -> None:
    gc.unfreeze()
    garbage_after_the_run = _Node()  # made at set-up, dropped once the run is over
    canary = weakref.ref(garbage_after_the_run)
    task = _CountingTask()
    cfg = LoopConfig(output_dir=str(tmp_path), save_hf=False, save_final=False, loggers=["jsonl"], max_steps=2)
    summary = run_loop(cfg, task)
    assert summary["first_value"] + summary["last_value"] == 0 + 1 + 2 + 3  # two steps over the 4 examples
    assert len(task.frozen_during_steps) == 2 and all(count > 0 for count in task.frozen_during_steps)
    assert gc.get_freeze_count() == 0
    del garbage_after_the_run
    gc.collect()
    assert canary() is None
