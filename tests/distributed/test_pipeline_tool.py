"""The tool task's CPU pipeline (preset ``pipeline-arith-tool-tiny``) on 2 ranks: SFT on a teacher
that calls the calculator on 30% of the problems, then multi-turn GRPO with the calculator, must
raise held-out greedy accuracy (the tool available) by the issue's 20 points, by calling the tool
more. The accuracies are recomputed from the trajectories the test stage wrote; ``generate`` with
the calculator then writes the GRPO model's trajectories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rlhf.tasks.arithmetic import judge
from megatron_rlhf.tasks.arithmetic_tool import CALL_OPEN
from tests.launch import run_cli

MIN_GAIN = 0.20
"""The issue's bar for the tool task on CPU. When written, the preset's SFT model answered 2.2% of
the held-out problems right (greedy, calling the tool on 2.2% of them), and a single-turn stand-in
of its GRPO stage took it to 83.2% (docs/benchmarks.md, "The tool task")."""


def _rows(test_dir: Path, model: str) -> list[dict]:
    rows = [json.loads(line) for line in (test_dir / f"{model}.jsonl").read_text().splitlines()]
    assert len(rows) == 500
    return rows


def _recomputed_accuracy(rows: list[dict]) -> float:
    """The share of trajectories the judge finds right, each against its problem evaluated here."""
    right = [judge(r["response"], eval(r["prompt"][0]["content"])) == "right" for r in rows]
    return sum(right) / len(rows)


@pytest.mark.distributed
def test_grpo_learns_to_call_the_calculator(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_cli("pipeline", "--config", "pipeline-arith-tool-tiny", f"output_dir={out}", "device=cpu", nproc=2)
    accuracy = json.loads((out / "pipeline.json").read_text())["test_accuracy"]
    assert set(accuracy) == {"sft", "grpo"}
    rows = {model: _rows(out / "test", model) for model in accuracy}
    for model, value in accuracy.items():
        assert value == pytest.approx(_recomputed_accuracy(rows[model]))
    calls = {model: sum(CALL_OPEN in r["response"] for r in rows[model]) / 500 for model in rows}
    assert accuracy["sft"] < 0.1 and calls["sft"] < 0.1  # greedy, it answers directly (arithmetic_tool's docstring)
    assert accuracy["grpo"] - accuracy["sft"] >= MIN_GAIN, (accuracy, calls)
    assert calls["grpo"] > calls["sft"], calls
    # GRPO's validation counts the greedy trajectories' tool calls: more at its end than at its start.
    metrics = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    validation = [row for row in metrics if row["split"] == "validation"]
    tool_calls = [row["multi_turn/tool_calls/mean"] for row in validation]
    assert len(tool_calls) >= 2 and tool_calls[-1] > tool_calls[0], tool_calls
    # `generate` with the calculator: the GRPO model's trajectories call it, read its answers and go on.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows["grpo"][:16]))
    generated = tmp_path / "generated.jsonl"
    run_cli(
        "generate",
        f"model={out / 'grpo' / 'hf'}",
        f"input={prompts}",
        f"output={generated}",
        "device=cpu",
        "rollout.sampling.temperature=0",
        "rollout.sampling.max_new_tokens=40",  # the preset's test stage's
        "rollout.engine.max_seq_len=64",
        "rollout.multi_turn.enable=true",
        "rollout.multi_turn.tool_config_path=builtin:calculator",
        "rollout.multi_turn.max_assistant_turns=2",
    )
    trajectories = [json.loads(line) for line in generated.read_text().splitlines()]
    assert len(trajectories) == 16
    called = [t for t in trajectories if t["tool_calls"] >= 1]
    assert len(called) >= 12, [t["tool_calls"] for t in trajectories]
    for t in called:  # the policy's call, the calculator's answer, the policy's final turn
        assert [turn["role"] for turn in t["turns"]] == ["assistant", "tool", "assistant"], t["turns"]
        assert CALL_OPEN in t["turns"][0]["text"]
