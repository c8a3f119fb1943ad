"""Rule rewards: plain functions of one sample, looked up by name or imported by path.

A rule takes a ``Sample`` (ids, decoded text, finish reason, the prompt row's extra columns) and
returns a float. ``scoring.rules`` lists names registered in ``REWARD_RULES`` or import paths
``package.module:function`` to the user's own; the trainer sums every rule's score (and the reward
model's, when used) into the sequence reward. The texts are decoded with special tokens skipped, as
verl decodes what its reward functions read.

A rule is checked where it is named (it imports, and takes one sample) and called through
``RewardCalls`` (``calls.py``): whatever it raises, or a score that is no finite float32, is an error
naming the rule, its file and the sample.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from megatron_rlhf.algorithms.registry import Registry
from megatron_rlhf.config.fields import did_you_mean
from megatron_rlhf.rollout.engine import TrajectoryRecord
from megatron_rlhf.tasks.arithmetic import Verdict, judge

from .calls import RewardCalls, RewardFunctionError, Where, formatted, origin, users_own

SCORE_DTYPE = torch.float32
"""The dtype scores are gathered and summed into rewards in: a score must be finite in it."""
_SCORE_MAX = torch.finfo(SCORE_DTYPE).max


@dataclasses.dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    prompt_text: str
    response_text: str
    """A multi-turn response's text is the whole trajectory's: the policy's turns and the tools'
    results between them."""
    finish_reason: str
    """stop (EOS or a stop token ended it) or length (cut at max_new_tokens)."""
    extras: dict[str, Any]
    """The prompt row's columns named in ``data.extra_keys`` (e.g. a reference answer) and, for a row
    in verl's format, ``data_source``, ``ground_truth`` and ``extra_info``."""
    trajectory: TrajectoryRecord | None = None
    """A multi-turn response's record (turns, tool calls, tool rewards); None for a single turn."""


RewardRule = Callable[[Sample], float]
REWARD_RULES: Registry[RewardRule] = Registry("reward rule")


@REWARD_RULES.register("exact_answer")
def exact_answer(sample: Sample) -> float:
    """1 if the response, stripped, equals the row's ``answer`` column (stripped), else 0."""
    if "answer" not in sample.extras:
        raise ValueError(
            "reward rule 'exact_answer' needs the prompt rows' 'answer' column: add data.extra_keys=[answer]"
        )
    return float(sample.response_text.strip() == str(sample.extras["answer"]).strip())


def _arithmetic_verdict(sample: Sample, rule: str) -> Verdict:
    if "answer" not in sample.extras:
        raise ValueError(f"reward rule {rule!r} needs the prompt rows' 'answer' column: add data.extra_keys=[answer]")
    return judge(sample.response_text, sample.extras["answer"], finished=sample.finish_reason == "stop")


@REWARD_RULES.register("arithmetic_answer")
def arithmetic_answer(sample: Sample) -> float:
    """The arithmetic task (``tasks/arithmetic.py``): 1 if the response is well formed, ended with
    EOS and its final answer equals the row's ``answer``, else 0; its batch mean is the accuracy."""
    return float(_arithmetic_verdict(sample, "arithmetic_answer") == "right")


@REWARD_RULES.register("arithmetic_format")
def arithmetic_format(sample: Sample) -> float:
    """The arithmetic task's format check: 1 if the response is well formed and ended with EOS,
    right or wrong, else 0. Add it to ``arithmetic_answer`` to reward the format on its own."""
    return float(_arithmetic_verdict(sample, "arithmetic_format") != "malformed")


@REWARD_RULES.register("lowercase_fraction")
def lowercase_fraction(sample: Sample) -> float:
    """Share of the response's characters that are ASCII lowercase letters (0 for an empty one).
    A dense, learnable signal for the built-in demo run with random tiny models."""
    text = sample.response_text
    return sum("a" <= c <= "z" for c in text) / len(text) if text else 0.0


def resolve_rule(name: str) -> RewardRule:
    """A registered rule, or ``package.module:function``; errors name the rule and what was expected:
    a module that does not import (with its traceback when the module itself failed), no such
    function, or one that cannot be called with one sample."""
    if ":" not in name:
        return REWARD_RULES.get(name)
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward rule {name!r}: cannot import module {module_name!r} ({err})") from err
    except BaseException as err:  # a SyntaxError, or whatever its top level raises (sys.exit included)
        if not users_own(err):
            raise
        raise ValueError(f"reward rule {name!r}: importing module {module_name!r} failed:\n{formatted(err)}") from err
    rule = getattr(module, attribute, None)
    if not callable(rule):
        functions = [key for key, value in vars(module).items() if callable(value) and not isinstance(value, type)]
        raise ValueError(
            f"reward rule {name!r}: module {module_name!r} has no callable {attribute!r}"
            f"{did_you_mean(attribute, functions)}"
        )
    try:
        signature = inspect.signature(rule)
    except (TypeError, ValueError):  # some builtins have none: nothing to check
        return rule
    try:
        signature.bind(None)
    except TypeError as err:
        raise ValueError(
            f"reward rule {name!r}: {attribute}{signature} ({origin(rule)}) cannot be called as a rule "
            f"is, {attribute}(sample) -> float ({err})"
        ) from err
    return rule


def on_sample(what: str, row: int, sample: Sample) -> str:
    """``what`` (a function and its file) on a sample, for messages: its row, data_source, response."""
    source = f"data_source {sample.extras['data_source']!r}, " if "data_source" in sample.extras else ""
    return f"{what} on sample {row} ({source}response {sample.response_text[:60]!r})"


def as_number(value: Any) -> float | None:
    """``value`` as a float if it is one finite real number (Python, numpy, or a 0-d tensor or array;
    a bool counts as 0 / 1), else None: reward code returns all of these."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim != 0:
            return None
        value = value.item()
    if not isinstance(value, (numbers.Real, np.bool_)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def score_of(value: Any, where: Where) -> float:
    """``value`` as a score: one real number, finite in ``SCORE_DTYPE`` (1e300 is a finite float64 but
    inf in float32); else a ``RewardFunctionError`` naming the call (``where``) and the value."""
    number = as_number(value)
    if number is None:
        raise RewardFunctionError(f"{where()} returned score {value!r}: expected a finite number")
    if abs(number) > _SCORE_MAX:
        raise RewardFunctionError(
            f"{where()} returned score {value!r}: outside the range of float32 (|score| <= "
            f"{_SCORE_MAX:.4g}), the dtype the scores are summed into rewards in"
        )
    return number


def rule_scores(
    rules: dict[str, RewardRule],
    samples: Sequence[Sample],
    calls: RewardCalls | None = None,
    rows: Sequence[int] | None = None,
) -> dict[str, list[float]]:
    """Each rule's score for each sample, called through ``calls`` (the scorer's, with its timeout;
    by default one without); ``rows[i]`` is sample i's row in the rollout (default: i), for messages.
    Whatever a rule raises and a score that is no finite number are errors naming the rule and the
    sample, never a silent NaN in the advantages."""
    calls = calls if calls is not None else RewardCalls()
    rows = rows if rows is not None else range(len(samples))
    scores: dict[str, list[float]] = {}
    for name, rule in rules.items():
        what = f"reward rule {name!r} ({origin(rule)})"
        column = []
        for row, sample in zip(rows, samples, strict=True):
            where = functools.partial(on_sample, what, row, sample)
            column.append(score_of(calls(where, rule, sample), where))
        scores[name] = column
    return scores
