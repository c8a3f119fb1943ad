"""Rule rewards: plain functions of one sample, looked up by name or imported by path.

A rule takes a ``Sample`` (ids, decoded text, finish reason, the prompt row's extra columns) and
returns a float. ``reward.rules`` lists names registered in ``REWARD_RULES`` or import paths
``package.module:function`` to the user's own; the trainer sums every rule's score (and the reward
model's, when used) into the sequence reward.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from megatron_rlhf.algorithms.registry import Registry
from megatron_rlhf.tasks.arithmetic import Verdict, judge


@dataclasses.dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    prompt_text: str
    response_text: str
    finish_reason: str
    """stop (EOS or a stop token ended it) or length (cut at max_new_tokens)."""
    extras: dict[str, Any]
    """The prompt row's columns named in ``data.extra_keys`` (e.g. a reference answer) and, for a row
    in verl's format, ``data_source``, ``ground_truth`` and ``extra_info``."""


RewardRule = Callable[[Sample], float]
REWARD_RULES: Registry[RewardRule] = Registry("reward rule")


@REWARD_RULES.register("exact_answer")
def exact_answer(sample: Sample) -> float:
    """1 if the response, stripped, equals the row's ``answer`` column (stripped), else 0."""
    if "answer" not in sample.extras:
        raise ValueError("reward rule 'exact_answer' needs the prompt rows' 'answer' column: add data.extra_keys=[answer]")
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
    """A registered rule, or ``package.module:function``; errors name the rule and what was expected."""
    if ":" not in name:
        return REWARD_RULES.get(name)
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward rule {name!r}: cannot import module {module_name!r} ({err})") from err
    rule = getattr(module, attribute, None)
    if not callable(rule):
        raise ValueError(f"reward rule {name!r}: module {module_name!r} has no callable {attribute!r}")
    return rule


def as_score(value: Any) -> float | None:
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


def rule_scores(rules: dict[str, RewardRule], samples: Sequence[Sample]) -> dict[str, list[float]]:
    """Each rule's score for each sample; a non-finite or non-numeric score is an error naming the
    rule and the sample, never a silent NaN in the advantages."""
    scores: dict[str, list[float]] = {}
    for name, rule in rules.items():
        column = []
        for index, sample in enumerate(samples):
            value = rule(sample)
            score = as_score(value)
            if score is None:
                raise ValueError(f"reward rule {name!r} returned {value!r} for sample {index} "
                                 f"(response {sample.response_text[:60]!r}): expected a finite number")  # fmt: skip
            column.append(score)
        scores[name] = column
    return scores
