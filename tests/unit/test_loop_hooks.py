"""What the training loop does around its steps: it freezes the objects set-up left for the cyclic
GC during the steps (and gives them back when the run ends), it profiles the steps
``profile_steps`` names, phase by phase, and it says what each epoch leaves untrained."""

from __future__ import annotations

import gc
import gzip
import json
import re
import weakref
from pathlib import Path

import pytest
import torch

from megatron_rlhf.metrics.kernels import _merged_length
from megatron_rlhf.metrics.log import phase_range, timed
from megatron_rlhf.trainer.loop import LoopConfig, epochs_line, run_loop


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
        with timed("work", torch.device("cpu"), quiet=True):  # a phase with an inner one, as ppo's gen
            torch.randn(64, 64) @ torch.randn(64, 64)
            with phase_range("work/inner"):
                torch.randn(8).sum()
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

    def recover(self, lr_scale: float, kl_scale: float) -> None:
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


def test_merged_length_counts_overlaps_once() -> None:
    # [0, 3] (two overlapping spans) + [5, 6] (one holding another) = 4
    assert _merged_length([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (5.5, 5.7)]) == 4.0
    assert _merged_length([]) == 0.0


def test_profile_steps_write_a_phase_report_and_a_trace_of_those_steps_only(world_of_one, tmp_path: Path) -> None:
    cfg = LoopConfig(
        output_dir=str(tmp_path), save_hf=False, save_final=False, loggers=["jsonl"], max_steps=2, profile_steps=[2]
    )
    run_loop(cfg, _CountingTask())
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == [
        "step_2.json",
        "step_2.trace.json.gz",
        "step_2.txt",
    ]
    report = (tmp_path / "profile" / "step_2.txt").read_text().splitlines()
    assert report[0] == "2 phase ranges; CPU operators (no GPU kernels ran)"
    outer = next(i for i, line in enumerate(report) if line.startswith("work: "))
    inner = next(i for i, line in enumerate(report) if line.startswith("  work/inner: "))
    assert outer < inner
    calls = [int(re.search(r"(\d+) operator calls", report[i]).group(1)) for i in (outer, inner)]
    assert calls[0] > calls[1] > 0  # the inner range's operators are also the outer one's
    assert any("aten::mm" in line for line in report[outer:inner])  # the matmul ran in the outer range only
    assert not any("aten::mm" in line for line in report[inner:])
    figures = json.loads((tmp_path / "profile" / "step_2.json").read_text())
    assert not figures["on_gpu"]
    assert [(p["name"], p["depth"]) for p in figures["phases"]] == [("work", 0), ("work/inner", 1)]
    assert [p["launches"] for p in figures["phases"]] == calls  # the figures the text reports
    assert all(0 < p["busy_ms"] <= p["wall_ms"] for p in figures["phases"])
    trace = json.loads(gzip.decompress((tmp_path / "profile" / "step_2.trace.json.gz").read_bytes()))
    assert {"phase/work", "phase/work/inner"} <= {event.get("name") for event in trace["traceEvents"]}


def test_profile_steps_count_from_one() -> None:
    errors = LoopConfig(output_dir="x", profile_steps=[0, 3]).errors()
    assert any("profile_steps=[0, 3]" in e for e in errors)
    assert not LoopConfig(output_dir="x", profile_steps=[1]).errors()


@pytest.mark.parametrize(
    "examples, per_epoch, total, said",
    [
        (12, 3, 6, "sft: 12 examples: 3 steps per epoch; 6 steps (2.00 epochs)"),
        (10, 2, 2, "sft: 10 examples: 2 steps per epoch (2 examples of the shuffle are never trained: a step takes "
         "whole batches); 2 steps (1.00 epochs)"),
        (10, 2, 6, "sft: 10 examples: 2 steps per epoch (2 examples of each epoch's shuffle are left out of its steps, "
         "other ones each epoch); 6 steps (3.00 epochs)"),
    ],
)  # fmt: skip
def test_the_examples_a_run_of_one_epoch_never_trains_are_said_so(examples, per_epoch, total, said) -> None:
    """10 examples in batches of 4 for one epoch: the log said the 2 left over were "left for later
    epochs", and there were none."""
    assert epochs_line("sft", examples, "examples", 4, per_epoch, total) == said
