"""The built-in arithmetic task: problems and worked steps, disjoint seeded splits, the response
format, the careless teacher's demonstrations, the task tokenizer (our ids == transformers' ids),
preference pairs from a policy's own samples, and the built-in data sets and models that carry it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rlhf.data import load_preference_dataset, load_prompt_dataset, load_sft_dataset, load_tokenizer
from megatron_rlhf.tasks.arithmetic import (
    OPS,
    SPLITS,
    TOKENIZER_VOCAB_SIZE,
    ArithmeticSpec,
    Problem,
    completion_verdicts,
    judge,
    make_problems,
    parse_answer,
    preference_pairs,
    prompt_rows,
    sft_rows,
    sloppy_response,
    split_of,
    verdict_rates,
    worked_steps,
    write_tokenizer,
)

# --------------------------------------------------------------------------- problems


@pytest.mark.parametrize(
    "problem, steps",
    [
        (Problem(37, "+", 48), "7+8=15, 3+4+1=8"),
        (Problem(57, "+", 48), "7+8=15, 5+4+1=10"),
        (Problem(52, "-", 37), "12-7=5, 5-1-3=1"),
        (Problem(100, "-", 1), "10-1=9, 10-1-0=9, 1-1-0=0"),
        (Problem(37, "-", 52), "37-52=-(52-37), 12-7=5, 5-1-3=1"),
        (Problem(37, "*", 48), "37*8=296, 37*40=1480, 296+1480=1776"),
        (Problem(123, "*", 405), "123*5=615, 123*400=49200, 615+49200=49815"),
        (Problem(37, "*", 0), "37*0=0"),
    ],
)
def test_worked_steps_hand_cases(problem: Problem, steps: str) -> None:
    assert worked_steps(problem) == steps
    assert problem.response(steps=True) == f" {steps} #### {problem.answer}"


def test_prompt_and_plain_response_format() -> None:
    assert Problem(37, "+", 48).prompt == "Q: 37+48=? A:"
    assert Problem(37, "+", 48).response() == " 85"
    assert Problem(37, "-", 52).response() == " -15"
    assert (Problem(0, "-", 0).answer, Problem(12, "*", 11).answer) == (0, 132)


@pytest.mark.parametrize("digits", [1, 2, 3, 4])
def test_every_demonstration_parses_to_its_answer(digits: int) -> None:
    spec = ArithmeticSpec(ops=OPS, digits=digits)
    for problem in make_problems(spec, "train", min(300, spec.num_problems * 8 // 20)):
        for steps in (False, True):
            assert parse_answer(problem.response(steps)) == problem.answer, problem


# --------------------------------------------------------------------------- splits


@pytest.mark.parametrize(
    "problem, response",
    [
        (Problem(37, "+", 48), " 7+8=15, 3+4=7 #### 75"),  # the carry into the tens is dropped
        (Problem(57, "+", 68), " 7+8=15, 5+6=11 #### 115"),  # the last column's own carry is still written
        (Problem(52, "-", 37), " 12-7=5, 5-3=2 #### 25"),  # the borrow is never paid back
        (Problem(37, "-", 52), " 37-52=-(52-37), 12-7=5, 5-3=2 #### -25"),
        (Problem(100, "-", 1), " 10-1=9, 0-0=0, 1-0=1 #### 109"),
        (Problem(12, "+", 34), " 2+4=6, 1+3=4 #### 46"),  # nothing to slip on: right
        (Problem(12, "*", 34), " 12*4=48, 12*30=360, 48+360=408 #### 408"),  # products are never slipped
    ],
)
def test_a_teacher_who_always_slips(problem: Problem, response: str) -> None:
    assert sloppy_response(problem, 1.0, seed=0) == response


def test_the_careless_teacher_slips_at_its_rate_and_is_deterministic() -> None:
    problems = make_problems(ArithmeticSpec(ops=("+", "-"), digits=2), "train", 4000)
    assert all(sloppy_response(p, 0.0, seed=0) == p.response(steps=True) for p in problems)
    # A problem can slip only where a column carries or borrows into a next column.
    slippable = [p for p in problems if sloppy_response(p, 1.0, seed=0) != p.response(steps=True)]
    wrong = [p for p in slippable if parse_answer(sloppy_response(p, 0.6, seed=0)) != p.answer]
    assert 0.35 < len(slippable) / len(problems) < 0.55
    assert abs(len(wrong) / len(slippable) - 0.6) < 0.05  # one slippable column per 2-digit problem
    assert [sloppy_response(p, 0.6, seed=0) for p in problems] == [sloppy_response(p, 0.6, seed=0) for p in problems]
    assert [sloppy_response(p, 0.6, seed=1) for p in slippable] != [sloppy_response(p, 0.6, seed=0) for p in slippable]
    assert sft_rows(problems[:50], slip_rate=0.6) == [
        {"prompt": p.prompt, "response": sloppy_response(p, 0.6, 0)} for p in problems[:50]
    ]
    with pytest.raises(ValueError, match=r"slip_rate=1\.5: expected a probability"):
        sloppy_response(problems[0], 1.5, seed=0)


def test_splits_partition_the_problems_by_seed() -> None:
    everything = [Problem(a, op, b) for a in range(10) for op in OPS for b in range(10)]
    by_split = {split: [p for p in everything if split_of(p, seed=0) == split] for split in SPLITS}
    assert sum(map(len, by_split.values())) == len(everything)
    assert 0.7 < len(by_split["train"]) / len(everything) < 0.9  # the 0.8 / 0.1 / 0.1 shares
    assert by_split != {split: [p for p in everything if split_of(p, seed=1) == split] for split in SPLITS}


def test_make_problems_is_deterministic_distinct_and_disjoint_across_splits() -> None:
    spec = ArithmeticSpec(ops=("+", "-"), digits=2, seed=3)
    drawn = {split: make_problems(spec, split, 900 if split != "train" else 5000) for split in SPLITS}
    assert make_problems(spec, "test", 900) == drawn["test"]
    assert make_problems(spec, "test", 100) == drawn["test"][:100]  # a prefix: counts only truncate
    for split, problems in drawn.items():
        assert len(set(problems)) == len(problems)
        assert {split_of(p, spec.seed) for p in problems} == {split}
        assert {p.op for p in problems} == {"+", "-"} and max(max(p.a, p.b) for p in problems) <= 99
    assert not set(drawn["train"]) & (set(drawn["validation"]) | set(drawn["test"]))
    assert make_problems(ArithmeticSpec(ops=("+", "-"), digits=2, seed=4), "test", 900) != drawn["test"]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Problem(1, "/", 2), r"Problem.op='/': expected one of"),
        (lambda: Problem(-1, "+", 2), r"Problem.a=-1: expected a non-negative int"),
        (lambda: ArithmeticSpec(ops=("/",)), r"ops=\('/',\): expected distinct operations"),
        (lambda: ArithmeticSpec(ops=()), r"ops=\(\): expected"),
        (lambda: ArithmeticSpec(digits=0), r"digits=0: expected an int from 1 to 9"),
        (lambda: make_problems(ArithmeticSpec(digits=1), "dev", 1), r"split='dev': expected one of"),
        (lambda: make_problems(ArithmeticSpec(digits=1), "test", 11), r"count=11 test problems.*expected 0..10"),
    ],
)
def test_bad_specs_and_requests_are_errors(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


# --------------------------------------------------------------------------- format and rules


@pytest.mark.parametrize(
    "response, verdict",
    [
        (" 85", "right"),
        (" 85 \n", "right"),
        (" 7+8=15, 3+4+1=8 #### 85", "right"),
        (" 7+8=15, 3+4+1=9 #### 85", "right"),  # only the final answer is checked
        (" 86", "wrong"),
        (" -85", "wrong"),
        (" 7+8=15 #### 95", "wrong"),
        ("85", "malformed"),  # the space after "A:" is part of the format
        (" 085", "malformed"),
        (" 85 86", "malformed"),
        (" 8 5", "malformed"),
        (" #### 85", "malformed"),
        (" 85 #### ", "malformed"),
        (" eighty-five", "malformed"),
        ("", "malformed"),
    ],
)
def test_judge(response: str, verdict: str) -> None:
    assert judge(response, "85") == verdict
    assert judge(response, 85) == verdict


def test_canonical_integers_only() -> None:
    assert judge(" 0", 0) == "right" and judge(" -0", 0) == "malformed"
    assert judge(" -15", -15) == "right" and judge(" - 15", -15) == "malformed"


def test_an_unfinished_response_is_malformed() -> None:
    assert judge(" 85", "85", finished=False) == "malformed"


def test_an_answer_that_is_no_integer_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"answer='eighty': expected an integer"):
        judge(" 80", "eighty")


# --------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("arith-tok"))


def _task_texts() -> list[str]:
    problems = make_problems(ArithmeticSpec(ops=OPS, digits=3, seed=7), "test", 200)
    rows = sft_rows(problems[:100]) + sft_rows(problems[100:], steps=True)
    return [r["prompt"] for r in rows] + [r["response"] for r in rows] + [r["prompt"] + r["response"] for r in rows]


def test_our_ids_equal_transformers_ids_and_decode_round_trips(tok_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours, theirs = load_tokenizer(tok_dir), AutoTokenizer.from_pretrained(tok_dir)
    assert ours.vocab_size == len(theirs) == TOKENIZER_VOCAB_SIZE
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    for text in _task_texts():
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False) == theirs(text).input_ids, text
        assert ours.decode(ids) == theirs.decode(ids) == text
    assert ours.decode(ours.encode(" 85") + [ours.eos_id]) == " 85"  # EOS decodes to nothing


def test_digits_are_single_pieces_and_rows_split_cleanly(tok_dir: Path) -> None:
    tok = load_tokenizer(tok_dir)
    assert [tok.decode([i]) for i in tok.encode(" 1234567890")[1:]] == list("1234567890")
    for row in sft_rows(make_problems(ArithmeticSpec(ops=OPS, digits=4), "train", 200), steps=True):
        assert tok.encode(row["prompt"]) + tok.encode(row["response"]) == tok.encode(row["prompt"] + row["response"])


def test_tokenizer_is_the_same_every_time(tok_dir: Path, tmp_path: Path) -> None:
    again = write_tokenizer(tmp_path)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tok_dir / name).read_bytes()


def test_rows_load_with_the_trainers_loaders(tok_dir: Path, tmp_path: Path) -> None:
    from megatron_rlhf.data.records import write_jsonl

    tok = load_tokenizer(tok_dir)
    problems = make_problems(ArithmeticSpec(), "validation", 20)
    sft, _ = load_sft_dataset(write_jsonl(sft_rows(problems, steps=True), tmp_path / "sft.jsonl"), tok, max_length=64)
    assert len(sft) == 20 and int(sft[0].input_ids[-1]) == tok.eos_id
    prompts, _ = load_prompt_dataset(
        write_jsonl(prompt_rows(problems), tmp_path / "p.jsonl"), tok, max_length=64, extra_keys=["answer"]
    )
    assert prompts[0].extras == {"answer": str(problems[0].answer)}
    pairs = [{"prompt": p.prompt, "chosen": p.response(), "rejected": f" {p.answer + 1}"} for p in problems]
    preference, _ = load_preference_dataset(write_jsonl(pairs, tmp_path / "rm.jsonl"), tok, max_length=64)
    assert len(preference) == 20


# --------------------------------------------------------------------------- preference pairs and verdicts


def test_preference_pairs_from_hand_made_samples() -> None:
    prompts = ["Q: 1+1=? A:", "Q: 2+2=? A:", "Q: 3+3=? A:", "Q: 4+4=? A:"]
    responses = [[" 2", " 3", " 2", "x"], [" 4", " 4", ""], [" 5", " 7"], [" 9", " 8", " 1"]]
    verdicts = [
        ["right", "wrong", "right", "malformed"],
        ["right", "right", "malformed"],
        ["wrong", "wrong"],
        ["wrong", "right", "wrong"],
    ]
    rows = preference_pairs(prompts, responses, verdicts, seed=0)
    # only prompts with a right and a non-blank other response (the loaders refuse empty text)
    assert [r["prompt"] for r in rows] == ["Q: 1+1=? A:", "Q: 4+4=? A:"]
    assert all(r["chosen"] in (" 2", " 8") and r["rejected"] in (" 3", "x", " 9", " 1") for r in rows)
    assert preference_pairs(prompts, responses, verdicts, seed=0) == rows
    every = preference_pairs(prompts, responses, verdicts, seed=0, pairs_per_prompt=10)
    pairs = sorted((r["chosen"], r["rejected"]) for r in every)
    assert pairs == [(" 2", " 3"), (" 2", "x"), (" 8", " 1"), (" 8", " 9")]
    seeds = {json.dumps(preference_pairs(prompts, responses, verdicts, seed=s)) for s in range(20)}
    assert len(seeds) > 1  # the seed picks which pair


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((["p"], [], []), {}, r"1 prompts but 0 response groups and 0 verdict groups"),
        ((["p"], [[" 1"]], [["right", "wrong"]]), {}, r"prompt 0: 1 responses but 2 verdicts"),
        ((["p"], [[" 1"]], [["good"]]), {}, r"prompt 0: verdict 'good', expected right, wrong or malformed"),
        ((["p"], [[" 1"]], [["right"]]), {"pairs_per_prompt": 0}, r"pairs_per_prompt=0: expected an int >= 1"),
    ],
)
def test_preference_pair_errors(args, kwargs, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        preference_pairs(*args, seed=0, **kwargs)


def test_completion_verdicts_and_rates() -> None:
    prompts = [{"prompt": "Q: 1+1=? A:", "answer": "2"}, {"prompt": "Q: 5-9=? A:", "answer": "-4"}]
    completions = [
        {"prompt_index": 1, "text": " -4", "finish_reason": "stop"},
        {"prompt_index": 0, "text": " 2", "finish_reason": "length"},
        {"prompt_index": 0, "text": " 3", "finish_reason": "stop"},
        {"prompt_index": 1, "text": " 4", "finish_reason": "stop"},
    ]
    responses, verdicts = completion_verdicts(prompts, completions)
    assert responses == [[" 2", " 3"], [" -4", " 4"]]
    assert verdicts == [["malformed", "wrong"], ["right", "wrong"]]
    assert verdict_rates(verdicts) == {"samples": 4, "right": 0.25, "wrong": 0.5, "malformed": 0.25}
    with pytest.raises(ValueError, match=r"completion 0: prompt_index=2 outside the 2 prompts"):
        completion_verdicts(prompts, [{"prompt_index": 2, "text": " 1", "finish_reason": "stop"}])
    with pytest.raises(ValueError, match=r"completion 0: no \['finish_reason'\]"):
        completion_verdicts(prompts, [{"prompt_index": 0, "text": " 1"}])


# --------------------------------------------------------------------------- built-in data and models


def test_builtin_arithmetic_sets_are_disjoint_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_rlhf.data.builtin import resolve_data_paths
    from megatron_rlhf.data.records import read_records

    monkeypatch.setenv("MEGATRON_RLHF_CACHE", str(tmp_path))
    names = [
        "arithmetic-sft",
        "arithmetic-sft-validation",
        "arithmetic-sft-careless",
        "arithmetic-sft-careless-validation",
        "arithmetic-prompts",
        "arithmetic-validation",
        "arithmetic-test",
    ]
    paths = resolve_data_paths([f"builtin:{n}" for n in names])
    rows = {n: [r.data for r in read_records(p)] for n, p in zip(names, paths, strict=True)}
    test = {r["prompt"] for r in rows["arithmetic-test"]}
    assert all(set(r) == {"prompt", "answer"} for n in ("arithmetic-test", "arithmetic-validation") for r in rows[n])
    assert all(set(r) == {"prompt", "response"} and " #### " in r["response"] for r in rows["arithmetic-sft"])
    assert not test & {r["prompt"] for n in names if n != "arithmetic-test" for r in rows[n]}
    assert {r["prompt"] for r in rows["arithmetic-prompts"]} <= {r["prompt"] for r in rows["arithmetic-sft"]}
    for clean, careless in (
        ("arithmetic-sft", "arithmetic-sft-careless"),
        ("arithmetic-sft-validation", "arithmetic-sft-careless-validation"),
    ):
        pairs = list(zip(rows[clean], rows[careless], strict=True))
        assert all(a["prompt"] == b["prompt"] for a, b in pairs)  # the same problems, another teacher
        assert 0.2 < sum(a["response"] != b["response"] for a, b in pairs) / len(pairs) < 0.35
    validation_sft = {r["prompt"] for r in rows["arithmetic-sft-validation"]}
    assert {r["prompt"] for r in rows["arithmetic-validation"]} == validation_sft


def test_builtin_arithmetic_models_ship_the_task_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_rlhf.checkpoint.sources import architecture_of
    from megatron_rlhf.data.tokenizer import SentencePieceTokenizer, resolve_tokenizer
    from megatron_rlhf.models.builtin import builtin_checkpoint

    monkeypatch.setenv("MEGATRON_RLHF_CACHE", str(tmp_path))
    for name in ("builtin:arith-llama", "builtin:arith-llama-rm"):
        arch = architecture_of(name)
        tok = resolve_tokenizer(builtin_checkpoint(name), arch, name)
        assert isinstance(tok, SentencePieceTokenizer) and tok.vocab_size == arch.vocab_size == TOKENIZER_VOCAB_SIZE
        ids = tuple(arch.hf_config[f"{role}_token_id"] for role in ("bos", "eos", "pad"))
        assert (tok.bos_id, tok.eos_id, tok.pad_id) == ids
