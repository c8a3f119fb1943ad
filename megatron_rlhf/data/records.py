"""Rows of a dataset from ``.jsonl`` / ``.parquet`` files or directories of them.

Each row comes with the file it is in and its 0-based row index in that file, so that every
later error or skip can name both. JSONL rows are the non-blank lines (blank lines are not rows);
a line that is not UTF-8 or not a JSON object fails naming its 1-based line number. A directory
is read in sorted name order; entries whose names start with ``.`` or ``_`` (``_SUCCESS``,
``.crc``) are metadata and skipped, anything else that is not a data file is an error rather than
ignored.

``split_files`` cuts files into ``Span``s of consecutive rows that ``read_span`` reads on its own (in
a worker process), numbering rows and lines exactly as reading the whole file does.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "EXTENSIONS",
    "DataError",
    "Record",
    "Span",
    "data_files",
    "read_records",
    "read_span",
    "split_files",
    "write_jsonl",
]

EXTENSIONS = (".jsonl", ".parquet")
_PARQUET_BATCH_ROWS = 1024


class DataError(ValueError):
    """A dataset file or row is unusable; the message names the file (and row, column)."""


class Record(NamedTuple):
    """One row: the file it came from, its 0-based index in that file, its columns, and for JSONL its
    1-based line (blank lines are no rows, so the two differ)."""

    file: Path
    row: int
    data: dict[str, Any]
    line: int = 0
    """JSONL: the line the row is on; 0 for Parquet."""

    @property
    def place(self) -> str:
        """Where a message sends the reader: ``line N`` of a JSONL file (as an editor counts), ``row N``
        of a Parquet file."""
        return f"line {self.line}" if self.line else f"row {self.row}"


class Span(NamedTuple):
    """Consecutive rows of one file, from row ``row`` on. JSONL: bytes ``start`` to ``stop`` (None:
    to the end), whose first line is line ``line``; Parquet: rows ``start`` to ``stop``."""

    file: Path
    row: int = 0
    start: int = 0
    stop: int | None = None
    line: int = 1


def _check_extension(path: Path) -> None:
    if path.suffix not in EXTENSIONS:
        raise DataError(
            f"{path}: unsupported data file extension '{path.suffix}' (expected one of {', '.join(EXTENSIONS)})"
        )


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
                raise DataError(
                    f"{p}: directory holds entries that are not {'/'.join(EXTENSIONS)} files: "
                    f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
                )
            if not entries:
                raise DataError(f"{p}: directory holds no {'/'.join(EXTENSIONS)} files")
            files.extend(entries)
        elif p.is_file():
            _check_extension(p)
            files.append(p)
        elif p.exists():  # /dev/null, a pipe, a socket: nothing to read rows from twice
            raise DataError(
                f"dataset path '{p}' is not a regular file or a directory (expected "
                f"{'/'.join(EXTENSIONS)} files or a directory of them)"
            )
        else:
            raise FileNotFoundError(f"dataset path '{p}' does not exist")
    return files


def _blank(line: str) -> bool:
    """A blank line is no row (the reader and ``split_files`` must agree on it)."""
    return not line.strip()


def _read_jsonl(span: Span) -> Iterator[Record]:
    path, row, pos = span.file, span.row, span.start
    # Bytes, decoded line by line: a text-mode file decodes in chunks and cannot say which line is bad.
    with path.open("rb") as f:
        f.seek(span.start)
        for line_no, raw in enumerate(f, start=span.line):
            if span.stop is not None and pos >= span.stop:
                return
            pos += len(raw)
            try:
                # utf-8-sig on the file's first line: the byte-order mark Excel and Notepad write
                line = raw.decode("utf-8-sig" if pos == len(raw) else "utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}: line {line_no}: not UTF-8 text ({exc.reason} at byte {exc.start} "
                    "of the line); JSONL files must be UTF-8"
                ) from None
            if _blank(line):
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: line {line_no}: invalid JSON: {exc.msg} (column {exc.colno})") from None
            if "\\ud" in line.lower():  # an escaped UTF-16 surrogate: a lone half has no UTF-8 form
                try:
                    json.dumps(data, ensure_ascii=False).encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise DataError(
                        f"{path}: line {line_no}: a lone UTF-16 surrogate {exc.object[exc.start]!r} (half of a "
                        "character such as an emoji, cut by whatever wrote the file): its text cannot be tokenized"
                    ) from None
            if not isinstance(data, dict):
                raise DataError(f"{path}: line {line_no}: expected a JSON object, got {type(data).__name__}")
            yield Record(path, row, data, line_no)
            row += 1


def _read_parquet(span: Span) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, stop = span.file, span.stop
    try:
        pf = pq.ParquetFile(path)
        # Only the row groups that hold rows of the span; row counts come from the file's metadata.
        groups, row, first = [], 0, None
        for i in range(pf.num_row_groups):
            n = pf.metadata.row_group(i).num_rows
            if row + n > span.start and (stop is None or row < stop):
                groups.append(i)
                first = row if first is None else first
            row += n
        row = first or 0
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, row_groups=groups):
            lo = max(span.start - row, 0)
            hi = batch.num_rows if stop is None else min(stop - row, batch.num_rows)
            for i, data in enumerate(batch.slice(lo, max(hi - lo, 0)).to_pylist()):
                yield Record(path, row + lo + i, data)
            row += batch.num_rows
            if stop is not None and row >= stop:
                return
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: cannot read parquet file: {exc}") from exc


def read_span(span: Span) -> Iterator[Record]:
    """The rows of ``span``, numbered as in their file."""
    return _read_jsonl(span) if span.file.suffix == ".jsonl" else _read_parquet(span)


def _jsonl_spans(path: Path, pieces: int) -> list[Span]:
    """Cut at line starts into about ``pieces`` spans of equal bytes, counting lines and rows on the way."""
    step = max(path.stat().st_size / pieces, 1.0)
    spans: list[Span] = []
    start, start_line, start_row = 0, 1, 0
    pos, line_no, row = 0, 1, 0
    with path.open("rb") as f:
        for raw in f:
            if pos - start >= step:
                spans.append(Span(path, start_row, start, pos, start_line))
                start, start_line, start_row = pos, line_no, row
            try:
                row += not _blank(raw.decode("utf-8"))
            except UnicodeDecodeError:
                row += 1  # reading fails at this line: no row after it is ever read
            pos += len(raw)
            line_no += 1
    return spans + [Span(path, start_row, start, None, start_line)]


def _parquet_spans(path: Path, pieces: int) -> list[Span]:
    """About ``pieces`` spans of equal rows; a file whose metadata cannot be read is one span (its
    reader raises the error)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowException, OSError):
        return [Span(path)]
    bounds = sorted({rows * i // pieces for i in range(pieces + 1)})
    return [Span(path, a, a, b) for a, b in itertools.pairwise(bounds)] or [Span(path)]


def split_files(files: Sequence[Path], parts: int) -> list[Span]:
    """Spans of about ``parts`` equal shares of ``files``' bytes, in reading order; each file is cut
    into pieces in proportion to its size (and is at least one span)."""
    sizes = [f.stat().st_size for f in files]
    total = max(sum(sizes), 1)
    spans: list[Span] = []
    for f, size in zip(files, sizes, strict=True):
        pieces = max(round(parts * size / total), 1)
        spans += _jsonl_spans(f, pieces) if f.suffix == ".jsonl" else _parquet_spans(f, pieces)
    return spans


def read_records(paths: str | Path | Sequence[str | Path]) -> Iterator[Record]:
    """Yield every row of every file, in order (files sorted within a directory)."""
    for path in data_files(paths):
        yield from read_span(Span(path))


def write_jsonl(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Write ``rows`` as a JSONL file (parent directories made), atomically: a half-written file
    is never visible to a reader or to a job that checks whether it exists."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}-", delete=False
    ) as tmp:
        tmp.write("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(tmp.name, path)
    return path
