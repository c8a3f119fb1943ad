"""data.num_workers: datasets read and tokenized in worker processes equal the ones read in this
process: ids, masks, extras, skip reports, and the message of the first error in row order."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rlhf.data import (
    ByteTokenizer,
    DataError,
    DataReport,
    PreferenceExample,
    PromptExample,
    load_preference_dataset,
    load_prompt_dataset,
    load_sft_dataset,
    load_tokenizer,
)
from megatron_rlhf.data.config import DataFilesConfig
from megatron_rlhf.data.records import data_files, split_files
from tests.helpers import make_chat_tokenizer
from tests.unit.test_data_datasets import gsm8k_rows, write_jsonl

TOK = ByteTokenizer(300)
WORKERS = 2
SPANS = 4 * WORKERS  # what the loaders cut the files into for WORKERS processes


def as_lists(example: Any) -> tuple:
    if isinstance(example, PreferenceExample):
        return as_lists(example.chosen) + as_lists(example.rejected)
    if isinstance(example, PromptExample):
        return example.prompt_ids.tolist(), example.extras
    return example.input_ids.tolist(), example.loss_mask.tolist()


def same_in_workers(load: Callable, paths: list[Path], *args: Any, **kwargs: Any) -> DataReport:
    """Load in this process and in WORKERS processes; the datasets and reports must be equal."""
    assert len(split_files(data_files(paths), SPANS)) > len(paths)  # the files are cut within
    dataset, report = load(paths, *args, **kwargs)
    in_workers, workers_report = load(paths, *args, num_workers=WORKERS, **kwargs)
    assert workers_report == report
    assert len(in_workers) == len(dataset) and in_workers.lengths.equal(dataset.lengths)
    assert [as_lists(e) for e in in_workers] == [as_lists(e) for e in dataset]
    return report


def write_jsonl_with_blanks(path: Path, rows: list[dict]) -> Path:
    path.write_text(
        "".join(("\n" if i % 9 == 0 else "") + json.dumps(r, ensure_ascii=False) + "\n" for i, r in enumerate(rows)),
        encoding="utf-8",
    )
    return path


def sft_rows(n: int, *, text_only: bool = False) -> list[dict]:
    """Text and pre-tokenized rows, with over-long (max_length 24), empty and out-of-range ones."""
    rows = []
    for i in range(n):
        if i % 11 == 3:
            rows.append({"prompt": "p", "response": "r" * 40})
        elif i % 13 == 5:
            rows.append({"prompt": " ", "response": "r"})
        elif i % 17 == 7 and not text_only:
            rows.append({"prompt_ids": [5, 6, 999], "response": "x"})
        elif i % 4 == 0 and not text_only:
            rows.append({"prompt_ids": [5 + i % 7, 6], "response_ids": [7, 8, 2]})
        else:
            rows.append({"prompt": f"q{i} é", "response": "a" * (i % 9 + 1)})
    return rows


def test_sft_in_workers(tmp_path):
    a = write_jsonl_with_blanks(tmp_path / "a.jsonl", sft_rows(70))
    b = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist(sft_rows(60, text_only=True)), b, row_group_size=9)
    c = write_jsonl(tmp_path / "c.jsonl", sft_rows(30)[::-1])
    report = same_in_workers(
        load_sft_dataset, [a, b, c], TOK, max_length=24, on_overlong="skip", on_invalid="skip", add_bos=True
    )
    assert set(report.skipped) == {"overlong", "empty", "token_out_of_range"}


def test_preference_in_workers(tmp_path):
    rows = [{"prompt": f"question {i}", "chosen": "yes" * (i % 5 + 1), "rejected": "no" * (i % 23)} for i in range(80)]
    f = write_jsonl_with_blanks(tmp_path / "pref.jsonl", rows)
    report = same_in_workers(load_preference_dataset, [f], TOK, max_length=40, on_overlong="skip", on_invalid="skip")
    assert set(report.skipped) == {"overlong", "empty"}


def test_prompts_with_chat_messages_and_verl_extras_in_workers(tmp_path):
    """A tokenizer.json tokenizer with a chat template (compiled again in each worker), verl rows in
    Parquet (nested columns) and JSONL rows with text prompts and bad reward columns."""
    tok = load_tokenizer(make_chat_tokenizer("qwen2", tmp_path / "qwen2"))
    verl = []
    for i in range(40):
        row = gsm8k_rows()[i % 2]
        row["prompt"][0]["content"] += " Think." * (200 if i % 7 == 2 else i % 4)  # some over-long
        row["extra_info"]["index"] = i
        verl.append(row)
    p = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl), p, row_group_size=6)
    text = [
        {
            "prompt": f"What is {i} + {i}?",
            "ability": "math",
            "data_source": "mine" if i % 5 else 3,
            "reward_model": {"ground_truth": str(2 * i)},
        }
        for i in range(40)
    ]
    j = write_jsonl_with_blanks(tmp_path / "text.jsonl", text)
    report = same_in_workers(
        load_prompt_dataset, [p, j], tok, max_length=512, on_overlong="skip", on_invalid="skip", extra_keys=["ability"]
    )
    assert set(report.skipped) == {"overlong", "wrong_type"}


def bad_row_late(tmp_path: Path) -> Path:
    return write_jsonl(
        tmp_path / "a.jsonl",
        [{"prompt": "p", "response": "r"}] * 50
        + [{"prompt": "p", "response": None}]
        + [{"prompt": "p", "response": "r"}] * 10,
    )


def overlong_before_bad_json(tmp_path: Path) -> Path:
    f = write_jsonl(
        tmp_path / "a.jsonl", [{"prompt": "p", "response": "r" * (30 if i == 10 else 1)} for i in range(60)]
    )
    f.write_text(f.read_text() + '{"prompt": "p",}\n' + '{"prompt": "p", "response": "r"}\n' * 5)
    return f


def bad_json_after_skips(tmp_path: Path) -> Path:
    f = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "response": "r" * (i % 3)} for i in range(60)])
    f.write_text(f.read_text() + "[1, 2]\n" + '{"prompt": "p", "response": "r"}\n' * 5)
    return f


def missing_column_late(tmp_path: Path) -> Path:
    return write_jsonl(
        tmp_path / "a.jsonl",
        [{"prompt": "p", "response": ""}] * 40
        + [{"prompt": "p", "answer": "r"}]
        + [{"prompt": "p", "response": "r"}] * 20,
    )


@pytest.mark.parametrize(
    "case, on_invalid, expected",
    [
        (bad_row_late, "error", "a.jsonl: line 51: column 'response' is null (set data.on_invalid=skip"),
        (overlong_before_bad_json, "error", "a.jsonl: line 11: column 'response' gives 32 tokens"),
        (bad_json_after_skips, "skip", "a.jsonl: line 61: expected a JSON object, got list"),
    ],
)
def test_the_first_error_in_row_order_is_raised_with_the_same_message(tmp_path, case, on_invalid, expected):
    f = case(tmp_path)
    with pytest.raises(DataError) as serial:
        load_sft_dataset(f, TOK, max_length=16, on_invalid=on_invalid)
    with pytest.raises(DataError) as workers:
        load_sft_dataset(f, TOK, max_length=16, on_invalid=on_invalid, num_workers=WORKERS)
    assert str(workers.value) == str(serial.value) and expected in str(serial.value)


def test_rows_skipped_in_workers_are_the_rows_skipped_in_one_process(tmp_path):
    """Empty responses early and a missing column late (in another worker's span): the same kept
    rows, and the same report, places included."""
    f = missing_column_late(tmp_path)
    serial, serial_report = load_sft_dataset(f, TOK, max_length=16, on_invalid="skip")
    workers, workers_report = load_sft_dataset(f, TOK, max_length=16, on_invalid="skip", num_workers=WORKERS)
    assert serial_report.skipped == {"empty": 40, "missing_column": 1} and len(serial) == 20
    assert workers_report.summary() == serial_report.summary()
    assert [workers[i].input_ids.tolist() for i in range(20)] == [serial[i].input_ids.tolist() for i in range(20)]


def test_a_tokenizer_that_does_not_pickle_names_the_setting(tmp_path):
    class Local(ByteTokenizer):  # a local class cannot be pickled
        pass

    f = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "response": "r"}])
    with pytest.raises(
        ValueError,
        match=r"num_workers=2: ByteTokenizer\(vocab_size=300\) cannot be sent to worker "
        r"processes \(.*\); set data.num_workers=0",
    ):
        load_sft_dataset(f, Local(300), max_length=8, num_workers=2)
    with pytest.raises(ValueError, match="num_workers must be an int >= 0, got -1"):
        load_sft_dataset(f, TOK, max_length=8, num_workers=-1)


def test_num_workers_setting():
    from megatron_rlhf.config.loader import config_errors, load_config
    from megatron_rlhf.trainer.sft import SFTConfig

    assert DataFilesConfig().num_workers == 0
    assert DataFilesConfig(num_workers=-1).errors() == ["num_workers=-1 must be >= 0"]
    assert config_errors(load_config("sft-tiny", ["data.num_workers=-1"], schema=SFTConfig)) == [
        "data.num_workers=-1 must be >= 0"
    ]


class DyingTokenizer(ByteTokenizer):
    """Kills the worker process that meets the text 'die', as the out-of-memory killer would."""

    def encode(self, text: str) -> list[int]:
        if text == "die":
            os._exit(1)
        return super().encode(text)


def test_a_worker_that_dies_is_an_error_not_a_hang(tmp_path):
    f = write_jsonl(
        tmp_path / "a.jsonl", [{"prompt": "p", "response": "r"}] * 40 + [{"prompt": "die", "response": "r"}]
    )
    with pytest.raises(
        RuntimeError,
        match=r"a data-loading worker process failed to start or died \(out of memory\?\) "
        r"while reading \['.*a.jsonl'\]: lower data.num_workers=2, or set it to 0",
    ):
        load_sft_dataset(f, DyingTokenizer(300), max_length=8, num_workers=WORKERS)
