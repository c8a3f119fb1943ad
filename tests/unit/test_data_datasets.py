"""SFT / preference / prompt loaders: ids and loss masks by hand, every error, skip counting."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megatron_rlhf.data import (
    ByteTokenizer,
    DataError,
    PreferenceExample,
    SFTExample,
    load_preference_dataset,
    load_prompt_dataset,
    load_sft_dataset,
)

TOK = ByteTokenizer(300)  # byte b -> b + 3, bos 1, eos 2


def ids(text: str) -> list[int]:
    return [b + 3 for b in text.encode("utf-8")]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def err(*parts: str) -> str:
    """A regex matching the given literal parts in order."""
    return ".*".join(re.escape(p) for p in parts)


# --------------------------------------------------------------------------- SFT


def test_sft_ids_and_loss_mask_by_hand(tmp_path):
    f = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "Hi", "response": "yo"}, {"prompt": "é", "response": "!"}])
    ds, report = load_sft_dataset(f, TOK, max_length=16)
    assert len(ds) == 2 and (report.files, report.rows, report.kept, report.skipped) == (1, 2, 2, {})
    ex = ds[0]
    assert isinstance(ex, SFTExample)
    assert ex.input_ids.tolist() == [ord("H") + 3, ord("i") + 3, ord("y") + 3, ord("o") + 3, 2]
    assert ex.loss_mask.tolist() == [False, False, True, True, True]
    assert ds[1].input_ids.tolist() == ids("é") + ids("!") + [2]  # é is two bytes
    assert ds[1].loss_mask.tolist() == [False, False, True, True]
    assert ds[-1].input_ids.tolist() == ds[1].input_ids.tolist()
    assert ds.lengths.tolist() == [5, 4]
    assert [len(e) for e in ds] == [5, 4]
    with pytest.raises(IndexError, match="index 2 out of range for 2 examples"):
        ds[2]


def test_sft_bos_and_no_eos_and_existing_eos(tmp_path):
    f = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "a", "response": "b"}])
    ds, _ = load_sft_dataset(f, TOK, max_length=8, add_bos=True, append_eos=False)
    assert ds[0].input_ids.tolist() == [1] + ids("a") + ids("b")
    assert ds[0].loss_mask.tolist() == [False, False, True]
    # A pre-tokenized response that already ends in EOS does not get a second one.
    g = write_jsonl(tmp_path / "tok.jsonl", [{"prompt_ids": [10, 11], "response_ids": [12, 2]}])
    ds, _ = load_sft_dataset(g, TOK, max_length=8)
    assert ds[0].input_ids.tolist() == [10, 11, 12, 2]
    assert ds[0].loss_mask.tolist() == [False, False, True, True]


def test_sft_pretokenized_parquet_and_custom_keys(tmp_path):
    rows = [{"q_ids": [5, 6, 7], "a_ids": [8]}, {"q_ids": [9], "a_ids": [10, 11]}]
    f = write_parquet(tmp_path / "tok.parquet", rows)
    ds, _report = load_sft_dataset(f, TOK, max_length=8, prompt_key="q", response_key="a")
    assert [e.input_ids.tolist() for e in ds] == [[5, 6, 7, 8, 2], [9, 10, 11, 2]]
    assert [e.loss_mask.int().tolist() for e in ds] == [[0, 0, 0, 1, 1], [0, 1, 1, 1]]
    # Text wins over ids when both are present.
    g = write_jsonl(tmp_path / "both.jsonl", [{"prompt": "x", "prompt_ids": [99], "response": "y"}])
    assert load_sft_dataset(g, TOK, max_length=8)[0][0].input_ids.tolist() == ids("x") + ids("y") + [2]


def test_sft_with_real_tokenizer_matches_library(tmp_path):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    from megatron_rlhf.data import load_tokenizer

    raw = RawTokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(
        ["what is two plus two", "it is four"],
        trainer=trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"]),
    )
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[EOS]", "pad_token": "[PAD]"}))
    tok = load_tokenizer(tmp_path)
    f = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "what is two plus two", "response": "it is four"}])
    ds, _ = load_sft_dataset(f, tok, max_length=32)
    p, r = raw.encode("what is two plus two").ids, raw.encode("it is four").ids
    assert ds[0].input_ids.tolist() == p + r + [2]
    assert ds[0].loss_mask.int().tolist() == [0] * len(p) + [1] * (len(r) + 1)


def test_missing_column_names_file_column_and_columns(tmp_path):
    f = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "a", "answer": "b"}])
    with pytest.raises(
        DataError,
        match=err(
            str(f), "line 1", "column 'response' is missing", "'response_ids'", "columns present: ['answer', 'prompt']"
        ),
    ):
        load_sft_dataset(f, TOK, max_length=8)
    g = write_parquet(tmp_path / "p.parquet", [{"question": "a", "response": "b"}])
    with pytest.raises(DataError, match=err(str(g), "row 0", "column 'prompt' is missing", "['question', 'response']")):
        load_sft_dataset(g, TOK, max_length=8)
    # Skipped like any bad row (before: fatal even with on_invalid=skip), and reported where.
    rows = [{"question": "a", "response": "b"}, {"prompt": "c", "response": "d"}, {"question": "e", "response": "f"}]
    h = write_jsonl(tmp_path / "mixed.jsonl", rows)
    ds, report = load_sft_dataset(h, TOK, max_length=8, on_invalid="skip")
    assert len(ds) == 1 and report.skipped == {"missing_column": 2}
    assert f"missing_column 2 (first: {h}: line 1: column 'prompt' is missing" in report.summary()
    assert report.summary().endswith("; also line 3)")
    with pytest.raises(DataError, match=r"no usable examples .* missing_column 1"):
        load_sft_dataset(g, TOK, max_length=8, on_invalid="skip")


@pytest.mark.parametrize(
    "row,column,detail,reason",
    [
        ({"prompt": "a", "response": None}, "response", "is null", "empty"),
        ({"prompt": "", "response": "b"}, "prompt", "is empty", "empty"),
        ({"prompt": "a", "response": "  \n"}, "response", "is empty", "empty"),
        ({"prompt": 7, "response": "b"}, "prompt", "must be a string, got int", "wrong_type"),
        ({"prompt": {"a": 1}, "response": "b"}, "prompt", "must be a string, got dict", "wrong_type"),
        ({"prompt_ids": [], "response": "b"}, "prompt_ids", "is an empty list", "empty"),
        ({"prompt_ids": None, "response": "b"}, "prompt_ids", "is null", "empty"),
        (
            {"prompt_ids": [1, "2"], "response": "b"},
            "prompt_ids",
            "must be a list of ints, got a list holding str '2'",
            "wrong_type",
        ),
        ({"prompt_ids": [1, True], "response": "b"}, "prompt_ids", "must be a list of ints", "wrong_type"),
        ({"prompt_ids": "1 2", "response": "b"}, "prompt_ids", "must be a list of ints, got str", "wrong_type"),
        (
            {"prompt_ids": [1, 300], "response": "b"},
            "prompt_ids",
            "holds token id 300, outside [0, 300)",
            "token_out_of_range",
        ),
        ({"prompt_ids": [-1], "response": "b"}, "prompt_ids", "holds token id -1", "token_out_of_range"),
    ],
)
def test_bad_values_error_or_skip(tmp_path, row, column, detail, reason):
    good = {"prompt": "p", "response": "r"}
    f = write_jsonl(tmp_path / "sft.jsonl", [good, good, row, good])
    with pytest.raises(DataError, match=err(str(f), "line 3", f"column '{column}'", detail, "data.on_invalid=skip")):
        load_sft_dataset(f, TOK, max_length=8)
    ds, report = load_sft_dataset(f, TOK, max_length=8, on_invalid="skip")
    assert len(ds) == report.kept == 3 and report.rows == 4
    assert report.skipped == {reason: 1}
    (sample,) = report.samples[reason]
    assert (sample.file, sample.row, sample.column) == (str(f), 2, column)
    assert detail in sample.detail


def test_overlong_error_and_skip_counts(tmp_path):
    rows = [{"prompt": "ab", "response": "c" * n} for n in range(1, 9)]  # lengths 2 + n + 1 eos
    f = write_jsonl(tmp_path / "a.jsonl", rows[:4])
    g = write_parquet(tmp_path / "b.parquet", rows[4:])
    with pytest.raises(
        DataError,
        match=err(
            str(f),
            "line 4",
            "column 'response'",
            "gives 7 tokens",
            "prompt 2 + response 5",
            "> data.max_length=6",
            "data.on_overlong=skip",
        ),
    ):
        load_sft_dataset([f, g], TOK, max_length=6)
    ds, report = load_sft_dataset([f, g], TOK, max_length=6, on_overlong="skip")
    assert ds.lengths.tolist() == [4, 5, 6]
    assert (report.files, report.rows, report.kept, report.skipped) == (2, 8, 3, {"overlong": 5})
    assert [(Path(s.file).name, s.row) for s in report.samples["overlong"]] == [
        ("a.jsonl", 3),
        ("b.parquet", 0),
        ("b.parquet", 1),
        ("b.parquet", 2),
        ("b.parquet", 3),
    ]
    summary = report.summary()
    assert "read 8 rows from 2 file(s): kept 3, skipped 5: overlong 5" in summary and "a.jsonl: line 4" in summary
    # Overlong and bad values are governed separately.
    h = write_jsonl(tmp_path / "c.jsonl", [rows[0], {"prompt": "ab", "response": None}, rows[7]])
    _, report = load_sft_dataset(h, TOK, max_length=6, on_overlong="skip", on_invalid="skip")
    assert report.skipped == {"empty": 1, "overlong": 1}
    with pytest.raises(DataError, match="is null"):
        load_sft_dataset(h, TOK, max_length=6, on_overlong="skip")


def test_samples_are_capped_but_counts_are_not(tmp_path):
    rows = [{"prompt": "p", "response": "long"}] * 20 + [{"prompt": "p", "response": "r"}]
    f = write_jsonl(tmp_path / "a.jsonl", rows)
    _, report = load_sft_dataset(f, TOK, max_length=4, on_overlong="skip")
    assert report.skipped == {"overlong": 20} and len(report.samples["overlong"]) == 5


def test_nothing_left_is_an_error(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "response": "long"}])
    with pytest.raises(DataError, match=err("no usable examples", str(f), "kept 0, skipped 1: overlong 1")):
        load_sft_dataset(f, TOK, max_length=3, on_overlong="skip")
    e = tmp_path / "empty.jsonl"
    e.write_text("")
    with pytest.raises(DataError, match=err("no usable examples", "read 0 rows")):
        load_sft_dataset(e, TOK, max_length=3)


def test_loader_argument_checks(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "response": "r"}])
    with pytest.raises(ValueError, match="max_length must be a positive int, got 0"):
        load_sft_dataset(f, TOK, max_length=0)
    with pytest.raises(ValueError, match="on_overlong must be one of \\('error', 'skip'\\), got 'truncate'"):
        load_sft_dataset(f, TOK, max_length=8, on_overlong="truncate")

    class NoSpecials(ByteTokenizer):
        def __init__(self) -> None:
            super().__init__(300)
            self.eos_id = self.bos_id = None

    with pytest.raises(ValueError, match="has no eos_id; pass append_eos=False"):
        load_sft_dataset(f, NoSpecials(), max_length=8)
    with pytest.raises(ValueError, match=r"data\.add_bos=true but .* has no BOS token: set data\.add_bos=false"):
        load_sft_dataset(f, NoSpecials(), max_length=8, append_eos=False, add_bos=True)
    assert len(load_sft_dataset(f, NoSpecials(), max_length=8, append_eos=False)[0]) == 1


# --------------------------------------------------------------------------- preference / prompt


def test_preference_by_hand(tmp_path):
    rows = [
        {"prompt": "Q", "chosen": "yes", "rejected": "n"},
        {"prompt_ids": [10], "chosen_ids": [11], "rejected_ids": [12, 13]},
    ]
    f = write_jsonl(tmp_path / "pref.jsonl", rows)
    ds, report = load_preference_dataset(f, TOK, max_length=8)
    assert report.kept == 2
    ex = ds[0]
    assert isinstance(ex, PreferenceExample)
    assert ex.chosen.input_ids.tolist() == ids("Q") + ids("yes") + [2]
    assert ex.chosen.loss_mask.int().tolist() == [0, 1, 1, 1, 1]
    assert ex.rejected.input_ids.tolist() == ids("Q") + ids("n") + [2]
    assert ex.rejected.loss_mask.int().tolist() == [0, 1, 1]
    assert ds[1].rejected.input_ids.tolist() == [10, 12, 13, 2]
    assert ds.lengths.tolist() == [[5, 3], [3, 4]]


def test_preference_errors_and_overlong_side(tmp_path):
    f = write_jsonl(
        tmp_path / "pref.jsonl",
        [
            {"prompt": "Q", "chosen": "a", "rejected": "b"},
            {"prompt": "Q", "chosen": "a", "rejected": "bbbbbbbb"},
            {"prompt": "Q", "chosen": "a", "rejected": ""},
        ],
    )
    with pytest.raises(DataError, match=err(str(f), "line 2", "column 'rejected'", "prompt 1 + rejected 9")):
        load_preference_dataset(f, TOK, max_length=6)
    ds, report = load_preference_dataset(f, TOK, max_length=6, on_overlong="skip", on_invalid="skip")
    assert len(ds) == 1 and report.skipped == {"overlong": 1, "empty": 1}
    assert report.samples["empty"][0].column == "rejected"
    g = write_parquet(tmp_path / "p.parquet", [{"prompt": "Q", "good": "a", "bad": "b"}])
    with pytest.raises(DataError, match=err(str(g), "column 'chosen' is missing", "['bad', 'good', 'prompt']")):
        load_preference_dataset(g, TOK, max_length=6)
    ds, _ = load_preference_dataset(g, TOK, max_length=6, chosen_key="good", rejected_key="bad")
    assert ds[0].chosen.input_ids.tolist() == ids("Q") + ids("a") + [2]


def test_a_pair_whose_sides_are_the_same_is_an_invalid_row(tmp_path):
    """Before: accepted, a pair with no gradient that validation counted as a wrong answer."""
    rows = [{"prompt": "Q", "chosen": "a", "rejected": "b"}, {"prompt": "Q", "chosen": "a", "rejected": "a"}]
    f = write_jsonl(tmp_path / "pref.jsonl", rows)
    with pytest.raises(DataError, match=err(str(f), "line 2", "column 'rejected' is the same as 'chosen'")):
        load_preference_dataset(f, TOK, max_length=6)
    ds, report = load_preference_dataset(f, TOK, max_length=6, on_invalid="skip")
    assert len(ds) == 1 and report.skipped == {"identical_pair": 1}


def test_prompt_dataset_with_extras(tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2", "id": 7}, {"prompt": "toolong", "answer": "x", "id": 8}]
    f = write_jsonl(tmp_path / "rl.jsonl", rows)
    ds, report = load_prompt_dataset(f, TOK, max_length=5, on_overlong="skip", extra_keys=["answer"], add_bos=True)
    assert len(ds) == 1 and report.skipped == {"overlong": 1}
    assert ds[0].prompt_ids.tolist() == [1] + ids("1+1=")
    assert ds[0].extras == {"answer": "2"}
    with pytest.raises(DataError, match=err(str(f), "line 1", "column 'solution' is missing", "extra_keys")):
        load_prompt_dataset(f, TOK, max_length=5, extra_keys=["solution"])


def test_overlong_prompt_names_the_setting(tmp_path):
    f = write_jsonl(tmp_path / "rl.jsonl", [{"prompt": "abc"}, {"prompt": "abcdef"}])
    with pytest.raises(
        DataError,
        match=err(
            str(f),
            "line 2",
            "column 'prompt'",
            "gives 7 tokens (prompt 7)",
            "> data.max_prompt_length=5",
            "data.on_overlong=skip",
        ),
    ):
        load_prompt_dataset(f, TOK, max_length=5, add_bos=True)


def test_example_validation():
    with pytest.raises(ValueError, match=r"loss_mask shape \(2,\) != input_ids shape \(3,\)"):
        SFTExample([1, 2, 3], [0, 1])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        SFTExample([], [])
    with pytest.raises(ValueError, match="must be integers"):
        SFTExample([1.0], [1])
    assert SFTExample(torch.tensor([4, 5]), [0, 1]).loss_mask.dtype == torch.bool


# --------------------------------------------------------------------------- verl's format

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
GSM8K_PROBLEMS = [
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = <<3+4=7>>7\n#### 7"),
    ("A school orders 25 boxes of 48 pencils. How many pencils?", "25 * 48 = <<25*48=1200>>1,200\n#### 1,200"),
]


def gsm8k_rows(split: str = "train") -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them (its answer extraction drops commas)."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer.split("#### ")[1].replace(",", "")},
            "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
        }
        for index, (question, answer) in enumerate(GSM8K_PROBLEMS)
    ]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    from tests.helpers import make_chat_tokenizer

    return make_chat_tokenizer("qwen2", tmp_path_factory.mktemp("qwen2"))


def test_verl_parquet_is_read_unchanged(qwen2_dir, tmp_path):
    from transformers import AutoTokenizer

    from megatron_rlhf.data import load_tokenizer

    rows = gsm8k_rows()
    f = write_parquet(tmp_path / "train.parquet", rows)
    schema = pq.read_schema(f)  # the nested columns verl's parquet files have
    assert str(schema.field("prompt").type) == "list<element: struct<role: string, content: string>>"
    assert str(schema.field("reward_model").type) == "struct<style: string, ground_truth: string>"
    ds, report = load_prompt_dataset(f, load_tokenizer(qwen2_dir), max_length=512, extra_keys=["ability"])
    assert report.kept == 2
    ref = AutoTokenizer.from_pretrained(str(qwen2_dir))
    for example, row in zip(ds, rows, strict=True):
        expected = ref.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"]
        assert example.prompt_ids.tolist() == list(expected)
        assert example.extras == {
            "ability": "math",
            "data_source": "openai/gsm8k",
            "ground_truth": row["reward_model"]["ground_truth"],
            "extra_info": row["extra_info"],
            "tools_kwargs": {},
            "need_tools_kwargs": False,
            "interaction_kwargs": {},
        }
    assert [e.extras["ground_truth"] for e in ds] == ["7", "1200"]
    assert ds[1].extras["extra_info"] == {
        "split": "train",
        "index": 1,
        "answer": GSM8K_PROBLEMS[1][1],
        "question": GSM8K_PROBLEMS[1][0],
    }
    # The same rows as JSONL give the same examples; a null or absent extra_info is verl's {}.
    jsonl_rows = [{**rows[0], "extra_info": None}, {k: v for k, v in rows[1].items() if k != "extra_info"}]
    g = write_jsonl(tmp_path / "train.jsonl", jsonl_rows)
    ds2, _ = load_prompt_dataset(g, load_tokenizer(qwen2_dir), max_length=512)
    assert [e.prompt_ids.tolist() for e in ds2] == [e.prompt_ids.tolist() for e in ds]
    assert [e.extras["extra_info"] for e in ds2] == [{}, {}]


GSM8K_TOOL_SYSTEM = (
    "You are a math expert. You are given a question and you need to solve it step by step. Reasoning step "
    "by step before any tool call. You should use the `calc_gsm8k_reward` tool after step by step solving the "
    "question, before generate final answer at least once and refine your answer if necessary. Put your final "
    "answer in the format of `#### <answer>`."
)


def gsm8k_tool_rows() -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k_multiturn_w_tool.py writes them."""
    rows = []
    for index, (question, answer) in enumerate(GSM8K_PROBLEMS):
        truth = answer.split("#### ")[1].replace(",", "")
        asked = question + " " + GSM8K_INSTRUCTION
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "system", "content": GSM8K_TOOL_SYSTEM}, {"role": "user", "content": asked}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {
                    "split": "train",
                    "index": index,
                    "answer": answer,
                    "question": question,
                    "need_tools_kwargs": True,
                    "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}},
                    "interaction_kwargs": {"query": asked, "ground_truth": truth},
                },
            }
        )
    return rows


def test_verl_multiturn_tool_parquet_is_read_unchanged(qwen2_dir, tmp_path):
    """verl's multi-turn tool rows keep tools_kwargs, need_tools_kwargs and interaction_kwargs per
    prompt. A second source's row with another tool makes parquet null the fields each row lacks:
    a null tool is left out, a null group of keywords is {}."""
    from transformers import AutoTokenizer

    from megatron_rlhf.data import load_tokenizer

    rows = gsm8k_tool_rows()
    other = {
        **rows[1],
        "data_source": "mine",
        "extra_info": {"index": 7, "tools_kwargs": {"python": {"execute_kwargs": {"timeout_s": 5}}}},
    }
    f = write_parquet(tmp_path / "train.parquet", [*rows, other])
    tools_type = pq.read_schema(f).field("extra_info").type.field("tools_kwargs").type
    assert str(tools_type) == (
        "struct<calc_gsm8k_reward: struct<create_kwargs: struct<ground_truth: string>>, "
        "python: struct<execute_kwargs: struct<timeout_s: int64>>>"
    )
    ds, report = load_prompt_dataset(f, load_tokenizer(qwen2_dir), max_length=512)
    assert report.kept == 3
    ref = AutoTokenizer.from_pretrained(str(qwen2_dir))
    expected = ref.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ds[0].prompt_ids.tolist() == list(expected)  # the system message rendered
    no_keywords = {"execute_kwargs": {}, "calc_reward_kwargs": {}, "release_kwargs": {}}
    for example, truth in zip(ds[:2], ["7", "1200"], strict=True):
        assert example.extras["tools_kwargs"] == {
            "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}, **no_keywords}
        }
        assert example.extras["need_tools_kwargs"] is True
        assert example.extras["interaction_kwargs"]["ground_truth"] == truth
    assert ds[1].extras["extra_info"]["tools_kwargs"]["python"] is None  # the reward function sees the row as is
    assert ds[2].extras["tools_kwargs"] == {
        "python": {
            "create_kwargs": {},
            "execute_kwargs": {"timeout_s": 5},
            "calc_reward_kwargs": {},
            "release_kwargs": {},
        }
    }
    assert (ds[2].extras["need_tools_kwargs"], ds[2].extras["interaction_kwargs"]) == (False, {})
    # A verl row without them (the single-turn gsm8k script's) has none.
    g = write_parquet(tmp_path / "single.parquet", gsm8k_rows())
    single, _ = load_prompt_dataset(g, load_tokenizer(qwen2_dir), max_length=512)
    assert [(e.extras["tools_kwargs"], e.extras["need_tools_kwargs"]) for e in single] == [({}, False), ({}, False)]


def test_verl_multiturn_fields_errors(tmp_path):
    good = {"prompt": "p", "data_source": "s", "reward_model": {"ground_truth": "7"}}
    tool = {"create_kwargs": {"ground_truth": "7"}}
    bad_extra_info = [
        {"tools_kwargs": ["calc"]},
        {"tools_kwargs": {"calc": {"create_kwargs": "7"}}},
        {"tools_kwargs": {"calc": {**tool, "create_kwarg": {}}}},
        {"tools_kwargs": {"calc": tool}, "need_tools_kwargs": "yes"},
        {"interaction_kwargs": [1]},
        {"need_tools_kwargs": True, "tools_kwargs": {"calc": None}},
    ]
    f = write_jsonl(tmp_path / "bad.jsonl", [good, *({**good, "extra_info": e} for e in bad_extra_info)])
    with pytest.raises(
        DataError, match=err(str(f), "line 2", "column 'extra_info' field 'tools_kwargs' must be an object")
    ):
        load_prompt_dataset(f, TOK, max_length=8)
    ds, report = load_prompt_dataset(f, TOK, max_length=8, on_invalid="skip")
    assert len(ds) == 1 and report.skipped == {"wrong_type": 5, "empty": 1}
    assert [(s.row, s.detail) for s in report.samples["wrong_type"] + report.samples["empty"]] == [
        (1, "field 'tools_kwargs' must be an object (or null), got list"),
        (2, "field 'tools_kwargs.calc.create_kwargs' must be an object (or null), got str"),
        (
            3,
            "field 'tools_kwargs.calc' holds ['create_kwarg']; expected only "
            "['create_kwargs', 'execute_kwargs', 'calc_reward_kwargs', 'release_kwargs']",
        ),
        (4, "field 'need_tools_kwargs' must be a boolean (or null), got 'yes'"),
        (5, "field 'interaction_kwargs' must be an object (or null), got list"),
        (6, "field 'need_tools_kwargs' is true but 'tools_kwargs' names no tool"),
    ]


def test_rows_without_reward_model_carry_their_data_source_alone(tmp_path):
    """The data source splits the validation figures, whatever scores the rows."""
    f = write_jsonl(tmp_path / "rl.jsonl", [{"prompt": "p", "data_source": "mine", "extra_info": {"a": 1}}])
    ds, _ = load_prompt_dataset(f, TOK, max_length=8)
    assert ds[0].extras == {"data_source": "mine"}


def test_rows_a_reward_function_needs_are_checked_as_they_are_read(tmp_path):
    """Before: a row without reward_model trained until its prompt was drawn (step 2 here, hours into
    a real run), then failed naming no file or line and listing data_source as missing too."""
    good = {"prompt": "p", "data_source": "mine", "reward_model": {"ground_truth": "7"}}
    f = write_jsonl(tmp_path / "rl.jsonl", [good, good, {"prompt": "q", "data_source": "mine"}])
    with pytest.raises(
        DataError, match=err(str(f), "line 3", "column 'reward_model' is missing: scoring.custom_function")
    ):
        load_prompt_dataset(f, TOK, max_length=8, require_reward_inputs=True)
    ds, _ = load_prompt_dataset(f, TOK, max_length=8)  # rules alone need no reward inputs
    assert len(ds) == 3 and ds[2].extras == {"data_source": "mine"}


def test_null_reward_inputs_are_invalid_rows(tmp_path):
    """A null ground_truth (verl's merged parquet schemas write one) reached the reward function as
    None, a null extra_keys column a rule as the string 'None', and an empty one matched an empty
    response (exact_answer scored it 1)."""
    good = {"prompt": "p", "data_source": "s", "reward_model": {"ground_truth": "7"}, "answer": "7"}
    rows = [
        good,
        {**good, "reward_model": {"ground_truth": None}},
        {**good, "answer": None},
        {**good, "answer": " "},
    ]
    f = write_jsonl(tmp_path / "rl.jsonl", rows)
    with pytest.raises(DataError, match=err(str(f), "line 2", "column 'reward_model' has ground_truth None")):
        load_prompt_dataset(f, TOK, max_length=8, require_reward_inputs=True)
    with pytest.raises(DataError, match=err(str(f), "line 3", "column 'answer' is null (requested in extra_keys")):
        load_prompt_dataset(f, TOK, max_length=8, extra_keys=("answer",))
    blank = write_jsonl(tmp_path / "blank.jsonl", [good, rows[3]])
    with pytest.raises(DataError, match=err(str(blank), "line 2", "column 'answer' is empty (' ') (requested in")):
        load_prompt_dataset(blank, TOK, max_length=8, extra_keys=("answer",))
    ds, report = load_prompt_dataset(
        f, TOK, max_length=8, extra_keys=("answer",), require_reward_inputs=True, on_invalid="skip"
    )
    assert len(ds) == 1 and report.skipped == {"empty": 3}


def test_a_byte_order_mark_is_read_past_and_a_lone_surrogate_is_named(tmp_path):
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "a"}\n{"prompt": "b"}\n')
    ds, _ = load_prompt_dataset(f, TOK, max_length=8)
    assert [e.prompt_ids.tolist() for e in ds] == [[ord("a") + 3], [ord("b") + 3]]
    g = tmp_path / "half.jsonl"
    g.write_text('{"prompt": "ok"}\n{"prompt": "bad \\ud83d emoji"}\n{"prompt": "\\ud83d\\ude00"}\n')
    with pytest.raises(DataError, match=err(str(g), "line 2", "a lone UTF-16 surrogate '\\ud83d'")):
        load_prompt_dataset(g, TOK, max_length=16)
    g.write_text('{"prompt": "ok"}\n{"prompt": "\\ud83d\\ude00"}\n')  # an escaped pair is one emoji
    assert len(load_prompt_dataset(g, TOK, max_length=16)[0]) == 2


def test_verl_reward_columns_errors(tmp_path):
    good = {"prompt": "p", "data_source": "openai/gsm8k", "reward_model": {"ground_truth": "7"}}
    f = write_jsonl(tmp_path / "no_source.jsonl", [good, {"prompt": "p", "reward_model": {"ground_truth": "7"}}])
    with pytest.raises(
        DataError,
        match=err(
            str(f),
            "line 2",
            "column 'data_source' is missing beside 'reward_model'",
            "columns present: ['prompt', 'reward_model']",
        ),
    ):
        load_prompt_dataset(f, TOK, max_length=8)
    assert load_prompt_dataset(f, TOK, max_length=8, on_invalid="skip")[1].skipped == {"missing_column": 1}
    bad = [
        {**good, "data_source": 3},
        {**good, "reward_model": {"style": "rule"}},
        {**good, "reward_model": "7"},
        {**good, "extra_info": [1]},
    ]
    g = write_jsonl(tmp_path / "bad.jsonl", [good, *bad])
    with pytest.raises(DataError, match=err(str(g), "line 2", "column 'data_source' must be a string, got int")):
        load_prompt_dataset(g, TOK, max_length=8)
    ds, report = load_prompt_dataset(g, TOK, max_length=8, on_invalid="skip")
    assert len(ds) == 1 and report.skipped == {"wrong_type": 4}
    assert [(s.row, s.column, s.detail) for s in report.samples["wrong_type"]] == [
        (1, "data_source", "must be a string, got int"),
        (2, "reward_model", "must be an object with a 'ground_truth' field, got {'style': 'rule'}"),
        (3, "reward_model", "must be an object with a 'ground_truth' field, got '7'"),
        (4, "extra_info", "must be an object (or null), got list"),
    ]


def test_a_plain_rows_data_source_that_is_no_string_is_named(tmp_path):
    """Without reward_model a row's data_source only splits the validation figures; one that was no
    string (a number, a list) used to be dropped without a word, and the row's figures went under no
    source. Null or absent is no source."""
    rows = [{"prompt": "a", "data_source": "gsm8k"}, {"prompt": "b", "data_source": None}, {"prompt": "c"}]
    f = write_jsonl(tmp_path / "plain.jsonl", [*rows, {"prompt": "d", "data_source": 7}])
    with pytest.raises(
        DataError, match=err(str(f), "line 4", "column 'data_source' must be a string (or null), got int")
    ):
        load_prompt_dataset(f, TOK, max_length=8)
    ds, report = load_prompt_dataset(f, TOK, max_length=8, on_invalid="skip")
    assert [e.extras for e in ds] == [{"data_source": "gsm8k"}, {}, {}] and report.skipped == {"wrong_type": 1}


def test_a_plain_rows_multi_turn_inputs_are_kept(tmp_path):
    """A row without reward_model (a generate input) kept its data_source only: its extra_info's
    interaction_kwargs and tools_kwargs were dropped, and a multi-turn run talked to the file's only
    interaction without the row's keywords, or failed on a tool's missing ones."""
    extra = {"interaction_kwargs": {"name": "retry", "question": "q"}, "tools_kwargs": {"calc": {"create_kwargs": {}}}}
    f = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "a", "extra_info": extra}, {"prompt": "b", "extra_info": 3}])
    ds, report = load_prompt_dataset(f, TOK, max_length=8, on_invalid="skip")
    (example,) = ds
    assert example.extras["interaction_kwargs"] == {"name": "retry", "question": "q"}
    assert list(example.extras["tools_kwargs"]) == ["calc"] and report.skipped == {"wrong_type": 1}
