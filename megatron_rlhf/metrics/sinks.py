"""Where a run's numbers go: one small class per destination behind one interface (``Sink``), made
by ``build_sinks`` from the names of a run's ``loggers`` setting (``SINKS``).

Global rank 0 writes; every other rank gets an empty ``Sinks``, so callers need no rank checks.
A metric keeps its key in every destination (metrics.jsonl, TensorBoard, wandb): train metrics
under the key itself, validation figures under ``val/<key>`` (metrics.jsonl keeps the key and says
``"split": "validation"``), another split's under ``<split>/<key>``. Rows (``samples.jsonl``) go
to TensorBoard as a markdown table per step (its text tab) and to wandb as a ``wandb.Table`` per
step, under the file's name (``samples``, ``val/samples``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import netrc
import os
import secrets
import string
import time
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from megatron_rlhf.metrics.log import format_eta, is_rank0, log, progress_bar


def strict_json(row: dict[str, Any], indent: int | None = None) -> str:
    """``row`` as strict JSON: a non-finite number becomes null and its key (dotted inside nested
    dicts) is listed under ``nonfinite`` (NaN/Infinity literals are not JSON; other readers fail)."""
    bad: list[str] = []

    def clean(value: Any, key: str) -> Any:
        if isinstance(value, dict):
            return {k: clean(v, f"{key}.{k}" if key else k) for k, v in value.items()}
        if isinstance(value, float) and not math.isfinite(value):
            bad.append(key)
            return None
        return value

    cleaned = clean(row, "")
    return json.dumps({**cleaned, "nonfinite": bad} if bad else cleaned, indent=indent, allow_nan=False)


class Sink:
    """One destination. ``write`` takes a split's figures (``train``, ``validation``) at a step,
    ``write_rows`` rows for ``<name>.jsonl`` (samples); a destination ignores what it does not keep."""

    def write(self, split: str, step: int, values: dict[str, float]) -> None:
        pass

    def write_rows(self, name: str, rows: list[dict[str, Any]]) -> None:
        pass

    def close(self) -> None:
        pass


SPLIT_PREFIXES = {"validation": "val"}
"""The short prefix of a split where splits share one namespace (``val/``, as verl and most
dashboards name validation figures); other splits are prefixed with their own name."""


def scalar_name(split: str, key: str) -> str:
    """A metric's name where splits share one namespace (TensorBoard, wandb): train figures keep
    their key, so they group by its first part (``actor/``, ``timing_s/``); others get a prefix:
    ``val/`` for validation, ``<split>/`` otherwise."""
    return key if split == "train" else f"{SPLIT_PREFIXES.get(split, split)}/{key}"


def rows_by_step(rows: list[dict[str, Any]]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Rows of a row file by (split, step), each without those two keys (rows without a ``split``
    are the training split's)."""
    grouped: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        rest = {k: v for k, v in row.items() if k not in ("split", "step")}
        grouped.setdefault((row.get("split", "train"), row["step"]), []).append(rest)
    return grouped


def row_columns(rows: list[dict[str, Any]]) -> list[str]:
    """Every key of ``rows``, in first-seen order (a key only some rows have, e.g. ``raw_response``, included)."""
    return list(dict.fromkeys(key for row in rows for key in row))


def table_cell(value: Any) -> str | int | float | bool | None:
    """A row's value as a table cell: numbers, text and None as they are, anything else (a token id list) as JSON."""
    return value if value is None or isinstance(value, (str, int, float, bool)) else json.dumps(value)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """``rows`` as a markdown table (TensorBoard's text tab renders it): one column per key, a
    missing value empty, ``|`` escaped and line breaks as ``<br>`` so that each row stays one line."""
    columns = row_columns(rows)

    def cell(value: Any) -> str:
        text = "" if value is None else str(table_cell(value))
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r\n", "\n").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(key)) for key in columns) + " |" for row in rows]
    return "\n".join(lines)


class ConsoleSink(Sink):
    """The progress lines: a train step's every ``log_every`` steps (and the first and last), with
    the ETA; every validation's figures. On a terminal a bar below them (``progress_bar``) follows
    every step, the latest step's figures beside it."""

    def __init__(
        self, progress: Callable[[dict[str, float]], str], total_steps: int, log_every: int, resumed_step: int | None
    ) -> None:
        self.progress, self.total_steps, self.log_every = progress, total_steps, log_every
        self.first_step = (resumed_step or 0) + 1
        self.start = time.perf_counter()
        self.bar = progress_bar(total_steps, "steps", "step", initial=resumed_step or 0)

    def write(self, split: str, step: int, values: dict[str, float]) -> None:
        if split != "train":
            shown = " | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
            log(f"{split} at step {step}: {shown}")
            return
        if step % self.log_every == 0 or step in (self.first_step, self.total_steps):
            eta = (time.perf_counter() - self.start) / (step - self.first_step + 1) * (self.total_steps - step)
            log(f"step {step}/{self.total_steps} | {self.progress(values)} | eta {format_eta(eta)}")
        if self.bar is not None:
            self.bar.set_postfix_str(self.progress(values), refresh=False)
            self.bar.update(step - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class JsonlSink(Sink):
    """``metrics.jsonl`` (one line per split and step: ``{"split", "step", **figures}``) and the row
    files (``samples.jsonl``, made on first use). A resumed run continues each file after the lines
    of the steps up to ``resumed_step`` (later lines, written after that checkpoint, are dropped),
    and metrics.jsonl keeps, whole, the history up to the last rollback the checkpoint knows of:
    the steps left by it and its ``rollback`` record, as an uninterrupted run leaves them."""

    def __init__(
        self, out_dir: Path, resumed_step: int | None, resumed_rollbacks: int, history: str | None = None
    ) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir, self.resumed_step, self.resumed_rollbacks = out_dir, resumed_step, resumed_rollbacks
        self.history = history
        self.files = {"metrics": self._open("metrics")}

    def _open(self, name: str) -> Any:
        path = self.out_dir / f"{name}.jsonl"
        if self.resumed_step is not None and name == "metrics" and self.history is not None:
            # The checkpoint's own copy: whole even where this file is missing (a requeue onto a node
            # without it) or stale (an older copy of output_dir).
            return self._rewritten(path, self.history)
        if self.resumed_step is not None and name != "metrics" and not path.is_file():
            log(
                f"note: {path} is not here to continue: it starts at step {self.resumed_step + 1}. Checkpoints "
                f"carry metrics.jsonl's history, not {path.name}'s rows: those of steps up to "
                f"{self.resumed_step} are where the run wrote them before (e.g. another node's output_dir)"
            )
        if self.resumed_step is None or not path.is_file():
            return path.open("w", encoding="utf-8")
        lines = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True) if line.endswith("\n")]
        rows = [json.loads(line) for line in lines]
        rollbacks = [at for at, row in enumerate(rows) if row.get("split") == "rollback"]
        # Before the checkpoint's last rollback: all of it. After: its steps, and no later rollback's record.
        history = rollbacks[self.resumed_rollbacks - 1] + 1 if 0 < self.resumed_rollbacks <= len(rollbacks) else 0
        kept = lines[:history] + [
            line
            for line, row in zip(lines[history:], rows[history:], strict=True)
            if row["step"] <= self.resumed_step and row.get("split") != "rollback"
        ]
        return self._rewritten(path, "".join(kept))

    @staticmethod
    def _rewritten(path: Path, text: str) -> Any:
        """``path`` holding ``text``, open for appending. Through a new file and a rename: a kill
        meanwhile leaves the whole history, never part of it."""
        rewritten = path.with_name(f".{path.name}.resumed")
        rewritten.write_text(text, encoding="utf-8")
        os.replace(rewritten, path)
        return path.open("a", encoding="utf-8")

    def _append(self, name: str, rows: list[dict[str, Any]]) -> None:
        if name not in self.files:
            self.files[name] = self._open(name)
        self.files[name].write("".join(strict_json(row) + "\n" for row in rows))
        self.files[name].flush()

    def write(self, split: str, step: int, values: dict[str, float]) -> None:
        self._append("metrics", [{"split": split, "step": step, **values}])

    def write_rows(self, name: str, rows: list[dict[str, Any]]) -> None:
        if rows:
            self._append(name, rows)

    def close(self) -> None:
        for handle in self.files.values():
            handle.close()


class TensorBoardSink(Sink):
    """TensorBoard events under ``log_dir``; figures that are not finite numbers are left out; rows
    (samples) as a markdown table per step. A resumed run purges the events written after its
    checkpoint's step."""

    def __init__(self, log_dir: Path, resumed_step: int | None, history: str | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A fresh run replaces an earlier attempt's events (the directory may hold them); a resumed
        # one, those written after its checkpoint.
        purge = 0 if resumed_step is None else resumed_step + 1
        replay = resumed_step is not None and history is not None and not any(log_dir.glob("events.out.tfevents.*"))
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)
        if replay:  # a resume on a node without the events: the figures the checkpoint's history holds
            for row in map(json.loads, (history or "").splitlines()):
                self.write(row.pop("split"), row.pop("step"), row)

    def write(self, split: str, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(scalar_name(split, key), value, step)

    def write_rows(self, name: str, rows: list[dict[str, Any]]) -> None:
        for (split, step), step_rows in rows_by_step(rows).items():
            self.writer.add_text(scalar_name(split, name), markdown_table(step_rows), step)

    def close(self) -> None:
        self.writer.close()


@dataclasses.dataclass(kw_only=True)
class WandbConfig:
    """Where the ``wandb`` logger sends a run (read only when ``loggers`` lists wandb)."""

    project: str = "megatron-rlhf"
    """The wandb project (the entity is wandb's default, or the WANDB_ENTITY environment variable)."""
    name: str = ""
    """The run's name; empty: the last part of output_dir."""
    mode: Literal["", "online", "offline", "disabled"] = ""
    """online, offline (files under output_dir/wandb; `wandb sync` uploads them later) or disabled;
    empty: the WANDB_MODE environment variable, else online."""


def new_wandb_run_id() -> str:
    """The wandb run id of a fresh run: ``WANDB_RUN_ID`` when set (to continue a known wandb run),
    else a new one as wandb makes them (8 random base-36 digits; wandb has no public function for
    it). Kept in the run's checkpoints, so that a resumed run continues the same wandb run."""
    digits = string.ascii_lowercase + string.digits
    return os.environ.get("WANDB_RUN_ID") or "".join(secrets.choice(digits) for _ in range(8))


class WandbSink(Sink):
    """The wandb run ``run_id`` (None: a new one) under ``out_dir/wandb`` holding the run's resolved
    config, continued if it exists (a resumed run: online, its history goes on; offline, another
    ``offline-run-*-<id>`` directory, which ``wandb sync`` uploads into the same run); each step's
    figures are one row of its history at that step, and its rows (samples) a ``wandb.Table`` in
    that row."""

    def __init__(self, settings: WandbConfig, out_dir: Path, config: dict[str, Any], run_id: str | None) -> None:
        import wandb

        out_dir.mkdir(parents=True, exist_ok=True)
        self.new_table = wandb.Table
        self.run = wandb.init(
            project=settings.project,
            name=settings.name or out_dir.resolve().name,
            mode=settings.mode or None,
            dir=str(out_dir),
            config=config,
            id=run_id or new_wandb_run_id(),
            resume="allow",
        )

    def write(self, split: str, step: int, values: dict[str, float]) -> None:
        self.run.log({scalar_name(split, key): value for key, value in values.items()}, step=step)

    def write_rows(self, name: str, rows: list[dict[str, Any]]) -> None:
        for (split, step), step_rows in rows_by_step(rows).items():
            columns = row_columns(step_rows)
            data = [[step, *(table_cell(row.get(key)) for key in columns)] for row in step_rows]
            table = self.new_table(columns=["step", *columns], data=data)
            self.run.log({scalar_name(split, name): table}, step=step)

    def close(self) -> None:
        self.run.finish()


class Sinks(Sink):
    """Several sinks as one: every call goes to each, in order."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self.sinks = list(sinks)

    def write(self, split: str, step: int, values: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.write(split, step, values)

    def write_rows(self, name: str, rows: list[dict[str, Any]]) -> None:
        for sink in self.sinks:
            sink.write_rows(name, rows)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


@dataclasses.dataclass(frozen=True, kw_only=True)
class SinkSetup:
    """What a run's sinks are made from; each takes what it needs."""

    out_dir: Path
    total_steps: int
    log_every: int
    progress: Callable[[dict[str, float]], str]
    """A train step's figures -> the middle of its console line."""
    wandb: WandbConfig
    config: dict[str, Any]
    """The run's resolved config, recorded with the wandb run."""
    resumed_step: int | None = None
    """The checkpoint step a resumed run continues from; None: a fresh run (files start empty)."""
    resumed_rollbacks: int = 0
    """The rollbacks behind the checkpoint resumed (each left steps and wrote a ``rollback`` record)."""
    history: str | None = None
    """The checkpoint resumed's copy of metrics.jsonl, as it was at its step (None: the checkpoint
    keeps none): what metrics.jsonl continues from, and TensorBoard where its events are missing."""
    wandb_run_id: str | None = None
    """The wandb run to write to: the one a resumed run's checkpoint kept, or a fresh run's
    ``new_wandb_run_id``; None: a new one (kept nowhere)."""


SINKS: dict[str, Callable[[SinkSetup], Sink]] = {
    "console": lambda setup: ConsoleSink(setup.progress, setup.total_steps, setup.log_every, setup.resumed_step),
    "jsonl": lambda setup: JsonlSink(setup.out_dir, setup.resumed_step, setup.resumed_rollbacks, setup.history),
    "tensorboard": lambda setup: TensorBoardSink(setup.out_dir / "tb", setup.resumed_step, setup.history),
    "wandb": lambda setup: WandbSink(setup.wandb, setup.out_dir, setup.config, setup.wandb_run_id),
}
"""The ``loggers`` a run may name, and how each sink is made."""


def logger_errors(field: str, names: Sequence[str], wandb: WandbConfig) -> list[str]:
    """Problems with a ``loggers`` list: unknown or repeated names, and wandb without its package
    or, online, without credentials (found here, at start-up, rather than after the models are built)."""
    errors = [
        f"{field}={list(names)}: unknown logger {name!r}; choose from {list(SINKS)}"
        for name in names
        if name not in SINKS
    ]
    errors += [
        f"{field}={list(names)}: {name!r} is listed twice" for name in sorted(set(names)) if names.count(name) > 1
    ]
    if "wandb" in names and importlib.util.find_spec("wandb") is None:
        errors.append(
            f"{field}={list(names)} lists wandb, but the wandb package is not installed: "
            "pip install wandb (or leave wandb out of loggers)"
        )
    elif (
        "wandb" in names
        and (wandb.mode or os.environ.get("WANDB_MODE") or "online") == "online"
        and not _has_wandb_credentials()
    ):
        errors.append(
            f"{field}={list(names)} lists wandb online, but no wandb credentials were found (WANDB_API_KEY, "
            "or `wandb login`'s entry in ~/.netrc): log in, or set wandb.mode=offline (files under "
            "output_dir/wandb, `wandb sync` later)"
        )
    return errors


def _has_wandb_credentials() -> bool:
    """What wandb reads to log in without asking: WANDB_API_KEY, or its host's entry in the netrc file."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def build_sinks(names: Sequence[str], setup: SinkSetup) -> Sinks:
    """The sinks ``names`` (in that order) on global rank 0; none on the other ranks."""
    return Sinks([SINKS[name](setup) for name in names] if is_rank0() else [])
