"""Validation during RL (``data.validation``, ``eval_every``, ``eval_before_train``, ``eval.n``):
the figures recomputed from the validation samples the run wrote, at the steps asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.test_ppo import _check_keys, _lowercase_fraction
from tests.launch import run_cli, run_cli_here


@pytest.mark.distributed
def test_validation_figures_match_the_samples_and_run_at_the_asked_steps(tmp_path: Path) -> None:
    # A data_source column (kept as an extra) splits the figures per source.
    train, prompts = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text(
        "".join(json.dumps({"prompt": f"Tell me about thing {i}:", "data_source": "alpha"}) + "\n" for i in range(32))
    )
    prompts.write_text(
        "".join(
            json.dumps({"prompt": f"Say something about item {i}:", "data_source": src}) + "\n"
            for i, src in enumerate(["alpha"] * 3 + ["beta"] * 3)
        )
    )
    out = tmp_path / "run"
    run_cli(
        "ppo",
        "--config",
        "ppo-tiny",
        f"output_dir={out}",
        "max_steps=4",
        "eval_every=2",
        f"data.train=[{train}]",
        f"data.validation=[{prompts}]",
        "eval.n=3",
        "eval.correct_score=0.5",
        "eval.samples=6",
        "data.extra_keys=[data_source]",
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    validations = [r for r in records if r["split"] == "validation"]
    assert [r["step"] for r in validations] == [0, 2, 4]
    _check_keys(records)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    for v in validations:
        rows = [s for s in samples if s.get("split") == "validation" and s["step"] == v["step"]]
        assert len(rows) == 6
        rewards = [_lowercase_fraction(s["response"]) for s in rows]
        assert [s["reward"] for s in rows] == pytest.approx(rewards, abs=1e-6)
        assert v["greedy_reward"] == pytest.approx(sum(rewards) / 6, abs=1e-6)
        assert v["greedy_accuracy"] == pytest.approx(sum(r >= 0.5 for r in rewards) / 6)
        assert v["alpha/greedy_reward"] == pytest.approx(sum(rewards[:3]) / 3, abs=1e-6)
        assert v["beta/greedy_accuracy"] == pytest.approx(sum(r >= 0.5 for r in rewards[3:]) / 3)
        assert 0.0 <= v["sampled_reward"] <= 1.0 and 0.0 <= v["pass_at_3"] <= 1.0


@pytest.mark.distributed
def test_a_watched_figure_of_a_data_source_the_validation_lacks_is_refused_before_the_models(tmp_path: Path) -> None:
    """Before: accepted up front (only its figure part was checked), then a KeyError traceback at the
    first evaluation."""
    train, prompts = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"Tell {i}:", "data_source": "a"}) + "\n" for i in range(16)))
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Say {i}:", "data_source": s}) + "\n" for i, s in enumerate("ab"))
    )
    refused = run_cli_here(
        "ppo", "--config", "ppo-tiny", f"output_dir={tmp_path / 'run'}", f"data.train=[{train}]",
        f"data.validation=[{prompts}]", "data.extra_keys=[data_source]", "eval_every=1", "health.val_patience=2",
        "health.val_metric=c/greedy_accuracy", exit_code=2,
    )  # fmt: skip
    expected = (
        "health.val_metric='c/greedy_accuracy': no validation prompt has the data_source 'c'; they have ['a', 'b']"
    )
    assert expected in refused.stderr
    assert "build+load" not in refused.stdout


@pytest.mark.distributed
def test_data_sources_that_would_share_their_figures_names_are_refused(tmp_path: Path) -> None:
    """Before: 'Math' and 'math' logged under one name, math/..., the later overwriting the earlier."""
    train, prompts = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"Tell {i}:"}) + "\n" for i in range(16)))
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Say {i}:", "data_source": s}) + "\n" for i, s in enumerate(["Math", "math"]))
    )
    refused = run_cli_here(
        "ppo", "--config", "ppo-tiny", f"output_dir={tmp_path / 'run'}", f"data.train=[{train}]",
        f"data.validation=[{prompts}]", "eval_every=1", exit_code=2,
    )  # fmt: skip
    assert "data.validation: the data sources ['Math', 'math'] would log their figures under one name" in refused.stderr
    assert "build+load" not in refused.stdout
