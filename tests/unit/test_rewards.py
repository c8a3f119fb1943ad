"""Rule rewards: the built-in rules against hand-derived values, lookup by name and import path,
and errors that name the rule and what was expected."""

from __future__ import annotations

import math
import sys
import types

import pytest

from megatron_rlhf.rewards import Sample, resolve_rule, rule_scores


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
