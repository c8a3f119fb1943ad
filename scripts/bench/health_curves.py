"""The health watch's figure in docs/benchmarks.md: runs' validation accuracy and mean reward against
step, from their metrics.jsonl, each rollback's abandoned steps drawn thin and dashed, the rollbacks
marked.

    python scripts/bench/health_curves.py OUT.png "label=run_dir/metrics.jsonl" ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def segments(rows: list[dict[str, Any]], split: str, key: str) -> list[list[tuple[int, float]]]:
    """The (step, value) points of ``split``'s ``key`` cut into segments at each rollback: every
    segment but the last ends where a rollback left it."""
    out: list[list[tuple[int, float]]] = [[]]
    for row in rows:
        if row["split"] == "rollback":
            out.append([p for p in out[-1] if p[0] <= row["to_step"]][-1:])
        elif row["split"] == split and key in row:
            out[-1].append((row["step"], row[key]))
    return out


def main(out_png: str, runs: list[str]) -> None:
    fig, axes = plt.subplots(2, 1, figsize=(7, 6), sharex=True, layout="constrained")
    for number, run in enumerate(runs):
        label, _, path = run.partition("=")
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        color = f"C{number}"
        for ax, (split, key) in zip(axes, (("validation", "greedy_accuracy"), ("train", "reward/mean")), strict=True):
            parts = segments(rows, split, key)
            for i, part in enumerate(parts):
                if not part:
                    continue
                steps, values = zip(*part, strict=True)
                kept = i == len(parts) - 1
                ax.plot(
                    steps,
                    values,
                    color=color,
                    linestyle="-" if kept else "--",
                    linewidth=1.8 if kept else 0.9,
                    alpha=1.0 if kept else 0.6,
                    marker="o" if split == "validation" else None,
                    markersize=3,
                    label=label if kept else None,
                )
                if not kept:
                    ax.plot(steps[-1], values[-1], "x", color=color, markersize=8)
    axes[0].set_ylabel("validation greedy accuracy")
    axes[1].set_ylabel("mean reward (train)")
    axes[1].set_xlabel("step (dashed: steps a rollback undid, x: rollback)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.savefig(out_png, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
