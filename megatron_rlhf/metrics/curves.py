"""A finished run's curves, read back from its ``metrics.jsonl``: a PNG (``curves.png``) of the
headline training figure, the KL and every validation figure against step (a figure per data
source in one panel, with two sources or more), and the validation curve as a short text table for
the final summary.

Reading the file, not the loop's memory, makes both work for a resumed run too: its file holds
every step from the first. matplotlib draws the PNG (headless ``Agg``); without it the PNG is
skipped with a message, nothing else changes.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TRAIN_KEYS = ("kl/per_sequence",)
"""Training figures drawn besides the run's headline metric, when the run logs them."""
TITLE_WIDTH = 90
"""Characters of the PNG's title per line: as many as its width holds at the title's font size."""


def read_metrics(path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train rows, validation rows) of a ``metrics.jsonl``, in file order, without the rows of
    steps a rollback undid (a ``rollback`` line drops the rows before it of steps after its
    ``to_step``): the run's curve is the one it kept."""
    train: list[dict[str, Any]] = []
    validation: list[dict[str, Any]] = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row.get("split") == "rollback" and isinstance(row.get("to_step"), int):
            train[:] = [r for r in train if r["step"] <= row["to_step"]]
            validation[:] = [r for r in validation if r["step"] <= row["to_step"]]
        {"train": train, "validation": validation}.get(row.get("split"), []).append(row)
    return train, validation


def validation_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The validation figures worth a curve: numbers, in first-seen order, not timings; the figures
    of each data source (``<source>/<figure>``) only with two sources or more (one source's repeat
    the figures over every prompt)."""
    keys: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            if (
                key not in ("split", "step")
                and not key.startswith(("timing_s/", "health/"))  # the watch's own counts: not a figure
                and isinstance(value, (int, float))
            ):
                keys[key] = None
    by_source = figures_by_source(list(keys))
    if len({source for per_figure in by_source.values() for source in per_figure}) >= 2:
        return list(keys)
    return [key for key in keys if not any(key in per_figure.values() for per_figure in by_source.values())]


def figures_by_source(keys: list[str]) -> dict[str, dict[str, str]]:
    """figure -> {data source: key} of the keys ``<source>/<figure>`` whose ``<figure>`` is also a
    key (the same figure over every prompt)."""
    overall = {key for key in keys if "/" not in key}
    by_source: dict[str, dict[str, str]] = {}
    for key in keys:
        source, _, figure = key.partition("/")
        if figure in overall:
            by_source.setdefault(figure, {})[source] = key
    return by_source


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


Curves = dict[str, list[tuple[int, float]]]
"""A panel's curves by name: (step, value) points each."""


def curve_panels(
    train: list[dict[str, Any]], validation: list[dict[str, Any]], headline: str
) -> list[tuple[str, Curves]]:
    """The panels of ``curves.png``, top to bottom, as (label, curves): ``headline`` and
    ``TRAIN_KEYS``, then each validation figure (``val/<key>``: the figure over every prompt, and
    beside it each data source's when the run has two or more); panels without points left out."""
    keys = validation_keys(validation)
    by_source = figures_by_source(keys)
    per_source = {key for per_figure in by_source.values() for key in per_figure.values()}
    panels: list[tuple[str, Curves]] = [(key, {"": _points(train, key)}) for key in (headline, *TRAIN_KEYS)]
    for key in keys:
        if key not in per_source:
            sources = {source: _points(validation, k) for source, k in by_source.get(key, {}).items()}
            panels.append((f"val/{key}", {"all": _points(validation, key)} | sources))
    return [(label, {n: p for n, p in curves.items() if p}) for label, curves in panels if any(curves.values())]


def write_curves(
    train: list[dict[str, Any]], validation: list[dict[str, Any]], out_png: str | Path, headline: str, title: str
) -> Path | None:
    """Draw ``curve_panels`` into ``out_png`` (``curves_figure``); returns it, or None when
    matplotlib is missing or there is nothing to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = curve_panels(train, validation, headline)
    if not panels:
        return None
    fig = curves_figure(panels, title)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)


def curves_figure(panels: list[tuple[str, Curves]], title: str) -> Figure:
    """One panel per entry of ``panels`` against step (whole-number ticks, shared), ``title`` above
    them."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    # constrained layout makes room for the title above the panels (tight_layout drew it over the first)
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(6.4, 0.5 + 2.2 * len(panels)), sharex=True, squeeze=False, layout="constrained"
    )
    for ax, (label, curves) in zip(axes[:, 0], panels, strict=True):
        for name, points in curves.items():
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker="o" if label.startswith("val/") else None, markersize=3, label=name)
        if len(curves) > 1:
            ax.legend(fontsize=7, title="data source", title_fontsize=7)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1, 0].set_xlabel("step")
    fig.suptitle("\n".join(textwrap.wrap(title, TITLE_WIDTH)), fontsize=10)  # a long output_dir path wraps
    return fig


def _points(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [
        (row["step"], row[key]) for row in rows if isinstance(row.get(key), (int, float)) and math.isfinite(row[key])
    ]
