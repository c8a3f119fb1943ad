"""A run's curves read back from its metrics.jsonl: the validation table (hand-checked text) and
the PNG (a real image with one panel per figure)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rlhf.metrics.curves import (
    curve_panels,
    curves_figure,
    read_metrics,
    validation_keys,
    validation_table,
    write_curves,
)


def _metrics(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


ROWS = [
    {"split": "validation", "step": 0, "greedy_accuracy": 0.5, "greedy_reward": 0.25, "timing_s/validation": 1.0},
    {"split": "train", "step": 1, "reward/mean": 0.1, "kl/per_sequence": 0.0},
    {"split": "train", "step": 2, "reward/mean": 0.3, "kl/per_sequence": 0.2},
    {"split": "validation", "step": 2, "greedy_accuracy": 0.75, "greedy_reward": None},
    {"split": "rollback", "step": 2, "to_step": 2},
]


def test_rows_by_split_and_the_table(tmp_path: Path) -> None:
    train, validation = read_metrics(_metrics(tmp_path / "metrics.jsonl", ROWS))
    assert [r["step"] for r in train] == [1, 2] and [r["step"] for r in validation] == [0, 2]
    assert validation_keys(validation) == ["greedy_accuracy", "greedy_reward"]  # no timings, no step
    assert validation_table(validation) == (
        "step  greedy_accuracy  greedy_reward\n"
        "   0           0.5000         0.2500\n"
        "   2           0.7500              -"
    )
    assert validation_table([]) == ""


def test_the_steps_a_rollback_undid_are_left_out(tmp_path: Path) -> None:
    """The curve is the one the run kept: a rollback to step 1 drops the rows of steps 2-3 before it;
    the health watch's own validation counts are no curve."""
    rows = [
        {"split": "train", "step": 1, "reward/mean": 0.1},
        {"split": "validation", "step": 1, "greedy_accuracy": 0.5, "health/val_below_best": 0},
        {"split": "train", "step": 2, "reward/mean": 0.0},
        {"split": "validation", "step": 2, "greedy_accuracy": 0.1, "health/val_below_best": 1},
        {"split": "train", "step": 3, "reward/mean": 0.0},
        {"split": "rollback", "step": 3, "to_step": 1, "health/rollbacks": 1},
        {"split": "train", "step": 2, "reward/mean": 0.4},
        {"split": "train", "step": 3, "reward/mean": 0.5},
    ]
    train, validation = read_metrics(_metrics(tmp_path / "metrics.jsonl", rows))
    assert [(r["step"], r["reward/mean"]) for r in train] == [(1, 0.1), (2, 0.4), (3, 0.5)]
    assert [r["step"] for r in validation] == [1]
    assert validation_keys(validation) == ["greedy_accuracy"]


def test_a_long_curve_is_thinned_keeping_both_ends() -> None:
    rows = [{"split": "validation", "step": s, "accuracy": s / 100} for s in range(0, 101, 5)]
    lines = validation_table(rows, max_rows=5).splitlines()
    assert [line.split()[0] for line in lines] == ["step", "0", "25", "50", "75", "100"]


def test_the_png_has_a_panel_per_figure(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    def draw(rows: list[dict], name: str) -> Path | None:
        return write_curves(
            *read_metrics(_metrics(tmp_path / f"{name}.jsonl", rows)),
            tmp_path / f"{name}.png",
            "reward/mean",
            "ppo: test",
        )

    png = draw(ROWS, "curves")
    assert png == tmp_path / "curves.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tall = imread(png).shape[0]
    two = draw(ROWS[1:3], "two")
    assert imread(two).shape[0] < tall  # 2 panels (reward, KL) against 4 (+ two validation figures)
    assert draw([ROWS[-1]], "none") is None


SOURCES = [
    {"split": "validation", "step": 0, "greedy_accuracy": 0.5, "arith/greedy_accuracy": 0.5, "timing_s/validation": 1},
    {"split": "validation", "step": 4, "greedy_accuracy": 0.75, "arith/greedy_accuracy": 0.75},
]
TWO_SOURCES = [
    {
        "split": "validation",
        "step": 0,
        "greedy_accuracy": 0.5,
        "arith/greedy_accuracy": 0.25,
        "gsm/greedy_accuracy": 1,
    },
    {
        "split": "validation",
        "step": 4,
        "greedy_accuracy": 0.75,
        "arith/greedy_accuracy": 1,
        "gsm/greedy_accuracy": 0.5,
    },
]


def test_a_figure_per_data_source_only_with_two_sources() -> None:
    """One source's figures repeat the overall ones: left out of the panels and the table. Two
    sources: each figure's panel holds the overall curve and one per source."""
    train = [{"split": "train", "step": s, "reward/mean": s / 10} for s in (1, 2, 3, 4)]
    assert validation_keys(SOURCES) == ["greedy_accuracy"]
    assert curve_panels(train, SOURCES, "reward/mean") == [
        ("reward/mean", {"": [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]}),
        ("val/greedy_accuracy", {"all": [(0, 0.5), (4, 0.75)]}),
    ]
    assert validation_keys(TWO_SOURCES) == ["greedy_accuracy", "arith/greedy_accuracy", "gsm/greedy_accuracy"]
    assert curve_panels(train, TWO_SOURCES, "reward/mean")[1:] == [
        (
            "val/greedy_accuracy",
            {"all": [(0, 0.5), (4, 0.75)], "arith": [(0, 0.25), (4, 1)], "gsm": [(0, 1), (4, 0.5)]},
        ),
    ]


def test_the_title_is_above_the_panels_and_steps_are_whole() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    train = [{"split": "train", "step": s, "reward/mean": s / 10, "kl/per_sequence": 0.0} for s in (1, 2, 3)]
    fig = curves_figure(curve_panels(train, TWO_SOURCES, "reward/mean"), "ppo: a long title for the run")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    first = fig.axes[0].get_tightbbox(renderer)
    assert len(fig.axes) == 3  # reward, KL, accuracy with its sources
    (title,) = fig.texts
    assert title.get_text() == "ppo: a long title for the run"
    assert title.get_window_extent(renderer).y0 >= first.y1  # wholly above the first panel
    ticks = fig.axes[-1].get_xticks()
    assert isinstance(fig.axes[-1].xaxis.get_major_locator(), MaxNLocator)
    assert all(float(t).is_integer() for t in ticks) and len(ticks) >= 3
    assert len(fig.axes[-1].get_legend().get_texts()) == 3
    plt.close(fig)
