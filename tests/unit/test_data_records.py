"""Reading rows from JSONL / parquet files and directories, and the errors for bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rlhf.data import DataError, Record, data_files, read_records
from megatron_rlhf.data.records import read_span, split_files


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


ROWS = [{"prompt": "héllo", "response": "wörld", "n": 1}, {"prompt": "a", "response": "b", "n": 2}]


def test_jsonl_rows_with_file_and_index(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", ROWS)
    f.write_text(f.read_text(encoding="utf-8") + "\n   \n", encoding="utf-8")  # trailing blank lines are no rows
    assert list(read_records(f)) == [Record(f, 0, ROWS[0], 1), Record(f, 1, ROWS[1], 2)]


def test_parquet_rows_match_jsonl(tmp_path):
    rows = ROWS + [{"prompt": "p", "response": "r", "n": 3, "prompt_ids": None}]
    rows = [{**r, "prompt_ids": r.get("prompt_ids", [1, 2])} for r in rows]
    f = write_parquet(tmp_path / "a.parquet", rows)
    assert [(r.file, r.row, r.data) for r in read_records(str(f))] == [(f, i, r) for i, r in enumerate(rows)]


def test_parquet_many_batches(tmp_path):
    rows = [{"i": i} for i in range(2500)]  # more than one read batch
    f = write_parquet(tmp_path / "big.parquet", rows)
    assert [r.data["i"] for r in read_records(f)] == list(range(2500))
    assert [r.row for r in read_records(f)] == list(range(2500))


def test_directory_sorted_and_metadata_skipped(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    write_jsonl(d / "b.jsonl", [{"x": "b0"}])
    write_parquet(d / "a.parquet", [{"x": "a0"}, {"x": "a1"}])
    (d / "_SUCCESS").write_text("")
    (d / ".a.parquet.crc").write_text("")
    single = write_jsonl(tmp_path / "c.jsonl", [{"x": "c0"}])
    assert data_files([d, single]) == [d / "a.parquet", d / "b.jsonl", single]
    got = [(r.file.name, r.row, r.data["x"]) for r in read_records([d, single])]
    assert got == [("a.parquet", 0, "a0"), ("a.parquet", 1, "a1"), ("b.jsonl", 0, "b0"), ("c.jsonl", 0, "c0")]


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(f"dataset path '{tmp_path / 'nope.jsonl'}' does not exist")):
        data_files(tmp_path / "nope.jsonl")


def test_unknown_extension(tmp_path):
    f = tmp_path / "data.csv"
    f.write_text("a,b\n")
    expected = "data.csv: unsupported data file extension '.csv' (expected one of .jsonl, .parquet)"
    with pytest.raises(DataError, match=re.escape(expected)):
        list(read_records(f))


def test_directory_with_foreign_or_no_files(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    with pytest.raises(DataError, match=re.escape(f"{d}: directory holds no .jsonl/.parquet files")):
        data_files(d)
    (d / "notes.txt").write_text("")
    (d / "sub").mkdir()
    with pytest.raises(DataError, match=r"not \.jsonl/\.parquet files: \['notes\.txt', 'sub'\]"):
        data_files(d)
    with pytest.raises(DataError, match="no dataset paths"):
        data_files([])


def test_bad_json_line_names_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"a": 1}\n\n{"a": 2,}\n', encoding="utf-8")
    rows = read_records(f)
    assert next(rows).data == {"a": 1}
    with pytest.raises(DataError, match=re.escape(f"{f}: line 3: invalid JSON")):
        next(rows)


def test_non_object_json_line(tmp_path):
    f = write_jsonl(tmp_path / "list.jsonl", [{"a": 1}, [1, 2]])
    with pytest.raises(DataError, match=re.escape(f"{f}: line 2: expected a JSON object, got list")):
        list(read_records(f))


def test_non_utf8_line_names_file_and_line(tmp_path):
    f = tmp_path / "latin1.jsonl"
    f.write_bytes('{"a": "ok"}\n\n{"a": "é"}\n'.encode("latin-1"))  # é is byte 0xe9 in Latin-1, at byte 7
    rows = read_records(f)
    assert next(rows).data == {"a": "ok"}
    expected = f"{f}: line 3: not UTF-8 text (invalid continuation byte at byte 7 of the line)"
    with pytest.raises(DataError, match=re.escape(expected)):
        next(rows)


def test_corrupt_parquet(tmp_path):
    f = tmp_path / "broken.parquet"
    f.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(DataError, match=re.escape(f"{f}: cannot read parquet file")):
        list(read_records(f))


# --------------------------------------------------------------------------- spans


def test_spans_read_the_rows_of_the_whole_files(tmp_path):
    """Spans cut within files (JSONL at line starts, Parquet across row groups), read one by one,
    give every row once with its file, row and data; blank lines (Unicode whitespace too) are no rows."""
    j = tmp_path / "a.jsonl"
    lines = [json.dumps({"i": i, "t": "é" * (i % 5)}) for i in range(40)]
    for i, blank in ((0, ""), (7, "  "), (8, "\u3000\x1c"), (25, "\t")):
        lines.insert(i, blank)
    j.write_text("\n".join(lines), encoding="utf-8")  # no newline after the last line
    p = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([{"i": i} for i in range(2100)]), p, row_group_size=700)
    files = [j, p]
    whole = list(read_records(files))
    for parts in (1, 3, 8, 50):
        spans = split_files(files, parts)
        assert [r for s in spans for r in read_span(s)] == whole, parts
    assert len(split_files(files, 8)) > len(files)
    assert [s.row for s in split_files([p], 3)] == [0, 700, 1400]


def test_a_bad_line_in_a_span_fails_as_in_the_whole_file(tmp_path):
    f = tmp_path / "latin1.jsonl"
    f.write_bytes(
        "".join(f'{{"a": "{i}"}}\n' for i in range(30)).encode()
        + '{"a": "é"}\n'.encode("latin-1")
        + b'{"a": "after"}\n' * 10
    )
    with pytest.raises(DataError) as whole:
        list(read_records(f))
    with pytest.raises(DataError) as spans:
        [r for s in split_files([f], 8) for r in read_span(s)]
    assert str(spans.value) == str(whole.value) and "line 31: not UTF-8" in str(whole.value)
