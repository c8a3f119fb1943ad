"""Rule rewards: the built-in rules against hand-derived values, lookup by name and import path,
and errors that name the rule and what was expected; verl reward functions loaded from a file and
called as verl calls them, on prompt rows in verl's format."""

from __future__ import annotations

import math
import re
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megatron_rlhf.rewards import (
    CustomFunctionConfig,
    CustomRewardFunction,
    CustomScores,
    RewardFunctionError,
    Sample,
    load_custom_function,
    metric_means,
    resolve_rule,
    rule_scores,
)


def _sample(response: str, finish_reason: str = "stop", **extras) -> Sample:
    return Sample(
        prompt_ids=[5],
        response_ids=[6],
        prompt_text="p",
        response_text=response,
        finish_reason=finish_reason,
        extras=extras,
    )


def test_lowercase_fraction_hand_values() -> None:
    rule = resolve_rule("lowercase_fraction")
    assert rule(_sample("abC1")) == 0.5
    assert rule(_sample("xyz")) == 1.0
    assert rule(_sample("")) == 0.0
    assert rule(_sample("é a")) == pytest.approx(1 / 3)  # é is not ASCII


def test_exact_answer_strips_whitespace_and_needs_the_column() -> None:
    rule = resolve_rule("exact_answer")
    assert rule(_sample(" 42\n", answer=42)) == 1.0
    assert rule(_sample("41", answer="42")) == 0.0
    with pytest.raises(ValueError, match=r"'answer' column.*data.extra_keys=\[answer\]"):
        rule(_sample("42"))


def test_arithmetic_rules_right_wrong_malformed() -> None:
    answer, fmt = resolve_rule("arithmetic_answer"), resolve_rule("arithmetic_format")
    cases = [
        (_sample(" 85", answer="85"), 1.0, 1.0),
        (_sample(" 7+8=15, 3+4+1=8 #### 85", answer="85"), 1.0, 1.0),
        (_sample(" 84", answer="85"), 0.0, 1.0),
        (_sample(" 85 86", answer="85"), 0.0, 0.0),
        (_sample("", answer="85"), 0.0, 0.0),
        (_sample(" 85", "length", answer="85"), 0.0, 0.0),
    ]
    for sample, right, well_formed in cases:
        assert (answer(sample), fmt(sample)) == (right, well_formed), sample.response_text


@pytest.mark.parametrize("name", ["arithmetic_answer", "arithmetic_format"])
def test_arithmetic_rules_need_the_answer_column(name: str) -> None:
    with pytest.raises(ValueError, match=rf"'{name}' needs the prompt rows' 'answer' column.*extra_keys=\[answer\]"):
        resolve_rule(name)(_sample(" 85"))


def test_rule_by_import_path(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("my_rules")
    module.length = lambda sample: len(sample.response_text)
    monkeypatch.setitem(sys.modules, "my_rules", module)
    rule = resolve_rule("my_rules:length")
    assert rule_scores({"len": rule}, [_sample("abc"), _sample("")]) == {"len": [3.0, 0.0]}


@pytest.mark.parametrize(
    "name, message",
    [
        ("lowercase_fractoin", r"Unknown reward rule 'lowercase_fractoin'.*Did you mean 'lowercase_fraction'"),
        ("no_such_module_xyz:f", r"cannot import module 'no_such_module_xyz'"),
        ("math:no_such_function", r"module 'math' has no callable 'no_such_function'$"),
        ("math:sqr", r"module 'math' has no callable 'sqr'; did you mean 'sqrt'\?"),
    ],
)
def test_bad_rule_names(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_rule(name)


@pytest.mark.parametrize("value", [math.nan, math.inf, "1.0", None])
def test_a_non_finite_or_non_numeric_score_is_an_error_naming_rule_and_sample(value) -> None:
    with pytest.raises(
        ValueError,
        match=r"reward rule 'bad' \(.*test_rewards.py\) on sample 1 \(response 'two'\) "
        r"returned score .*: expected a finite number",
    ):
        rule_scores({"bad": lambda s: 0.0 if s.response_text == "one" else value}, [_sample("one"), _sample("two")])


def test_bool_scores_count_as_zero_and_one() -> None:
    assert rule_scores({"b": lambda s: s.response_text == "yes"}, [_sample("yes"), _sample("no")]) == {"b": [1.0, 0.0]}


# --------------------------------------------------------------------------- verl reward functions

# A reward file as verl users write them (modelled on verl's gsm8k scorer, written here): keyword
# arguments, a dataclass (needs its module in sys.modules), a dict result with a non-numeric key.
VERL_STYLE_FILE = """
import dataclasses
import re

CALLS = []


@dataclasses.dataclass
class Parsed:
    answer: str | None


def _parse(text):
    found = re.findall(r"#### (\\-?[0-9\\.\\,]+)", text)
    return Parsed(found[-1].replace(",", "") if found else None)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    CALLS.append((data_source, solution_str, ground_truth, dict(extra_info)))
    extra_info["seen"] = True  # verl's reward manager hands each call its own dict; so do we
    parsed = _parse(solution_str)
    correct = parsed.answer == ground_truth
    return {"score": 1.0 if correct else 0.1 * (parsed.answer is not None), "acc": correct, "pred": parsed.answer}


def plain(*, data_source, solution_str, ground_truth, extra_info):
    return len(solution_str) - len(ground_truth)
"""


def write_reward_file(tmp_path: Path, text: str = VERL_STYLE_FILE, name: str = "my_reward.py") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def verl_sample(response: str, ground_truth: str = "7", data_source: str = "openai/gsm8k", **extra_info) -> Sample:
    return _sample(response, data_source=data_source, ground_truth=ground_truth, extra_info=extra_info)


def test_verl_function_end_to_end_from_prompt_rows(tmp_path: Path) -> None:
    """Rows in verl's format -> prompt extras -> Sample -> compute_score(data_source=, solution_str=, ...)."""
    from megatron_rlhf.data import ByteTokenizer, load_prompt_dataset

    problems = [("3 + 4?", "7"), ("25 * 48?", "1200")]
    rows = [
        {
            "prompt": q,
            "data_source": "openai/gsm8k",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": "train", "index": index},
        }
        for index, (q, truth) in enumerate(problems)
    ]
    prompts = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), prompts)
    dataset, _ = load_prompt_dataset(prompts, ByteTokenizer(300), max_length=64)
    function = load_custom_function(write_reward_file(tmp_path))
    responses = [("It is 3 + 4 = 7.\n#### 7", 0), ("#### 1,200", 1), ("#### 1201", 1), ("no idea", 0)]
    samples = [_sample(text, **dataset[i].extras) for text, i in responses]
    result = function.score(samples)
    assert result.scores == [1.0, 1.0, 0.1, 0.0]
    assert result.metrics == {"acc": [1.0, 1.0, 0.0, 0.0]}  # 'pred' (a string or None) is no metric
    assert metric_means([result]) == {"acc": 0.5}
    calls = sys.modules[function.function.__module__].CALLS
    assert calls[0] == ("openai/gsm8k", "It is 3 + 4 = 7.\n#### 7", "7", {"split": "train", "index": 0})
    assert calls[2] == ("openai/gsm8k", "#### 1201", "1200", {"split": "train", "index": 1})
    assert dataset[0].extras["extra_info"] == {"split": "train", "index": 0}  # the function's edit did not leak


def test_keyword_only_function_and_metric_means_over_parts(tmp_path: Path) -> None:
    function = load_custom_function(write_reward_file(tmp_path), name="plain")
    assert function.score([verl_sample("abcd", ground_truth="ab")]).scores == [2.0]
    parts = [CustomScores([1.0], {"acc": [1.0]}), CustomScores([0.0, 0.0], {"acc": [0.0, 0.0], "len": [4.0, 6.0]})]
    assert metric_means(parts) == {"acc": pytest.approx(1 / 3), "len": 5.0}


@pytest.mark.parametrize(
    "value, expected",
    [
        (1, 1.0),
        (True, 1.0),
        (np.float32(0.25), 0.25),
        (np.int64(-2), -2.0),
        (np.bool_(True), 1.0),
        (torch.tensor(0.5), 0.5),
        (torch.tensor(3, dtype=torch.int32), 3.0),
        (np.array(0.75), 0.75),
    ],
)
def test_scores_may_be_python_numpy_or_0d_torch_numbers(tmp_path: Path, value, expected) -> None:
    function = CustomRewardFunction(lambda **kwargs: value, "f", tmp_path / "f.py")
    assert function.score([verl_sample("x")]).scores == [expected]
    function = CustomRewardFunction(lambda **kwargs: {"score": value, "m": value}, "f", tmp_path / "f.py")
    assert function.score([verl_sample("x")]) == CustomScores([expected], {"m": [expected]})


@pytest.mark.parametrize(
    "value",
    [
        math.nan,
        -math.inf,
        np.float64("nan"),
        torch.tensor(math.inf),
        "1.0",
        None,
        torch.tensor([1.0]),
        np.array([0.5]),
        [1.0],
        1 + 2j,
        np.complex64(1),
    ],
)
def test_a_bad_score_names_function_file_and_sample(tmp_path: Path, value) -> None:
    path = tmp_path / "judge.py"
    function = CustomRewardFunction(
        lambda solution_str, **kwargs: 0.0 if solution_str == "one" else value, "judge", path
    )
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"custom reward function 'judge' ({path}) on sample 1 (data_source "
            "'openai/gsm8k', response 'two') returned score "
        )
        + ".*expected a finite number",
    ):
        function.score([verl_sample("one"), verl_sample("two")])
    dict_function = CustomRewardFunction(lambda **kwargs: {"score": value}, "judge", tmp_path / "judge.py")
    with pytest.raises(ValueError, match=r"on sample 0 .* returned score .*expected a finite number"):
        dict_function.score([verl_sample("one")])


def test_a_dict_without_score(tmp_path: Path) -> None:
    function = CustomRewardFunction(lambda **kwargs: {"reward": 1.0, "acc": 1}, "f", tmp_path / "f.py")
    with pytest.raises(ValueError, match=r"sample 0 .* returned a dict without 'score' \(keys: \['acc', 'reward'\]\)"):
        function.score([verl_sample("x")])


def test_an_exception_names_function_file_sample_and_keeps_the_traceback(tmp_path: Path) -> None:
    path = write_reward_file(
        tmp_path,
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return float(solution_str) / float(ground_truth)\n",
    )
    function = load_custom_function(path)
    assert function.score([verl_sample("3.5", ground_truth="7")]).scores == [0.5]
    with pytest.raises(RewardFunctionError) as info:
        function.score([verl_sample("1", ground_truth="7"), verl_sample("x", ground_truth="0")])
    message = str(info.value)
    assert message.startswith(
        f"custom reward function 'compute_score' ({path}) on sample 1 (data_source "
        "'openai/gsm8k', response 'x') raised:\nTraceback (most recent call last):"
    )
    assert f'File "{path}", line 2, in compute_score' in message
    assert message.rstrip().endswith("ValueError: could not convert string to float: 'x'")
    assert isinstance(info.value.__cause__, ValueError)


def test_samples_without_verl_columns(tmp_path: Path) -> None:
    function = load_custom_function(write_reward_file(tmp_path))
    with pytest.raises(
        ValueError,
        match=r"on sample 0 .*the prompt row has no \['data_source', 'ground_truth', "
        r"'extra_info'\]; a verl reward function needs the rows' data_source and "
        r"reward_model\.ground_truth columns",
    ):
        function.score([_sample("x", answer="7")])


def test_loader_errors_name_the_setting(tmp_path: Path) -> None:
    missing = tmp_path / "nope.py"
    with pytest.raises(ValueError, match=re.escape(f"scoring.custom_function.path='{missing}': no such file")):
        load_custom_function(missing)
    with pytest.raises(ValueError, match=re.escape(f"scoring.custom_function.path='{tmp_path}': is a directory")):
        load_custom_function(tmp_path)
    text = write_reward_file(tmp_path, "x = 1\n", name="reward.txt")
    with pytest.raises(ValueError, match=re.escape(f"scoring.custom_function.path='{text}': cannot be imported")):
        load_custom_function(text)
    path = write_reward_file(tmp_path)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"scoring.custom_function.name='compute_scor': {path} has no "
            "'compute_scor'; functions defined there: "
            "['_parse', 'compute_score', 'plain']"
        ),
    ):
        load_custom_function(path, name="compute_scor")
    with pytest.raises(ValueError, match=re.escape(f"{path} has a non-callable list 'CALLS'")):
        load_custom_function(path, name="CALLS")
    broken = write_reward_file(tmp_path, "import no_such_module_xyz\n", name="broken.py")
    with pytest.raises(
        ValueError,
        match=re.escape(f"scoring.custom_function.path='{broken}': importing {broken} failed:")
        + r"(.|\n)*ModuleNotFoundError: No module named "
        "'no_such_module_xyz'",
    ):
        load_custom_function(broken)
    coroutine = write_reward_file(tmp_path, "async def compute_score(**kwargs):\n    return 1.0\n", name="aio.py")
    with pytest.raises(ValueError, match=r"compute_score in .*aio.py is async; give a plain function"):
        load_custom_function(coroutine)


def test_custom_function_config_defaults() -> None:
    assert CustomFunctionConfig() == CustomFunctionConfig(path="", name="compute_score")


def test_rules_accept_numpy_and_0d_torch_scores() -> None:
    rules = {"np": lambda s: np.float32(0.5), "t": lambda s: torch.tensor(2)}
    assert rule_scores(rules, [_sample("a")]) == {"np": [0.5], "t": [2.0]}


# --------------------------------------------------------------------------- text with special tokens

# verl's gsm8k scorer (verl/utils/reward_score/gsm8k.py, strict format), written here: the answer
# after '#### ' scores 1.0, anything else 0.
GSM8K_STRICT = """
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    found = re.search("#### (\\\\-?[0-9\\\\.\\\\,]+)", solution_str)
    return 1.0 if found and found.group(1).replace(",", "") == ground_truth else 0.0
"""


def test_rewards_read_responses_decoded_with_special_tokens_skipped_as_verl(world_of_one, tmp_path: Path) -> None:
    """A '<|im_start|>' sampled mid-response is not in the text a reward reads: the scorer's texts
    equal transformers' decode(ids, skip_special_tokens=True) of the response without its final
    stop token, so 'ang 3 ####<|im_start|> 3' scores 1.0 with verl's gsm8k rule, as in verl (0 if
    the special token stayed in the text); the ids are untouched."""
    import functools

    from transformers import AutoTokenizer

    from megatron_rlhf.data import load_tokenizer
    from megatron_rlhf.rewards.scoring import Scorer, ScoringConfig
    from megatron_rlhf.rollout.engine import Completion
    from megatron_rlhf.trainer.ppo import rollout_batch
    from tests.helpers import make_chat_tokenizer

    model_dir = make_chat_tokenizer("qwen2", tmp_path / "qwen2")
    tok, theirs = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    responses = ["ang 3 ####<|im_start|> 3", "#### 3<|endoftext|>", "#### <|im_start|>4"]
    prompt = theirs.encode("<|im_start|>user\nWhat is 1 plus 2?<|im_end|>\n<|im_start|>assistant\n")
    completions = [
        Completion(
            prompt_index=0,
            sample_index=i,
            prompt_ids=prompt,
            token_ids=ids,
            logprobs=[0.0] * len(ids),
            finish_reason="stop",
        )
        for i, text in enumerate(responses)
        for ids in [theirs.encode(text) + [tok.eos_id]]
    ]
    function = load_custom_function(write_reward_file(tmp_path, GSM8K_STRICT))
    scorer = Scorer(
        ScoringConfig(), {}, function, None, stop_ids=tok.stop_ids, max_new_tokens=16, max_tokens_per_micro_batch=256
    )
    extras = [{"data_source": "openai/gsm8k", "ground_truth": "3", "extra_info": {}}]
    texts = functools.partial(tok.decode_batch, skip_special_tokens=True)
    samples = scorer.samples(completions, texts, extras)
    assert (
        [s.response_text for s in samples]
        == [theirs.decode(c.token_ids[:-1], skip_special_tokens=True) for c in completions]
        == ["ang 3 #### 3", "#### 3", "#### 4"]
    )
    assert (
        samples[0].prompt_text
        == theirs.decode(prompt, skip_special_tokens=True)
        == "user\nWhat is 1 plus 2?\nassistant\n"
    )
    assert [s.response_ids for s in samples] == [c.token_ids for c in completions]
    scores = scorer.score(rollout_batch(completions, tok.pad_id), completions, extras, texts)
    assert scores.parts["custom_function"].tolist() == [1.0, 1.0, 0.0]
    namespace: dict = {}
    exec(GSM8K_STRICT, namespace)
    assert namespace["compute_score"]("openai/gsm8k", responses[0], "3") == 0.0  # the text with its special token


# --------------------------------------------------------------------------- every way out of reward code


class _NotAnException(BaseException):
    """What a library may raise that ``except Exception`` lets through."""


def _leaves(how: str):
    def rule(sample: Sample) -> float:
        if sample.response_text != "two":
            return 1.0
        if how == "exit":
            sys.exit(0)
        if how == "interrupt":
            raise KeyboardInterrupt
        if how == "generator_exit":
            raise GeneratorExit
        if how == "base":
            raise _NotAnException("deep in a library")
        if how == "key":
            return {"a": 1}["answer"]
        raise ValueError("no answer in the response")

    return rule


LEAVES = {
    "exit": "SystemExit: 0",
    "interrupt": "KeyboardInterrupt",
    "generator_exit": "GeneratorExit",
    "base": "_NotAnException: deep in a library",
    "key": "KeyError: 'answer'",
    "value": "ValueError: no answer in the response",
}


@pytest.mark.parametrize("how", sorted(LEAVES))
def test_every_way_out_of_a_rule_is_its_error_with_name_sample_and_traceback(world_of_one, how: str) -> None:
    """A rule that exits, raises KeyboardInterrupt/GeneratorExit/a BaseException, a KeyError or a
    ValueError, on the scorer's thread: a RewardFunctionError naming the rule, its file, the sample
    (its row in the rollout), with the rule's traceback (its frames, not the caller's)."""
    from megatron_rlhf.rewards.scoring import Scorer, ScoringConfig
    from megatron_rlhf.rollout.engine import Completion
    from megatron_rlhf.trainer.ppo import rollout_batch

    completions = [
        Completion(prompt_index=0, sample_index=i, prompt_ids=[5], token_ids=[7] * n, logprobs=[0.0] * n)
        for i, n in enumerate((1, 2, 3))
    ]
    scorer = Scorer(
        ScoringConfig(),
        {"mine": _leaves(how)},
        None,
        None,
        stop_ids=(),
        max_new_tokens=8,
        max_tokens_per_micro_batch=64,
    )
    decode = lambda rows: [["one", "two", "three"][len(ids) - 1] if len(ids) < 4 else "p" for ids in rows]  # noqa: E731
    with pytest.raises(RewardFunctionError) as info:
        scorer.score(rollout_batch(completions, 0), completions, [{}], decode)
    message = str(info.value)
    assert message.startswith(
        f"reward rule 'mine' ({__file__}) on sample 1 (response 'two') raised:\nTraceback (most recent call last):\n"
    )
    assert ", in rule\n" in message and "calls.py" not in message
    assert message.rstrip().endswith(LEAVES[how])
    assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)


def test_a_keyboard_interrupt_on_the_main_thread_passes_through() -> None:
    """On the main thread a KeyboardInterrupt may be the user's Ctrl-C: it is not made the rule's error."""
    with pytest.raises(KeyboardInterrupt):
        rule_scores({"mine": _leaves("interrupt")}, [_sample("one"), _sample("two")])
    with pytest.raises(RewardFunctionError, match=r"(?s)'mine' .* on sample 1 .*SystemExit: 0"):
        rule_scores({"mine": _leaves("exit")}, [_sample("one"), _sample("two")])


def test_a_custom_function_that_exits_is_its_error(tmp_path: Path) -> None:
    path = write_reward_file(
        tmp_path,
        "import sys\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    sys.exit(0)\n",
    )
    with pytest.raises(RewardFunctionError) as info:
        load_custom_function(path).score([verl_sample("x")])
    assert str(info.value).startswith(
        f"custom reward function 'compute_score' ({path}) on sample 0 (data_source "
        "'openai/gsm8k', response 'x') raised:\nTraceback"
    )
    assert f'File "{path}", line 4, in compute_score' in str(info.value)
    assert str(info.value).rstrip().endswith("SystemExit: 0")


def test_rule_modules_that_fail_to_import_name_the_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "syntax_rule.py").write_text("def f(sample):\n    return 1 +\n")
    (tmp_path / "exits_rule.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ValueError,
        match=r"reward rule 'syntax_rule:f': importing module 'syntax_rule' failed:\n"
        r"(.|\n)*syntax_rule.py\", line 2(.|\n)*SyntaxError",
    ):
        resolve_rule("syntax_rule:f")
    with pytest.raises(
        ValueError,
        match=r"reward rule 'exits_rule:f': importing module 'exits_rule' failed:\n"
        r"(.|\n)*SystemExit: 3",
    ):
        resolve_rule("exits_rule:f")
    exits = write_reward_file(tmp_path, "import sys\nsys.exit(0)\n", name="exits_file.py")
    with pytest.raises(
        ValueError,
        match=re.escape(f"scoring.custom_function.path='{exits}': importing {exits} failed:") + r"(.|\n)*SystemExit: 0",
    ):
        load_custom_function(exits)


# --------------------------------------------------------------------------- scores in float32


@pytest.mark.parametrize("value", [1e300, -1e39, np.float64(4e38), torch.tensor(1e300, dtype=torch.float64)])
def test_a_score_past_float32_names_function_and_value(tmp_path: Path, value) -> None:
    """1e300 is a finite float64 but inf in float32, the dtype the scores are summed in."""
    shown = re.escape(repr(value))
    with pytest.raises(
        RewardFunctionError,
        match=rf"reward rule 'big' .* on sample 0 \(response 'x'\) returned score "
        rf"{shown}: outside the range of float32 \(\|score\| <= 3.403e\+38\)",
    ):
        rule_scores({"big": lambda s: value}, [_sample("x")])
    function = CustomRewardFunction(lambda **kwargs: {"score": value}, "f", tmp_path / "f.py")
    with pytest.raises(RewardFunctionError, match=rf"custom reward function 'f' .* returned score {shown}: outside"):
        function.score([verl_sample("x")])
    largest = float(torch.finfo(torch.float32).max)
    assert rule_scores({"edge": lambda s: -largest}, [_sample("x")]) == {"edge": [-largest]}


def test_a_weighted_sum_past_float32_is_an_error_naming_the_parts(world_of_one) -> None:
    from megatron_rlhf.rewards.scoring import Scorer, ScoringConfig
    from megatron_rlhf.rollout.engine import Completion
    from megatron_rlhf.trainer.ppo import rollout_batch

    completions = [
        Completion(prompt_index=0, sample_index=i, prompt_ids=[5], token_ids=[7], logprobs=[0.0]) for i in range(2)
    ]
    cfg = ScoringConfig(rules=["big", "one"], weights={"big": 10.0})
    scorer = Scorer(
        cfg,
        {"big": lambda s: 3e38 if s.response_ids == [7] and s.extras else 0.0, "one": lambda s: 1.0},
        None,
        None,
        stop_ids=(),
        max_new_tokens=8,
        max_tokens_per_micro_batch=64,
    )
    with pytest.raises(
        ValueError,
        match=r"sample 0's score inf is not finite in float32: its parts are big 3e\+38, "
        r"one 1, weighted by scoring.weights=\{'big': 10.0\}",
    ):
        scorer.score(rollout_batch(completions, 0), completions, [{"a": 1}], lambda rows: ["x"] * len(rows))


# --------------------------------------------------------------------------- signatures, checked at start-up

GSM8K_VERL_SIGNATURE = (
    "def compute_score(solution_str, ground_truth, method='strict', format_score=0.0, score=1.0):\n    return 0.0\n"
)


def test_a_function_verl_could_not_call_is_refused_when_loaded(tmp_path: Path) -> None:
    """verl's gsm8k.compute_score takes no data_source/extra_info: refused at start-up (scoring_errors,
    which check_ppo_config reports), naming what verl calls and what the function takes."""
    from megatron_rlhf.rewards.config import ScoringConfig, scoring_errors

    path = write_reward_file(tmp_path, GSM8K_VERL_SIGNATURE)
    expected = (
        f"scoring.custom_function.name='compute_score': compute_score(solution_str, ground_truth, "
        f"method='strict', format_score=0.0, score=1.0) in {path} cannot be called as verl calls a reward "
        "function, compute_score(data_source=, solution_str=, ground_truth=, extra_info=) (got an unexpected "
        "keyword argument 'data_source'); take those keywords (or **kwargs)"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        load_custom_function(path)
    errors, _, _ = scoring_errors(ScoringConfig(custom_function=CustomFunctionConfig(path=str(path))))
    assert len(errors) == 1 and errors[0].startswith(expected)
    for text in [
        "def compute_score(data_source, solution_str, ground_truth, extra_info, /):\n    return 0\n",
        "def compute_score(data_source, solution_str, ground_truth, extra_info, tokenizer):\n    return 0\n",
    ]:
        with pytest.raises(ValueError, match="cannot be called as verl calls a reward function"):
            load_custom_function(write_reward_file(tmp_path, text, name="other.py"))
    for text in [
        "def compute_score(**kwargs):\n    return 0\n",
        "def compute_score(*, solution_str, **kwargs):\n    return 0\n",
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, sandbox_fusion_url=None, "
        "concurrent_semaphore=None, memory_limit_mb=None):\n    return 0\n",
        "class Scorer:\n    def __call__(self, solution_str, **kwargs):\n        return 0\n\n"
        "compute_score = Scorer()\n",
    ]:
        load_custom_function(write_reward_file(tmp_path, text, name="fine.py"))


def test_a_rule_must_take_one_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("shaped_rules")
    module.two = lambda sample, answer: 0.0
    module.keyword = lambda *, sample: 0.0
    module.none = lambda: 0.0
    module.fine = lambda sample, scale=1.0: 0.0
    module.star = lambda *args: 0.0
    monkeypatch.setitem(sys.modules, "shaped_rules", module)
    for name, problem in [
        ("two", r"\(sample, answer\).*missing a required argument: 'answer'"),
        ("keyword", r"\(\*, sample\).*too many positional arguments"),
        ("none", r"\(\).*too many positional arguments"),
    ]:
        with pytest.raises(ValueError, match=rf"reward rule 'shaped_rules:{name}': {name}{problem}"):
            resolve_rule(f"shaped_rules:{name}")
    with pytest.raises(ValueError, match=r"cannot be called as a rule is, two\(sample\) -> float"):
        resolve_rule("shaped_rules:two")
    assert resolve_rule("shaped_rules:fine") is module.fine and resolve_rule("shaped_rules:star") is module.star


# --------------------------------------------------------------------------- scoring.timeout_s


def _hanging_scorer(timeout_s: float, release: threading.Event, interrupted=None):
    """A scorer whose rule waits on ``release`` for sample 1 ('two'), and its rollout."""
    from megatron_rlhf.rewards.scoring import Scorer, ScoringConfig
    from megatron_rlhf.rollout.engine import Completion
    from megatron_rlhf.trainer.ppo import rollout_batch

    def hangs(sample: Sample) -> float:
        if sample.response_text == "two":
            release.wait(60)
        return 1.0

    completions = [
        Completion(prompt_index=0, sample_index=i, prompt_ids=[5], token_ids=[7] * n, logprobs=[0.0] * n)
        for i, n in enumerate((1, 2, 3))
    ]
    scorer = Scorer(
        ScoringConfig(timeout_s=timeout_s),
        {"hangs": hangs},
        None,
        None,
        stop_ids=(),
        max_new_tokens=8,
        max_tokens_per_micro_batch=64,
        interrupted=interrupted,
    )
    decode = lambda rows: [["one", "two", "three"][len(ids) - 1] if len(ids) < 4 else "p" for ids in rows]  # noqa: E731
    return lambda: scorer.start(rollout_batch(completions, 0), completions, [{}], decode)


def test_a_hung_rule_fails_after_the_timeout_naming_rule_sample_and_line(world_of_one) -> None:
    """The waiter gives up after scoring.timeout_s with the rule, its file, the sample and the line
    the rule is at (its own frames); the stuck thread is left behind (here released afterwards)."""
    import threading
    import time

    release = threading.Event()
    start = time.monotonic()
    pending = _hanging_scorer(0.5, release)()
    with pytest.raises(RewardFunctionError) as info:
        pending.result()
    waited = time.monotonic() - start
    release.set()
    assert 0.5 <= waited < 5
    message = str(info.value)
    assert re.match(
        re.escape(f"reward rule 'hangs' ({__file__}) on sample 1 (response 'two') has run ")
        + r"0\.\d s, "
        + re.escape(
            "longer than scoring.timeout_s=0.5 (raise scoring.timeout_s, or set it to 0 for no "
            "limit); the run ends. It is at:\n"
        ),
        message,
    )
    assert ", in hangs\n    release.wait(60)\n" in message and message.rstrip().endswith(
        "waiter.acquire(True, timeout)"
    )
    assert "calls.py" not in message and "scoring.py" not in message  # the stack starts at the rule


def test_a_stop_signal_while_a_rule_hangs_is_recorded_and_the_timeout_ends_the_wait(world_of_one) -> None:
    """SIGTERM while the main thread waits for a hung rule: the handler runs (the stop is recorded)
    and the wait still ends at the timeout instead of hanging."""
    import os
    import signal
    import threading

    from megatron_rlhf.trainer.stop import StopSignals

    release = threading.Event()
    with StopSignals() as signals:
        pending = _hanging_scorer(1.0, release)()
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(RewardFunctionError, match=r"has run 1\.\d s, longer than scoring.timeout_s=1 "):
            pending.result()
    release.set()
    assert signals.code == 0


def test_a_stop_signal_while_a_rule_hangs_interrupts_the_wait_when_the_trainer_watches_for_it(world_of_one) -> None:
    """The trainer's scorer watches ``stop_requested``: SIGTERM while a rule hangs ends the wait
    within a poll (not at scoring.timeout_s) with ``ScoringInterrupted``, so that the run can save."""
    import os
    import signal
    import threading
    import time

    from megatron_rlhf.rewards import ScoringInterrupted
    from megatron_rlhf.trainer.stop import StopSignals, stop_requested

    release = threading.Event()
    with StopSignals():
        pending = _hanging_scorer(60.0, release, interrupted=stop_requested)()
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        start = time.monotonic()
        with pytest.raises(ScoringInterrupted, match=r"a stop was requested while reward code ran on rank\(s\) \[0\]"):
            pending.result()
    release.set()
    assert time.monotonic() - start < 5
    assert not stop_requested()  # only while a run's signals are in force


def test_a_call_that_returns_past_the_timeout_fails_and_zero_means_no_limit() -> None:
    import time

    from megatron_rlhf.rewards import RewardCalls

    where = lambda: "reward rule 'slow' (slow.py) on sample 0 (response 'x')"  # noqa: E731
    with pytest.raises(
        RewardFunctionError,
        match=r"^reward rule 'slow' \(slow.py\) on sample 0 \(response 'x'\) took "
        r"0\.\d s, longer than scoring.timeout_s=0.1 \(raise",
    ):
        RewardCalls(0.1)(where, time.sleep, 0.3)
    assert RewardCalls(0)(where, lambda: time.sleep(0.3) or 2.0) == 2.0
    assert RewardCalls(10)(where, lambda a, *, b: a + b, 1, b=2) == 3


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf])
def test_timeout_setting_errors(value: float) -> None:
    from megatron_rlhf.rewards.scoring import ScoringConfig

    assert ScoringConfig(timeout_s=value).errors() == [f"timeout_s={value} must be >= 0 and finite (0: no limit)"]
    assert ScoringConfig().timeout_s == 60.0 and ScoringConfig(timeout_s=0).errors() == []
