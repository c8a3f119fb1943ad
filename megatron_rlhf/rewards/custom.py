"""verl reward functions, unchanged: ``compute_score`` from a Python file, called as verl calls it.

verl loads ``custom_reward_function.path`` / ``.name`` from a file, and its reward manager calls it
once per response with keywords: ``compute_score(data_source=..., solution_str=..., ground_truth=...,
extra_info=...)``, i.e. the prompt row's ``data_source``, the decoded response, the row's
``reward_model.ground_truth`` and its ``extra_info``. It returns a number, or a dict whose ``score``
is the reward and whose other keys are logged. The same file works here as is: the prompt loader
keeps those row fields with each prompt (``Sample.extras``), and ``scoring.custom_function.path`` /
``.name`` (``CustomFunctionConfig``) name the file and the function.

Stricter than verl on purpose: a score must be one finite number (Python, numpy, or a 0-d torch
tensor), never a NaN or a string carried into the advantages. Other keys that are numbers become
metrics, averaged over the samples that return them; the rest (e.g. a predicted answer string)
are not metrics and are left out.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .rules import Sample, as_score

__all__ = ["CustomFunctionConfig", "CustomRewardFunction", "CustomScores", "RewardFunctionError",
           "load_custom_function", "metric_means"]  # fmt: skip

_VERL_INPUTS = ("data_source", "ground_truth", "extra_info")  # the prompt loader's names for them


@dataclasses.dataclass(kw_only=True)
class CustomFunctionConfig:
    path: str = ""
    """Python file defining a verl-style reward function (empty: none); the file runs on every rank."""
    name: str = "compute_score"
    """The function in that file, called as name(data_source=, solution_str=, ground_truth=, extra_info=)."""


class RewardFunctionError(RuntimeError):
    """The user's reward function raised; the message names it, its file, the sample, and the traceback."""


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


class CustomRewardFunction:
    """A loaded reward function; ``score`` calls it on each sample the way verl's reward manager does."""

    def __init__(self, function: Callable[..., Any], name: str, path: Path) -> None:
        self.function, self.name, self.path = function, name, path

    def _where(self, index: int, sample: Sample) -> str:
        return (f"custom reward function {self.name!r} ({self.path}) on sample {index} (data_source "
                f"{sample.extras.get('data_source')!r}, response {sample.response_text[:60]!r})")  # fmt: skip

    def score(self, samples: Sequence[Sample]) -> CustomScores:
        scores: list[float] = []
        metrics: dict[str, list[float]] = {}
        for index, sample in enumerate(samples):
            missing = [key for key in _VERL_INPUTS if key not in sample.extras]
            if missing:
                raise ValueError(f"{self._where(index, sample)}: the prompt row has no {missing}; a verl reward "
                                 "function needs the rows' data_source and reward_model.ground_truth columns "
                                 "(verl's parquet format)")  # fmt: skip
            try:
                result = self.function(
                    data_source=sample.extras["data_source"],
                    solution_str=sample.response_text,
                    ground_truth=sample.extras["ground_truth"],
                    extra_info=copy.deepcopy(sample.extras["extra_info"]),  # the function may edit it, as verl's does
                )
            except Exception as exc:
                trace = "".join(traceback.format_exception(exc))
                raise RewardFunctionError(f"{self._where(index, sample)} raised:\n{trace}") from exc
            if isinstance(result, dict):
                if "score" not in result:
                    raise ValueError(f"{self._where(index, sample)} returned a dict without 'score' "
                                     f"(keys: {sorted(map(str, result))})")  # fmt: skip
                value, extra = result["score"], {k: v for k, v in result.items() if k != "score"}
            else:
                value, extra = result, {}
            score = as_score(value)
            if score is None:
                raise ValueError(f"{self._where(index, sample)} returned score {value!r}: expected a finite number")
            scores.append(score)
            for key, raw in extra.items():
                number = as_score(raw)
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
        raise ValueError(f"{setting}: {'is a directory' if file.is_dir() else 'no such file'} "
                         "(expected a Python file defining the reward function)")  # fmt: skip
    module_name = "_megatron_rlhf_reward_" + hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{setting}: cannot be imported (expected a .py file)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses (and pickle) look a class's module up there
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ValueError(f"{setting}: importing {file} failed:\n{''.join(traceback.format_exception(exc))}") from exc
    function = getattr(module, name, None)
    if not callable(function):
        defined = sorted(k for k, v in vars(module).items()
                         if inspect.isfunction(v) and v.__module__ == module_name)  # fmt: skip
        what = "no" if function is None else f"a non-callable {type(function).__name__}"
        raise ValueError(f"scoring.custom_function.name={name!r}: {file} has {what} {name!r}; "
                         f"functions defined there: {defined}")  # fmt: skip
    if inspect.iscoroutinefunction(function):
        raise ValueError(f"scoring.custom_function.name={name!r}: {name} in {file} is async; give a plain function")
    return CustomRewardFunction(function, name, file)
