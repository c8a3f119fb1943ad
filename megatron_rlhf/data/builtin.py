"""Built-in data sets: ``builtin:NAME`` in a data path list, written as JSONL on first use; and
the up-front check of a data path list.

They let the default RL run, and the arithmetic task's SFT and RL runs, go with no download. Like
the built-in models they are ordinary files (under the cache directory) that go through the same
loader as a user's data.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megatron_rlhf.data.records import data_files, write_jsonl
from megatron_rlhf.models.builtin import PREFIX, cache_dir, is_builtin, made_once
from megatron_rlhf.tasks import arithmetic, arithmetic_tool


def _lowercase_prompts() -> list[dict[str, str]]:
    """256 short instructions; with the ``lowercase_fraction`` rule the policy learns to answer in
    lowercase letters, a reward a random tiny model can visibly climb within a few dozen steps."""
    rng = random.Random(0)
    words = ["apple", "river", "stone", "cloud", "maple", "ocean", "tiger", "lemon", "piano", "crane"]
    return [{"prompt": f"Say something about {rng.choice(words)} and {rng.choice(words)}:"} for _ in range(256)]


# The arithmetic task's level for the built-in pipeline (SFT -> RM -> RL): 2-digit + and -, SFT
# demonstrations with worked steps (the answer alone is far slower to learn from scratch). The RL
# prompts are train-split problems; the test prompts share no problem with any train row.
ARITHMETIC = arithmetic.ArithmeticSpec(ops=("+", "-"), digits=2, seed=0)
CARELESS_SLIP_RATE = 0.6
"""The careless teacher's ``arithmetic-sft-careless`` sets drop each carry or borrow this often:
more often than not, so a model that imitates them well drops carries when it decodes greedily
(about 40% of held-out answers wrong), yet samples the right step often enough for RL to find."""


def _arithmetic_sft(split: str, count: int, slip_rate: float = 0.0) -> Callable[[], list[dict[str, str]]]:
    return lambda: arithmetic.sft_rows(
        arithmetic.make_problems(ARITHMETIC, split, count), steps=True, slip_rate=slip_rate, seed=ARITHMETIC.seed
    )


def _arithmetic_prompts(split: str, count: int) -> Callable[[], list[dict[str, str]]]:
    return lambda: arithmetic.prompt_rows(arithmetic.make_problems(ARITHMETIC, split, count))


TOOL_RATE = 0.3
"""The tool task's teacher calls the calculator on this share of the problems (``arithmetic-tool-sft``
sets) and answers directly on the others: its SFT model calls the tool on about this share of its
samples but not when it decodes greedily, and gets the answers wrong without it, which leaves RL
the room of the calls it learns to make."""


def _tool_sft(split: str, count: int) -> Callable[[], list[dict[str, Any]]]:
    return lambda: arithmetic_tool.sft_rows(
        arithmetic_tool.problems(split, count), TOOL_RATE, arithmetic_tool.TASK.seed
    )


def _tool_prompts(split: str, count: int) -> Callable[[], list[dict[str, Any]]]:
    return lambda: arithmetic_tool.prompt_rows(arithmetic_tool.problems(split, count))


BUILTIN_DATASETS: dict[str, Callable[[], Sequence[dict[str, Any]]]] = {
    "lowercase-prompts": _lowercase_prompts,
    "arithmetic-sft": _arithmetic_sft("train", 8000),
    "arithmetic-sft-validation": _arithmetic_sft("validation", 500),
    "arithmetic-sft-careless": _arithmetic_sft("train", 8000, CARELESS_SLIP_RATE),
    "arithmetic-sft-careless-validation": _arithmetic_sft("validation", 500, CARELESS_SLIP_RATE),
    "arithmetic-prompts": _arithmetic_prompts("train", 8000),
    "arithmetic-validation": _arithmetic_prompts("validation", 500),
    "arithmetic-test": _arithmetic_prompts("test", 500),
    "arithmetic-tool-sft": _tool_sft("train", 8000),
    "arithmetic-tool-sft-validation": _tool_sft("validation", 500),
    "arithmetic-tool-prompts": _tool_prompts("train", 8000),
    "arithmetic-tool-validation": _tool_prompts("validation", 500),
    "arithmetic-tool-test": _tool_prompts("test", 500),
}

REVISIONS = {"arithmetic-tool-sft": 2, "arithmetic-tool-sft-validation": 2}
"""A set's revision where it is not 1: raised when its rows change, so that a file an earlier
revision cached is never read for it (revision 2: the tool task's SFT rows became conversations)."""


def _builtin_name(path: str) -> str:
    name = path[len(PREFIX) :]
    if name not in BUILTIN_DATASETS:
        raise ValueError(f"unknown built-in dataset {path!r}; available: {[PREFIX + n for n in BUILTIN_DATASETS]}")
    return name


def resolve_data_paths(paths: Sequence[str]) -> list[str]:
    """``paths`` with each ``builtin:NAME`` replaced by its JSONL file (written by rank 0 on first
    use; collective when any path is built-in)."""
    return [str(_builtin_file(_builtin_name(path))) if is_builtin(path) else path for path in paths]


def _builtin_file(name: str) -> Path:
    rows = BUILTIN_DATASETS[name]
    revision = REVISIONS.get(name, 1)
    return made_once(cache_dir() / "builtin-data" / f"{name}-v{revision}.jsonl", lambda t: write_jsonl(rows(), t))


def data_path_errors(key: str, paths: Sequence[str]) -> list[str]:
    """Why the data paths of setting ``key`` cannot be read (missing, not a data file, unreadable,
    an unknown built-in set), for a command's up-front checks: a run with a wrong path stops
    before it writes or builds anything, not when its data is loaded."""
    errors = []
    for path in paths:
        try:
            if is_builtin(path):
                _builtin_name(path)
                continue
            for file in data_files(path):
                file.open("rb").close()
        except (OSError, ValueError) as err:  # DataError is a ValueError
            errors.append(f"{key}: {err}")
    return errors


def data_overlap_warnings(train: Sequence[str], validation: Sequence[str]) -> list[str]:
    """A file read twice by ``data.train`` (its rows trained on twice an epoch: meant where a set is
    repeated to weigh it, but often a slip) or read by both settings (validation would measure
    training data): lines for the log."""

    def files(paths: Sequence[str]) -> list[str]:
        return [
            name
            for path in paths
            for name in ([path] if is_builtin(path) else [str(file.resolve()) for file in data_files(path)])
        ]

    reads = Counter(files(train))
    lines = [
        f"warning: data.train reads {file} {count} times: its rows are trained on as often each epoch"
        for file, count in sorted(reads.items())
        if count > 1
    ]
    return lines + [
        f"warning: data.validation reads {file}, which data.train reads: it measures training data"
        for file in sorted(set(files(validation)) & reads.keys())
    ]
