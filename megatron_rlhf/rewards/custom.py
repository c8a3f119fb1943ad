"""verl reward functions, unchanged: ``compute_score`` from a Python file, called as verl calls it.

verl loads ``custom_reward_function.path`` / ``.name`` from a file, and its reward manager calls it
once per response with keywords: ``compute_score(data_source=..., solution_str=..., ground_truth=...,
extra_info=...)``, i.e. the prompt row's ``data_source``, the decoded response, the row's
``reward_model.ground_truth`` and its ``extra_info``. It returns a number, or a dict whose ``score``
is the reward and whose other keys are logged. The same file works here as is: the prompt loader
keeps those row fields with each prompt (``Sample.extras``), and ``scoring.custom_function.path`` /
``.name`` (``CustomFunctionConfig``) name the file and the function.

The response is decoded with special tokens skipped, as verl's reward manager decodes it. A
multi-turn response is the whole trajectory (the policy's turns and the tools' results), and its
``extra_info`` gets what verl's reward manager adds to a multi-turn sample's: ``num_turns`` and
``rollout_reward_scores`` (each tool's ``calc_reward``, by tool name); and ``turn_scores``, the
scores an interaction gave its replies.

Stricter than verl on purpose: the function's signature is checked when it is loaded (a function
that cannot take those four keywords, e.g. verl's own ``gsm8k.compute_score(solution_str,
ground_truth, ...)``, is refused at start-up, not at step 1); a score must be one number finite in
float32 (Python, numpy, or a 0-d torch tensor), never a NaN or a string carried into the advantages;
whatever the function raises (``SystemExit`` included) or a call past ``scoring.timeout_s`` is an
error naming it, its file and the sample (``calls.py``). Other keys that are numbers become
metrics, averaged over the samples that return them; the rest (e.g. a predicted answer string)
are not metrics and are left out.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .calls import RewardCalls, RewardFunctionError, formatted, users_own
from .rules import Sample, as_number, on_sample, score_of

__all__ = [
    "CustomFunctionConfig",
    "CustomRewardFunction",
    "CustomScores",
    "RewardFunctionError",
    "load_custom_function",
    "metric_means",
]

_VERL_INPUTS = ("data_source", "ground_truth", "extra_info")  # the prompt loader's names for them
_VERL_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")  # how verl's reward manager calls it


@dataclasses.dataclass(kw_only=True)
class CustomFunctionConfig:
    path: str = ""
    """Python file defining a verl-style reward function (empty: none); the file runs on every rank."""
    name: str = "compute_score"
    """The function in that file, called as name(data_source=, solution_str=, ground_truth=, extra_info=)."""


@dataclasses.dataclass(frozen=True)
class CustomScores:
    """What a reward function gave for a list of samples."""

    scores: list[float]
    """The reward of each sample, in order."""
    metrics: dict[str, list[float]]
    """Each other numeric key of the returned dicts, with the values of the samples that returned it."""


def metric_means(parts: Sequence[CustomScores]) -> dict[str, float]:
    """Each metric averaged over every sample of ``parts`` that returned it (e.g. one part per rank)."""
    pooled: dict[str, list[float]] = {}
    for part in parts:
        for key, values in part.metrics.items():
            pooled.setdefault(key, []).extend(values)
    return {key: sum(values) / len(values) for key, values in pooled.items()}


def _extra_info(sample: Sample) -> dict[str, Any]:
    """The ``extra_info`` a call gets: a copy of the row's (the function may edit it, as verl's
    does), with a multi-turn trajectory's additions under verl's names."""
    extra_info = copy.deepcopy(sample.extras["extra_info"])
    if sample.trajectory is not None:
        extra_info["num_turns"] = sample.trajectory["num_turns"]
        extra_info["rollout_reward_scores"] = dict(sample.trajectory["tool_rewards"])
        extra_info["turn_scores"] = list(sample.trajectory["turn_scores"])
    return extra_info


class CustomRewardFunction:
    """A loaded reward function; ``score`` calls it on each sample the way verl's reward manager does."""

    def __init__(self, function: Callable[..., Any], name: str, path: Path) -> None:
        self.function, self.name, self.path = function, name, path

    def score(
        self, samples: Sequence[Sample], calls: RewardCalls | None = None, rows: Sequence[int] | None = None
    ) -> CustomScores:
        """The function on each sample, called through ``calls`` (the scorer's, with its timeout; by
        default one without); ``rows[i]`` is sample i's row in the rollout (default: i), for messages."""
        calls = calls if calls is not None else RewardCalls()
        rows = rows if rows is not None else range(len(samples))
        what = f"custom reward function {self.name!r} ({self.path})"
        scores: list[float] = []
        metrics: dict[str, list[float]] = {}
        for row, sample in zip(rows, samples, strict=True):
            where = functools.partial(on_sample, what, row, sample)
            missing = [key for key in _VERL_INPUTS if key not in sample.extras]
            if missing:
                raise ValueError(
                    f"{where()}: the prompt row has no {missing}; a verl reward "
                    "function needs the rows' data_source and reward_model.ground_truth columns "
                    "(verl's parquet format)"
                )
            result = calls(
                where,
                self.function,
                data_source=sample.extras["data_source"],
                solution_str=sample.response_text,
                ground_truth=sample.extras["ground_truth"],
                extra_info=_extra_info(sample),
            )
            if isinstance(result, dict):
                if "score" not in result:
                    raise RewardFunctionError(
                        f"{where()} returned a dict without 'score' (keys: {sorted(map(str, result))})"
                    )
                value, extra = result["score"], {k: v for k, v in result.items() if k != "score"}
            else:
                value, extra = result, {}
            scores.append(score_of(value, where))
            for key, raw in extra.items():
                number = as_number(raw)
                if number is not None:
                    metrics.setdefault(str(key), []).append(number)
        return CustomScores(scores, metrics)

    def __repr__(self) -> str:
        return f"CustomRewardFunction({self.name!r}, {str(self.path)!r})"


def load_custom_function(path: str | Path, name: str = "compute_score") -> CustomRewardFunction:
    """Import ``path`` as a module of its own and take its function ``name``; errors name the setting."""
    file = Path(path)
    setting = f"scoring.custom_function.path={str(path)!r}"
    if not file.is_file():
        raise ValueError(
            f"{setting}: {'is a directory' if file.is_dir() else 'no such file'} "
            "(expected a Python file defining the reward function)"
        )
    module_name = "_megatron_rlhf_reward_" + hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{setting}: cannot be imported (expected a .py file)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses (and pickle) look a class's module up there
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # whatever its top level raises, sys.exit included
        del sys.modules[module_name]
        if not users_own(exc):
            raise
        raise ValueError(f"{setting}: importing {file} failed:\n{formatted(exc)}") from exc
    function = getattr(module, name, None)
    if not callable(function):
        defined = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module_name)
        what = "no" if function is None else f"a non-callable {type(function).__name__}"
        raise ValueError(
            f"scoring.custom_function.name={name!r}: {file} has {what} {name!r}; functions defined there: {defined}"
        )
    if inspect.iscoroutinefunction(function):
        raise ValueError(f"scoring.custom_function.name={name!r}: {name} in {file} is async; give a plain function")
    _check_signature(function, name, file)
    return CustomRewardFunction(function, name, file)


def _check_signature(function: Callable[..., Any], name: str, file: Path) -> None:
    """Refuse, at start-up, a function that cannot be called as verl calls it (keywords; ``**kwargs``
    takes any): it would fail at the first step's scores."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some callables (builtins) have none: nothing to check
        return
    try:
        signature.bind(**dict.fromkeys(_VERL_KEYWORDS))
    except TypeError as err:
        expected = ", ".join(f"{key}=" for key in _VERL_KEYWORDS)
        raise ValueError(
            f"scoring.custom_function.name={name!r}: {name}{signature} in {file} cannot be called as "
            f"verl calls a reward function, {name}({expected}) ({err}); take those keywords (or "
            "**kwargs), e.g. def compute_score(data_source, solution_str, ground_truth, extra_info=None) "
            "calling yours"
        ) from err
