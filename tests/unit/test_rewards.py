"""Rule rewards: the built-in rules against hand-derived values, lookup by name and import path,
and errors that name the rule and what was expected; verl reward functions loaded from a file and
called as verl calls them, on prompt rows in verl's format."""

from __future__ import annotations

import math
import re
import sys
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
    return Sample(prompt_ids=[5], response_ids=[6], prompt_text="p", response_text=response,
                  finish_reason=finish_reason, extras=extras)  # fmt: skip


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
    cases = [(_sample(" 85", answer="85"), 1.0, 1.0), (_sample(" 7+8=15, 3+4+1=8 #### 85", answer="85"), 1.0, 1.0),
             (_sample(" 84", answer="85"), 0.0, 1.0), (_sample(" 85 86", answer="85"), 0.0, 0.0),
             (_sample("", answer="85"), 0.0, 0.0), (_sample(" 85", "length", answer="85"), 0.0, 0.0)]  # fmt: skip
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
        ("math:no_such_function", r"module 'math' has no callable 'no_such_function'"),
    ],
)
def test_bad_rule_names(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_rule(name)


@pytest.mark.parametrize("value", [math.nan, math.inf, "1.0", None])
def test_a_non_finite_or_non_numeric_score_is_an_error_naming_rule_and_sample(value) -> None:
    with pytest.raises(ValueError, match=r"reward rule 'bad' returned .* for sample 1 \(response 'two'\)"):
        rule_scores({"bad": lambda s: 0.0 if s.response_text == "one" else value}, [_sample("one"), _sample("two")])


def test_bool_scores_count_as_zero_and_one() -> None:
    assert rule_scores({"b": lambda s: s.response_text == "yes"}, [_sample("yes"), _sample("no")]) == {"b": [1.0, 0.0]}


# --------------------------------------------------------------------------- verl reward functions

# A reward file as verl users write them (modelled on verl's gsm8k scorer, written here): keyword
# arguments, a dataclass (needs its module in sys.modules), a dict result with a non-numeric key.
VERL_STYLE_FILE = '''
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
'''


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
    rows = [{"prompt": q, "data_source": "openai/gsm8k", "reward_model": {"style": "rule", "ground_truth": truth},
             "extra_info": {"split": "train", "index": index}} for index, (q, truth) in enumerate(problems)]
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


@pytest.mark.parametrize("value, expected", [
    (1, 1.0), (True, 1.0), (np.float32(0.25), 0.25), (np.int64(-2), -2.0), (np.bool_(True), 1.0),
    (torch.tensor(0.5), 0.5), (torch.tensor(3, dtype=torch.int32), 3.0), (np.array(0.75), 0.75),
])  # fmt: skip
def test_scores_may_be_python_numpy_or_0d_torch_numbers(tmp_path: Path, value, expected) -> None:
    function = CustomRewardFunction(lambda **kwargs: value, "f", tmp_path / "f.py")
    assert function.score([verl_sample("x")]).scores == [expected]
    function = CustomRewardFunction(lambda **kwargs: {"score": value, "m": value}, "f", tmp_path / "f.py")
    assert function.score([verl_sample("x")]) == CustomScores([expected], {"m": [expected]})


@pytest.mark.parametrize("value", [math.nan, -math.inf, np.float64("nan"), torch.tensor(math.inf), "1.0", None,
                                   torch.tensor([1.0]), np.array([0.5]), [1.0], 1 + 2j, np.complex64(1)])  # fmt: skip
def test_a_bad_score_names_function_file_and_sample(tmp_path: Path, value) -> None:
    path = tmp_path / "judge.py"
    function = CustomRewardFunction(lambda solution_str, **kwargs: 0.0 if solution_str == "one" else value, "judge",
                                    path)  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(f"custom reward function 'judge' ({path}) on sample 1 (data_source "
                                                   "'openai/gsm8k', response 'two') returned score ")
                       + ".*expected a finite number"):  # fmt: skip
        function.score([verl_sample("one"), verl_sample("two")])
    dict_function = CustomRewardFunction(lambda **kwargs: {"score": value}, "judge", tmp_path / "judge.py")
    with pytest.raises(ValueError, match="on sample 0 .* returned score .*expected a finite number"):
        dict_function.score([verl_sample("one")])


def test_a_dict_without_score(tmp_path: Path) -> None:
    function = CustomRewardFunction(lambda **kwargs: {"reward": 1.0, "acc": 1}, "f", tmp_path / "f.py")
    with pytest.raises(ValueError, match=r"sample 0 .* returned a dict without 'score' \(keys: \['acc', 'reward'\]\)"):
        function.score([verl_sample("x")])


def test_an_exception_names_function_file_sample_and_keeps_the_traceback(tmp_path: Path) -> None:
    path = write_reward_file(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                                       "    return float(solution_str) / float(ground_truth)\n")  # fmt: skip
    function = load_custom_function(path)
    assert function.score([verl_sample("3.5", ground_truth="7")]).scores == [0.5]
    with pytest.raises(RewardFunctionError) as info:
        function.score([verl_sample("1", ground_truth="7"), verl_sample("x", ground_truth="0")])
    message = str(info.value)
    assert message.startswith(f"custom reward function 'compute_score' ({path}) on sample 1 (data_source "
                              "'openai/gsm8k', response 'x') raised:\nTraceback (most recent call last):")
    assert f'File "{path}", line 2, in compute_score' in message
    assert message.rstrip().endswith("ValueError: could not convert string to float: 'x'")
    assert isinstance(info.value.__cause__, ValueError)


def test_samples_without_verl_columns(tmp_path: Path) -> None:
    function = load_custom_function(write_reward_file(tmp_path))
    with pytest.raises(ValueError, match=r"on sample 0 .*the prompt row has no \['data_source', 'ground_truth', "
                                         r"'extra_info'\]; a verl reward function needs the rows' data_source and "
                                         r"reward_model\.ground_truth columns"):  # fmt: skip
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
    with pytest.raises(ValueError, match=re.escape(f"scoring.custom_function.name='compute_scor': {path} has no "
                                                   "'compute_scor'; functions defined there: "
                                                   "['_parse', 'compute_score', 'plain']")):  # fmt: skip
        load_custom_function(path, name="compute_scor")
    with pytest.raises(ValueError, match=re.escape(f"{path} has a non-callable list 'CALLS'")):
        load_custom_function(path, name="CALLS")
    broken = write_reward_file(tmp_path, "import no_such_module_xyz\n", name="broken.py")
    with pytest.raises(ValueError, match=re.escape(f"scoring.custom_function.path='{broken}': importing {broken} "
                                                   "failed:") + r"(.|\n)*ModuleNotFoundError: No module named "
                                                                "'no_such_module_xyz'"):  # fmt: skip
        load_custom_function(broken)
    coroutine = write_reward_file(tmp_path, "async def compute_score(**kwargs):\n    return 1.0\n", name="aio.py")
    with pytest.raises(ValueError, match="compute_score in .*aio.py is async; give a plain function"):
        load_custom_function(coroutine)


def test_custom_function_config_defaults() -> None:
    assert CustomFunctionConfig() == CustomFunctionConfig(path="", name="compute_score")


def test_rules_accept_numpy_and_0d_torch_scores() -> None:
    rules = {"np": lambda s: np.float32(0.5), "t": lambda s: torch.tensor(2)}
    assert rule_scores(rules, [_sample("a")]) == {"np": [0.5], "t": [2.0]}
