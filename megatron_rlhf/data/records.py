"""Rows of a dataset from ``.jsonl`` / ``.parquet`` files or directories of them.

Each row comes with the file it is in and its 0-based row index in that file, so that every
later error or skip can name both. JSONL rows are the non-blank lines (blank lines are not rows);
a line that is not a JSON object fails naming its 1-based line number. A directory is read in
sorted name order; entries whose names start with ``.`` or ``_`` (``_SUCCESS``, ``.crc``) are
metadata and skipped, anything else that is not a data file is an error rather than ignored.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["DataError", "EXTENSIONS", "Record", "data_files", "read_records", "write_jsonl"]

EXTENSIONS = (".jsonl", ".parquet")
_PARQUET_BATCH_ROWS = 1024


class DataError(ValueError):
    """A dataset file or row is unusable; the message names the file (and row, column)."""


class Record(NamedTuple):
    """One row: the file it came from, its 0-based index in that file, its columns."""

    file: Path
    row: int
    data: dict[str, Any]


def _check_extension(path: Path) -> None:
    if path.suffix not in EXTENSIONS:
        raise DataError(f"{path}: unsupported data file extension '{path.suffix}' "
                        f"(expected one of {', '.join(EXTENSIONS)})")


def data_files(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    """Expand files and directories into the ordered list of data files to read."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise DataError("no dataset paths given")
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            entries = sorted(e for e in p.iterdir() if not e.name.startswith((".", "_")))
            unexpected = [e.name for e in entries if not (e.is_file() and e.suffix in EXTENSIONS)]
            if unexpected:
                raise DataError(f"{p}: directory holds entries that are not {'/'.join(EXTENSIONS)} files: "
                                f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
            if not entries:
                raise DataError(f"{p}: directory holds no {'/'.join(EXTENSIONS)} files")
            files.extend(entries)
        elif p.is_file():
            _check_extension(p)
            files.append(p)
        else:
            raise FileNotFoundError(f"dataset path '{p}' does not exist")
    return files


def _read_jsonl(path: Path) -> Iterator[Record]:
    row = 0
    try:
        with path.open("r", encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    data = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}: line {line_no}: invalid JSON: {exc.msg} (column {exc.colno})") from None
                if not isinstance(data, dict):
                    raise DataError(f"{path}: line {line_no}: expected a JSON object, got {type(data).__name__}")
                yield Record(path, row, data)
                row += 1
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start} of a chunk)") from None


def _read_parquet(path: Path) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        batches = pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS)
        row = 0
        for batch in batches:
            for data in batch.to_pylist():
                yield Record(path, row, data)
                row += 1
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: cannot read parquet file: {exc}") from exc


def read_records(paths: str | Path | Sequence[str | Path]) -> Iterator[Record]:
    """Yield every row of every file, in order (files sorted within a directory)."""
    for path in data_files(paths):
        yield from (_read_jsonl(path) if path.suffix == ".jsonl" else _read_parquet(path))


def write_jsonl(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Write ``rows`` as a JSONL file (parent directories made), atomically: a half-written file
    is never visible to a reader or to a job that checks whether it exists."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}-",
                                     delete=False) as tmp:  # fmt: skip
        tmp.write("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(tmp.name, path)
    return path
