"""A finished run's curves, read back from its ``metrics.jsonl``: a PNG (``curves.png``) of the
headline training figure, the KL and every validation figure against step, and the validation
curve as a short text table for the final summary.

Reading the file, not the loop's memory, makes both work for a resumed run too: its file holds
every step from the first. matplotlib draws the PNG (headless ``Agg``); without it the PNG is
skipped with a message, nothing else changes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

TRAIN_KEYS = ("kl/per_sequence",)
"""Training figures drawn besides the run's headline metric, when the run logs them."""


def read_metrics(path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train rows, validation rows) of a ``metrics.jsonl``, in file order."""
    train: list[dict[str, Any]] = []
    validation: list[dict[str, Any]] = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        {"train": train, "validation": validation}.get(row.get("split"), []).append(row)
    return train, validation


def validation_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The validation figures worth a curve: numbers, in first-seen order, not timings."""
    keys: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            if key not in ("split", "step") and not key.startswith("timing_s/") and isinstance(value, (int, float)):
                keys[key] = None
    return list(keys)


def validation_table(rows: list[dict[str, Any]], max_keys: int = 4, max_rows: int = 12) -> str:
    """The validation curve as aligned text: step and up to ``max_keys`` figures, at most
    ``max_rows`` rows (evenly thinned, the first and the last always kept)."""
    keys = validation_keys(rows)[:max_keys]
    if not rows or not keys:
        return ""
    keep = (
        sorted({round(i * (len(rows) - 1) / (max_rows - 1)) for i in range(max_rows)})
        if len(rows) > max_rows
        else range(len(rows))
    )
    header = ["step", *keys]
    body = [[str(rows[i]["step"]), *(_cell(rows[i].get(k)) for k in keys)] for i in keep]
    widths = [max(len(line[c]) for line in [header, *body]) for c in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) for line in [header, *body])


def _cell(value: Any) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.4f}"


def write_curves(
    train: list[dict[str, Any]], validation: list[dict[str, Any]], out_png: str | Path, headline: str, title: str
) -> Path | None:
    """Draw ``headline``, ``TRAIN_KEYS`` and the validation figures (rows of ``read_metrics``)
    against step into ``out_png``; returns it, or None when matplotlib is missing or there is
    nothing to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    series = [(key, "train", _points(train, key)) for key in (headline, *TRAIN_KEYS)]
    series += [(key, "validation", _points(validation, key)) for key in validation_keys(validation)]
    series = [s for s in series if s[2]]
    if not series:
        return None
    fig, axes = plt.subplots(len(series), 1, figsize=(6.4, 2.2 * len(series)), sharex=True, squeeze=False)
    for ax, (key, split, points) in zip(axes[:, 0], series, strict=True):
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, marker="o" if split == "validation" else None, markersize=3)
        ax.set_ylabel(key if split == "train" else f"val/{key}", fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)


def _points(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [
        (row["step"], row[key]) for row in rows if isinstance(row.get(key), (int, float)) and math.isfinite(row[key])
    ]
