"""Settings shared by every trainer's data: which files, which column holds the prompt, what to do
with a row that is too long or holds a bad value, and how conversations are rendered (the loaders
in ``datasets.py`` apply them)."""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_rlhf.config.fields import at_least, file_errors
from megatron_rlhf.data.chat_template import load_tool_schemas, template_variable_errors
from megatron_rlhf.data.datasets import OnProblem


@dataclasses.dataclass(kw_only=True)
class TrainFilesConfig:
    train: list[str] = dataclasses.field(default_factory=list)
    """Training data: .jsonl / .parquet files or directories of them (e.g. data.train=[a.jsonl])."""


@dataclasses.dataclass(kw_only=True)
class RowsConfig:
    """How a data file's rows are read: every command that reads prompts or examples (``generate``
    too)."""

    prompt_key: str = "prompt"
    """Column of the prompt text (or pre-tokenized ``<key>_ids``)."""
    on_invalid: OnProblem = "error"
    """error: stop naming the file, row and column; skip: drop rows with a bad value (null, empty, wrong
    type, token id out of range) or a missing column, and count them in the data report (with the
    first few rows' places)."""
    add_bos: bool | None = None
    """Whether prompts start with the tokenizer's BOS id (never twice). null: as transformers does it,
    text as ``tokenizer(text)`` encodes it (with the BOS for Llama's tokenizers, whose base models
    expect it), conversations as their chat template writes them, token ids as given; the run
    records what it resolved to. true: every prompt; false: none."""
    num_workers: int = 0
    """Processes that read and tokenize the rows at start-up (0: this process); the datasets are the
    same either way. Each costs a Python start (~1.5 s of CPU: it imports torch) and every rank
    starts its own: for sets that take minutes to tokenize, with workers x ranks per node <= cores."""

    def errors(self) -> list[str]:
        return at_least(self, 0, "num_workers")


@dataclasses.dataclass(kw_only=True)
class DataFilesConfig(RowsConfig, TrainFilesConfig):
    on_overlong: OnProblem = "error"
    """The same as on_invalid for rows longer than the trainer's length limit."""


@dataclasses.dataclass(kw_only=True)
class ChatOptionsConfig:
    """Rows that may be conversations (lists of {role, content} messages): how the model's chat
    template renders them."""

    apply_chat_template: bool = True
    """Render a conversation with the model's chat template (an RL prompt with the generation prompt
    appended); text and pre-tokenized columns are tokenized as they are."""
    chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """More variables for the chat template, as transformers' apply_chat_template(**kwargs) passes
    them (verl: data.apply_chat_template_kwargs), e.g. {enable_thinking: false} for Qwen3."""
    tools_file: str = ""
    """Tool schemas the chat template offers the model (its ``tools``): a YAML file in verl's
    tool_config_path format, of which only each tool's tool_schema is read (no tool runs); empty: none
    (in RL with rollout.multi_turn.enable: the agent's tools file, rollout.multi_turn.tool_config_path)."""
    tools_key: str = "tools"
    """Column of a row's own tool schemas (a list of OpenAI function schemas, or a JSON string of
    one): where present and not null they replace tools_file's for that row, not add to them; "": no
    such column."""

    def chat_errors(self) -> list[str]:
        return template_variable_errors("chat_template_kwargs", self.chat_template_kwargs) + file_errors(
            "tools_file", self.tools_file, load_tool_schemas
        )

    def chat_options(self, tools_file: str | None = None) -> dict[str, Any]:
        """These settings as the loaders' keyword arguments; ``tools_file`` replaces the setting's."""
        path = self.tools_file if tools_file is None else tools_file
        return {
            "apply_chat_template": self.apply_chat_template,
            "chat_template_kwargs": self.chat_template_kwargs,
            "tools": load_tool_schemas(path) if path else None,
            "tools_key": self.tools_key,
        }


@dataclasses.dataclass(kw_only=True)
class ChatDataConfig(ChatOptionsConfig, DataFilesConfig):
    """Training data whose rows may be conversations."""

    def errors(self) -> list[str]:
        return DataFilesConfig.errors(self) + self.chat_errors()


@dataclasses.dataclass(kw_only=True)
class PromptRowsConfig(ChatOptionsConfig, RowsConfig):
    """The prompts of a file read as the RL trainers read theirs (``generate``)."""

    def errors(self) -> list[str]:
        return RowsConfig.errors(self) + self.chat_errors()
