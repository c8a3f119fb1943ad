"""Samples on the dashboards: a step's rows of samples.jsonl as a markdown table in TensorBoard's
text tab and as a wandb.Table (a real offline wandb run) in that step's history row."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from megatron_rlhf.metrics.sinks import SinkSetup, WandbConfig, build_sinks, markdown_table

ROWS = [
    {"step": 2, "group": 0, "prompt": "a | b", "response": "one\ntwo", "finish_reason": "stop", "reward": 0.5},
    {"step": 2, "group": 1, "prompt": "c", "response": "x", "raw_response": "x</s>", "finish_reason": "stop"}
    | {"reward": 1},
]
VALIDATION = [{"step": 2, "split": "validation", "prompt": "v", "response": "w", "reward": 0.25}]


def _setup(out_dir: Path) -> SinkSetup:
    return SinkSetup(
        out_dir=out_dir,
        total_steps=3,
        log_every=1,
        progress=lambda m: "",
        wandb=WandbConfig(project="megatron-rlhf-tests", mode="offline"),
        config={},
    )


def test_markdown_table_hand_written() -> None:
    assert markdown_table([{k: v for k, v in row.items() if k != "step"} for row in ROWS]) == (
        "| group | prompt | response | finish_reason | reward | raw_response |\n"
        "|---|---|---|---|---|---|\n"
        "| 0 | a \\| b | one<br>two | stop | 0.5 |  |\n"
        "| 1 | c | x | stop | 1 | x</s> |"
    )


def test_samples_go_to_tensorboard_as_text(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = build_sinks(["tensorboard"], _setup(tmp_path))
    sinks.write("train", 2, {"reward/mean": 0.75})
    sinks.write_rows("samples", ROWS)
    sinks.write_rows("samples", VALIDATION)
    sinks.close()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    texts = {
        tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(tag)]
        for tag in events.Tags()["tensors"]
    }
    assert texts == {
        "samples/text_summary": [(2, markdown_table([{k: v for k, v in r.items() if k != "step"} for r in ROWS]))],
        "val/samples/text_summary": [(2, "| prompt | response | reward |\n|---|---|---|\n| v | w | 0.25 |")],
    }


def test_samples_go_to_wandb_as_a_table_and_a_run_id_continues(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sinks given one run id (a run and its resume) write two offline directories of that one
    wandb run; each step's samples are a table file holding its rows, the step first."""
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    for step in (2, 3):
        sinks = build_sinks(["wandb"], dataclasses.replace(_setup(tmp_path), wandb_run_id="h4test01"))
        sinks.write("train", step, {"reward/mean": 0.75})
        sinks.write_rows("samples", [{**row, "step": step} for row in ROWS])
        sinks.close()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    # offline-run-<time>-<run id>, and a "-1" after it when both started in the same second
    assert [re.fullmatch(r"offline-run-\d{8}_\d{6}-(\w+)(-\d+)?", run.name)[1] for run in runs] == ["h4test01"] * 2
    for run, step in zip(runs, (2, 3), strict=True):
        (table_file,) = (run / "files" / "media" / "table").glob(f"samples_{step}_*.table.json")
        table = json.loads(table_file.read_text())
        assert table["columns"] == ["step", "group", "prompt", "response", "finish_reason", "reward", "raw_response"]
        assert table["data"] == [
            [step, 0, "a | b", "one\ntwo", "stop", 0.5, None],
            [step, 1, "c", "x", "stop", 1, "x</s>"],
        ]
