"""Settings shared by every trainer's data: which files, which column holds the prompt, and what to
do with a row that is too long or holds a bad value (the loaders in ``datasets.py`` apply them)."""

from __future__ import annotations

import dataclasses

from megatron_rlhf.config.fields import at_least
from megatron_rlhf.data.datasets import OnProblem


@dataclasses.dataclass(kw_only=True)
class DataFilesConfig:
    train: list[str] = dataclasses.field(default_factory=list)
    """Training data: .jsonl / .parquet files or directories of them (e.g. data.train=[a.jsonl])."""
    prompt_key: str = "prompt"
    """Column of the prompt text (or pre-tokenized ``<key>_ids``)."""
    on_overlong: OnProblem = "error"
    """error: stop naming the file and row; skip: drop such rows and count them in the data report."""
    on_invalid: OnProblem = "error"
    """The same for rows with a bad value (null, empty, wrong type, token id out of range)."""
    add_bos: bool = False
    """Prepend the tokenizer's BOS id to every sequence (for text that does not already hold it)."""
    num_workers: int = 0
    """Processes that read and tokenize the rows at start-up (0: this process); the datasets are the
    same either way. Each costs a Python start (~1.5 s of CPU: it imports torch) and every rank
    starts its own: for sets that take minutes to tokenize, with workers x ranks per node <= cores."""

    def errors(self) -> list[str]:
        return at_least(self, 0, "num_workers")
