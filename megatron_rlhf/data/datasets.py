"""SFT, preference and prompt datasets: rows -> token ids, validated, with a report of every skip.

Shape legend: L = tokens of one sequence (prompt + response, + EOS), P = prompt tokens.

A row gives each field as text (``prompt``) tokenized here, or, when the text column is absent,
as pre-tokenized ids (``prompt_ids``: a list of ints). Text wins when both are there. An RL prompt
may also be a conversation, a list of ``{role, content}`` messages (verl's ``prompt`` column): with
``apply_chat_template`` (the default) it is rendered with the tokenizer's chat template, generation
prompt appended, exactly as transformers' ``apply_chat_template(messages, tools=...,
add_generation_prompt=True, **chat_template_kwargs)`` renders and tokenizes it. The template's
``tools`` are the row's own (its ``tools_key`` column: a list of OpenAI function schemas, or a JSON
string of one, as some datasets store it) or else the loader's ``tools`` (a tools file's schemas).

  SFT         input_ids = [BOS] + prompt + response [+ EOS]; loss_mask 0 on BOS and the prompt,
              1 on the response and EOS (the tokens the model is trained to produce). Or a
              conversation (``messages_key``, verl's multi-turn SFT rows), rendered with the chat
              template: loss_mask 1 on each assistant message from after its generation prompt
              through its stop token (``Tokenizer.stop_ids``), 0 on everything else (system, user
              and tool messages, the template's markup): the tokens a multi-turn rollout samples.
  preference  chosen and rejected each as above, sharing the prompt; or each a conversation (the
              whole of it, or the continuation of a conversation prompt), masked as an SFT
              conversation and ending at its last assistant message's stop token.
  prompt      [BOS] + prompt, for RL rollouts; ``extra_keys`` columns are kept verbatim (e.g. the
              reference answer a rule-based reward checks against); a row in verl's format (with
              a ``reward_model`` column) also gives ``data_source``, ``ground_truth`` and
              ``extra_info``, the inputs of a verl reward function, and the multi-turn inputs
              verl's tool datasets keep in ``extra_info``: ``tools_kwargs``, ``need_tools_kwargs``
              and ``interaction_kwargs``.

[BOS] is there as ``add_bos`` says. None (the default) does what transformers does: a text prompt
gets it where ``tokenizer(text)`` adds it (``Tokenizer.adds_bos``: Llama's tokenizers do); a
conversation has what its chat template writes (``apply_chat_template`` adds nothing); token ids are
taken as given. True prepends it to every prompt, False to none. It is never doubled: a prompt that
starts with it (chat templates often write it) keeps one. EOS is appended unless the response
already ends with it (chat-templated text often does).

Problems never pass silently. A column missing from a row is always an error (a wrong key or a
wrong file, not a bad row). A bad value (None, empty, wrong type, token id out of range) and an
over-long sequence (more than ``max_length`` tokens; the message names the trainer setting,
``data.max_length`` or ``data.max_prompt_length``) either raise ``DataError`` naming file, row and
column (``on_invalid`` / ``on_overlong`` = "error", the default) or are skipped and counted in the
returned ``DataReport`` ("skip"). The loaders log nothing; callers print ``report.summary()``.

Examples are kept in flat int32 storage (about 5 bytes per token, against ~36 for Python int
lists), so that million-row SFT sets fit in host memory; ``dataset[i]`` returns tensor views.

``num_workers`` (``data.num_workers``) > 0 reads and tokenizes in that many worker processes: the
files are cut into spans of consecutive rows (``records.split_files``; about four per worker),
each worker runs the same row code over its spans into flat storage, and the spans are appended in
order. Rows keep their file and row numbers, so datasets, skip reports and error messages are those
of one process; a worker's error is raised when its span's turn comes, so the first error in row
order wins. Workers are spawned, not forked (a fork of a process running torch's threads or CUDA
can hang), and get the loader pickled, tokenizer included (a chat template is compiled again).

Data is read once, at start-up; nothing is loaded per step. A step's batch is the sampler's indices
(a function of seed, epoch and step: a run's data position is its step) into this storage, padded
by ``pack_batch``: milliseconds of host work against seconds of GPU work (docs/benchmarks.md, "Data
loading"). So there is no DataLoader-style per-step prefetching
(``prefetch_factor``, ``persistent_workers``): there is no per-step loading for it to overlap.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import hashlib
import json
import multiprocessing
import pickle
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol, get_args, overload

import numpy as np
import torch
from torch import Tensor

from .chat_template import ChatTemplate, ChatTemplateError, template_variable_errors, tool_schema_problem
from .records import DataError, Record, Span, data_files, read_records, read_span, split_files
from .tokenizer import CHAT_TEMPLATE_FILE, Tokenizer, template_turn_end

__all__ = [
    "RAW_PROMPT",
    "DataReport",
    "OnProblem",
    "PreferenceDataset",
    "PreferenceExample",
    "PromptDataset",
    "PromptExample",
    "SFTDataset",
    "SFTExample",
    "SkippedRow",
    "content_digest",
    "load_preference_dataset",
    "load_prompt_dataset",
    "load_sft_dataset",
]

OnProblem = Literal["error", "skip"]

# Skip reasons, the keys of DataReport.skipped.
OVERLONG = "overlong"
EMPTY = "empty"
WRONG_TYPE = "wrong_type"
BAD_TOKEN = "token_out_of_range"
TEMPLATE_FAILED = "chat_template_failed"
IDENTICAL_PAIR = "identical_pair"
MISMATCHED_PAIR = "mismatched_pair"
MISSING_COLUMN = "missing_column"
MAX_SAMPLES = 5  # skipped rows remembered per reason


# --------------------------------------------------------------------------- examples


def _as_1d(name: str, value: Any, dtype: torch.dtype | None = None) -> Tensor:
    t = torch.as_tensor(value, dtype=dtype)
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence, got shape {tuple(t.shape)}")
    return t


@dataclasses.dataclass(frozen=True, eq=False)
class SFTExample:
    """One training sequence. input_ids (L,) int; loss_mask (L,) bool, True on trained tokens."""

    input_ids: Tensor
    loss_mask: Tensor

    def __post_init__(self) -> None:
        ids = _as_1d("input_ids", self.input_ids)
        mask = _as_1d("loss_mask", self.loss_mask).bool()
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integers, got {ids.dtype}")
        if mask.shape != ids.shape:
            raise ValueError(f"loss_mask shape {tuple(mask.shape)} != input_ids shape {tuple(ids.shape)}")
        object.__setattr__(self, "input_ids", ids)
        object.__setattr__(self, "loss_mask", mask)

    def __len__(self) -> int:
        return self.input_ids.numel()


@dataclasses.dataclass(frozen=True, eq=False)
class PreferenceExample:
    """A prompt with two responses; each side is an SFTExample (prompt + response [+ EOS])."""

    chosen: SFTExample
    rejected: SFTExample


@dataclasses.dataclass(frozen=True, eq=False)
class PromptExample:
    """An RL prompt. prompt_ids (P,) int; extras: the requested extra columns, verbatim, and verl's
    reward inputs ``data_source``, ``ground_truth``, ``extra_info`` and its multi-turn inputs
    ``tools_kwargs``, ``need_tools_kwargs``, ``interaction_kwargs`` when the row is in verl's format."""

    prompt_ids: Tensor
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", _as_1d("prompt_ids", self.prompt_ids))

    def __len__(self) -> int:
        return self.prompt_ids.numel()


# --------------------------------------------------------------------------- storage


class _TokenStore:
    """Append-only flat storage of variable-length sequences (ids int32, optional bool mask)."""

    def __init__(self, with_mask: bool) -> None:
        self._ids = array("i")
        self._mask = array("b") if with_mask else None
        self._offsets = array("q", [0])

    def append(self, ids: list[int], mask: list[int] | None = None) -> None:
        # fromlist, not extend: half the time per token, a third of a loader's time with byte tokens.
        self._ids.fromlist(ids)
        if self._mask is not None:
            assert mask is not None, "a store that keeps loss masks is given one with every sequence"
            self._mask.fromlist(mask)
        self._offsets.append(len(self._ids))

    def extend(self, other: _TokenStore) -> None:
        """Append every sequence of ``other`` (a worker's share, which follows these rows)."""
        base = len(self._ids)
        self._ids.extend(other._ids)
        if self._mask is not None:
            assert other._mask is not None, "stores of one kind keep masks alike"
            self._mask.extend(other._mask)
        self._offsets.frombytes((np.frombuffer(other._offsets, dtype=np.int64)[1:] + base).tobytes())

    def freeze(self) -> tuple[Tensor, Tensor | None, Tensor]:
        ids = torch.from_numpy(np.frombuffer(self._ids, dtype=np.int32))
        mask = None if self._mask is None else torch.from_numpy(np.frombuffer(self._mask, dtype=np.bool_))
        return ids, mask, torch.from_numpy(np.frombuffer(self._offsets, dtype=np.int64))


class _Sequences:
    """Read side of a _TokenStore: sequence i is ids[offsets[i]:offsets[i+1]]."""

    def __init__(self, store: _TokenStore) -> None:
        self.ids, self.mask, self.offsets = store.freeze()

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def span(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def example(self, i: int) -> SFTExample:
        """Sequence i with its loss mask (the stores of SFT and preference sides keep one)."""
        assert self.mask is not None, "only a store that keeps loss masks makes training examples"
        s = self.span(i)
        return SFTExample(self.ids[s], self.mask[s])

    def lengths(self) -> Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def digest(self, into: Any) -> None:
        """Feed the sequences' ids, boundaries and masks to the hash ``into``."""
        for part in (self.ids, self.offsets, self.mask):
            if part is not None:
                into.update(part.numpy().tobytes())


class Digestible(Protocol):
    """A dataset whose content ``content_digest`` fingerprints."""

    def __len__(self) -> int: ...

    def digest(self, into: Any) -> None:
        """Feed what the examples hold to the hash ``into``."""
        ...


def content_digest(dataset: Digestible) -> str:
    """A fingerprint of the examples a step's data position selects (their token ids and loss masks),
    not of the files they were read from: a resume compares it, so that data changed under the same
    file name is found, and the same data under another name (a copy on a node's own disk) continues.
    A prompt's reward inputs are not in it (``extra_keys`` may change on resume)."""
    digest = hashlib.blake2b(digest_size=16)
    dataset.digest(digest)
    return digest.hexdigest()


def _index(i: int, n: int) -> int:
    if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
        raise TypeError(f"dataset index must be an int, got {type(i).__name__}")
    j = int(i) + n if i < 0 else int(i)
    if not 0 <= j < n:
        raise IndexError(f"dataset index {i} out of range for {n} examples")
    return j


class _Examples[E](Sequence[E]):
    """The indexing the datasets share: an int (negative from the end) gives one example, a slice
    a list of them."""

    @overload
    def __getitem__(self, i: int) -> E: ...

    @overload
    def __getitem__(self, i: slice) -> list[E]: ...

    def __getitem__(self, i: int | slice) -> E | list[E]:
        if isinstance(i, slice):
            return [self._example(j) for j in range(*i.indices(len(self)))]
        return self._example(_index(i, len(self)))

    @abc.abstractmethod
    def _example(self, j: int) -> E:
        """Example ``j``, in range."""


class SFTDataset(_Examples[SFTExample]):
    """Read-only SFT examples; ``lengths`` (N,) gives every sequence's L without building it."""

    def __init__(self, store: _TokenStore) -> None:
        self._seq = _Sequences(store)

    def __len__(self) -> int:
        return len(self._seq)

    def _example(self, j: int) -> SFTExample:
        return self._seq.example(j)

    @property
    def lengths(self) -> Tensor:
        return self._seq.lengths()

    def digest(self, into: Any) -> None:
        self._seq.digest(into)


class PreferenceDataset(_Examples[PreferenceExample]):
    """Read-only preference pairs; ``lengths`` (N, 2) gives (chosen L, rejected L)."""

    def __init__(self, chosen: _TokenStore, rejected: _TokenStore) -> None:
        self._chosen, self._rejected = _Sequences(chosen), _Sequences(rejected)

    def __len__(self) -> int:
        return len(self._chosen)

    def _example(self, j: int) -> PreferenceExample:
        return PreferenceExample(chosen=self._chosen.example(j), rejected=self._rejected.example(j))

    @property
    def lengths(self) -> Tensor:
        return torch.stack([self._chosen.lengths(), self._rejected.lengths()], dim=1)

    def digest(self, into: Any) -> None:
        self._chosen.digest(into)
        self._rejected.digest(into)


class PromptDataset(_Examples[PromptExample]):
    """Read-only RL prompts; ``lengths`` (N,) gives every prompt's P."""

    def __init__(self, store: _TokenStore, extras: list[dict[str, Any]], rows: list[int]) -> None:
        self._seq, self._extras, self._rows = _Sequences(store), extras, rows

    def __len__(self) -> int:
        return len(self._seq)

    def _example(self, j: int) -> PromptExample:
        return PromptExample(self._seq.ids[self._seq.span(j)], dict(self._extras[j]))

    @property
    def extras(self) -> Sequence[Mapping[str, Any]]:
        """Every prompt's extras, in order, without building the examples (not to be modified)."""
        return self._extras

    @property
    def rows(self) -> Sequence[int]:
        """Every prompt's row in the files read: its 0-based place among their rows, skipped rows
        counted (``on_invalid=skip``, ``on_overlong=drop``), so that it names the input row."""
        return self._rows

    @property
    def lengths(self) -> Tensor:
        return self._seq.lengths()

    def digest(self, into: Any) -> None:
        self._seq.digest(into)


# --------------------------------------------------------------------------- report


@dataclasses.dataclass(frozen=True)
class SkippedRow:
    """Where a skipped row is, and why (``detail`` is the same text an error would carry)."""

    file: str
    row: int
    column: str
    detail: str
    place: str
    """``Record.place``: line N of a JSONL file, row N of a Parquet file."""

    def __str__(self) -> str:
        return f"{self.file}: {self.place}: column '{self.column}' {self.detail}"


@dataclasses.dataclass
class DataReport:
    """What a loader read and kept; ``skipped`` counts rows per reason, ``samples`` the first few."""

    files: int = 0
    rows: int = 0
    kept: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    samples: dict[str, list[SkippedRow]] = dataclasses.field(default_factory=dict)
    json_conversations: int = 0
    """Rows whose prompt column held a conversation as JSON text, read as its messages."""
    chat_prompts: int = 0
    """Prompts given as messages (a list, or JSON text of one), rendered with the chat template."""
    own_tools: dict[str, int] = dataclasses.field(default_factory=dict)
    """Tool name -> the prompts that offer it through their own tools column (``tools_key``), in
    place of the loader's tools."""
    text_prompts: int = 0
    """Prompts of plain text, tokenized as written, where the tokenizer has a chat template that a
    list of messages would have been rendered with (an instruct model is then prompted unlike how
    it was tuned)."""

    def _skip(self, reason: str, where: SkippedRow) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        kept = self.samples.setdefault(reason, [])
        if len(kept) < MAX_SAMPLES:
            kept.append(where)

    def merge(self, other: DataReport) -> None:
        """Add the counts and samples of ``other``, the report of the rows that follow these."""
        self.rows += other.rows
        self.kept += other.kept
        self.json_conversations += other.json_conversations
        self.chat_prompts += other.chat_prompts
        for name, n in other.own_tools.items():
            self.own_tools[name] = self.own_tools.get(name, 0) + n
        self.text_prompts += other.text_prompts
        for reason, n in other.skipped.items():
            self.skipped[reason] = self.skipped.get(reason, 0) + n
        for reason, samples in other.samples.items():
            kept = self.samples.setdefault(reason, [])
            kept.extend(samples[: MAX_SAMPLES - len(kept)])

    def summary(self) -> str:
        """One line for the log, e.g. 'read 10 rows from 2 files: kept 8, skipped 2 (overlong 2: ...)'."""
        text = f"read {self.rows} rows from {self.files} file(s): kept {self.kept}"
        if self.skipped:
            parts = [f"{reason} {n} ({self._places(reason, n)})" for reason, n in sorted(self.skipped.items())]
            text += f", skipped {sum(self.skipped.values())}: " + "; ".join(parts)
        if self.json_conversations:
            text += (
                f"; {self.json_conversations} prompt(s) were JSON text of a message list, "
                "read as conversations (chat template applied)"
            )
        if self.text_prompts:
            text += (
                f"; {self.text_prompts} prompt(s) were plain text, tokenized as written without the tokenizer's "
                "chat template, which applies to a list of messages ([{role: user, content: ...}])"
            )
        return text

    def _places(self, reason: str, count: int) -> str:
        """The first skipped row of ``reason`` in full, then where the others remembered are."""
        first, *others = self.samples[reason]
        text = f"first: {first}"
        if others:
            text += "; also " + ", ".join(o.place if o.file == first.file else f"{o.file}: {o.place}" for o in others)
            text += f" and {count - len(others) - 1} more" if count > len(others) + 1 else ""
        return text


# --------------------------------------------------------------------------- row parsing


class _RowProblem(Exception):
    """A bad value in one row; turned into a DataError or a counted skip by the loader."""

    def __init__(self, reason: str, column: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.column, self.detail = reason, column, detail


def _columns(rec: Record) -> str:
    return str(sorted(rec.data))


def _hint(rec: Record) -> str:
    """What a row of a well-known layout this loader does not read as it is needs."""
    chosen, rejected = rec.data.get("chosen"), rec.data.get("rejected")
    if isinstance(chosen, str) and isinstance(rejected, str) and "\n\nAssistant:" in chosen:
        return (
            " (Anthropic HH-RLHF's layout: the prompt is the start that 'chosen' and 'rejected' share, through "
            "their last '\\n\\nAssistant:'; write it to a 'prompt' column and the rest of each to 'chosen' and "
            "'rejected')"
        )
    return ""


def _field_ids(rec: Record, key: str, tokenizer: Tokenizer) -> list[int]:
    """Token ids of column ``key`` (text) or, when it is absent, ``key``_ids (pre-tokenized)."""
    if key in rec.data:
        value = rec.data[key]
        if value is None:
            raise _RowProblem(EMPTY, key, "is null")
        if not isinstance(value, str):
            raise _RowProblem(WRONG_TYPE, key, f"must be a string, got {type(value).__name__}")
        if not value.strip():
            raise _RowProblem(EMPTY, key, f"is empty ({value!r})")
        ids = tokenizer.encode(value)
        if not ids:
            raise _RowProblem(EMPTY, key, "tokenizes to no tokens")
        return ids
    id_key = f"{key}_ids"
    if id_key not in rec.data:
        raise _RowProblem(
            MISSING_COLUMN,
            key,
            f"is missing (nor pre-tokenized '{id_key}'); columns present: {_columns(rec)}{_hint(rec)}",
        )
    value = rec.data[id_key]
    if value is None:
        raise _RowProblem(EMPTY, id_key, "is null")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise _RowProblem(WRONG_TYPE, id_key, f"must be a list of ints, got {_describe(value)}")
    if not value:
        raise _RowProblem(EMPTY, id_key, "is an empty list")
    bad = next((v for v in value if not 0 <= v < tokenizer.vocab_size), None)
    if bad is not None:
        raise _RowProblem(BAD_TOKEN, id_key, f"holds token id {bad}, outside [0, {tokenizer.vocab_size})")
    return list(value)


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        odd = next((v for v in value if not isinstance(v, int) or isinstance(v, bool)), None)
        return f"a list holding {type(odd).__name__} {odd!r}"
    return type(value).__name__


class _ChatOptions(NamedTuple):
    """How message-list prompts are rendered (``load_prompt_dataset``'s chat arguments)."""

    apply: bool
    variables: dict[str, Any]
    tools: list[Mapping[str, Any]] | None
    tools_key: str


def _row_tools(rec: Record, chat: _ChatOptions) -> list[Mapping[str, Any]] | None:
    """The tool schemas of a row's conversation: its own (``tools_key`` column, when present and not
    null: a list of schemas, or a JSON string of one) replace the loader's."""
    value = rec.data.get(chat.tools_key) if chat.tools_key else None
    if value is None:
        return chat.tools
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise _RowProblem(
                WRONG_TYPE, chat.tools_key, f"is a string but not JSON: {exc.msg} (column {exc.colno})"
            ) from None
    if not isinstance(value, list):
        raise _RowProblem(
            WRONG_TYPE,
            chat.tools_key,
            f"must be a list of tool schemas (or a JSON string of one), got {type(value).__name__}",
        )
    problem = next(filter(None, (tool_schema_problem(t, f"[{i}]") for i, t in enumerate(value))), None)
    if problem is not None:
        raise _RowProblem(WRONG_TYPE, chat.tools_key, problem)
    return value


def _chat_options(
    apply: bool,
    chat_template_kwargs: Mapping[str, Any] | None,
    tools: Sequence[Mapping[str, Any]] | None,
    tools_key: str,
) -> _ChatOptions:
    """A loader's chat arguments, checked before any row is read."""
    variables = dict(chat_template_kwargs or {})
    problems = template_variable_errors("chat_template_kwargs", variables) + [
        p for i, t in enumerate(tools or ()) if (p := tool_schema_problem(t, f"tools[{i}]")) is not None
    ]
    if problems:
        raise ValueError("; ".join(problems))
    return _ChatOptions(apply, variables, None if tools is None else list(tools), tools_key)


class _Conversation(NamedTuple):
    """A row's conversation, checked, and what renders it: ``render(messages[:i])`` is its text."""

    key: str
    messages: list[dict[str, Any]]
    template: ChatTemplate
    tools: list[Mapping[str, Any]] | None
    variables: dict[str, Any]

    def render(self, count: int, add_generation_prompt: bool) -> str:
        """The first ``count`` messages as text (with the generation prompt when asked)."""
        try:
            return self.template.render(self.messages[:count], self.tools, self.variables, add_generation_prompt)
        except ChatTemplateError as exc:
            raise _RowProblem(TEMPLATE_FAILED, self.key, str(exc)) from None


def _conversation(
    rec: Record, key: str, tokenizer: Tokenizer, chat: _ChatOptions, messages: Any = None
) -> _Conversation:
    """Column ``key`` of ``rec`` (or ``messages``, the conversation made of it) as a conversation: a
    non-empty list of messages with a string ``role``, with the tokenizer's chat template and the
    row's tools."""
    messages = rec.data.get(key) if messages is None else messages
    where = f"{rec.file}: {rec.place}: column '{key}' holds chat messages"
    if messages is None:
        raise _RowProblem(EMPTY, key, "is null")
    if not isinstance(messages, list):
        raise _RowProblem(WRONG_TYPE, key, f"must be a list of {{role, content}} messages, got {_describe(messages)}")
    if not chat.apply:
        raise DataError(
            f"{where} but data.apply_chat_template is false: set it to true to render them with the "
            "model's chat template, or give the text instead"
        )
    template = tokenizer.chat_template
    if template is None:
        raise DataError(
            f"{where} but {tokenizer!r} has no chat template (looked for {CHAT_TEMPLATE_FILE}, or "
            "'chat_template' in tokenizer_config.json, beside a tokenizer.json): add one to the model "
            "directory, or give the text instead (data.apply_chat_template renders message rows)"
        )
    if not messages:
        raise _RowProblem(EMPTY, key, "is an empty list of messages")
    for i, message in enumerate(messages):
        _check_message(key, i, message)
    conversation = _Conversation(key, messages, template, _row_tools(rec, chat), chat.variables)
    unusual = [
        (i, m) for i, m in enumerate(messages) if m["role"] not in _TEMPLATE_ROLES and isinstance(m.get("content"), str)
    ]
    if unusual:
        text = conversation.render(len(messages), add_generation_prompt=False)
        for i, message in unusual:
            if message["content"].strip() and message["content"].strip() not in text:
                raise _RowProblem(
                    TEMPLATE_FAILED,
                    key,
                    f"message {i} has role {message['role']!r}, which the chat template leaves out of its text: "
                    f"roles templates write are {list(_TEMPLATE_ROLES)} (ShareGPT's human and gpt are user and "
                    "assistant)",
                )
    return conversation


_TEMPLATE_ROLES = ("system", "user", "assistant", "tool")
"""The roles chat templates write; a message of another role is checked to appear in the text."""


def _check_message(key: str, i: int, message: Any) -> None:
    """Message ``i`` of column ``key``: an object with a string role, and content (a string or a list
    of parts; empty or null only beside tool calls): a misnamed text key would render as an empty
    message."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _RowProblem(
            WRONG_TYPE, key, f"message {i} must be an object with a string 'role' and 'content', got {message!r:.80}"
        )
    content, role = message.get("content"), message["role"]
    if message.get("tool_calls") and content in (None, ""):
        return
    if not isinstance(content, (str, list)):  # a list: content parts ({type: text, text: ...})
        text_keys = [k for k in ("text", "value") if isinstance(message.get(k), str)]
        hint = f" (its text is under {text_keys[0]!r}: name it 'content')" if text_keys else ""
        raise _RowProblem(
            WRONG_TYPE,
            key,
            f"message {i} ({role}) must have a string 'content'{hint}, got "
            + ("none" if content is None else _describe(content)),
        )
    if role in ("user", "assistant") and not content:
        raise _RowProblem(EMPTY, key, f"message {i} ({role}) has empty content")


def _message_ids(rec: Record, key: str, tokenizer: Tokenizer, chat: _ChatOptions, messages: Any = None) -> list[int]:
    """Token ids of a conversation prompt: the chat template's text, generation prompt included."""
    conversation = _conversation(rec, key, tokenizer, chat, messages)
    ids = tokenizer.encode(conversation.render(len(conversation.messages), add_generation_prompt=True))
    if not ids:
        raise _RowProblem(EMPTY, key, "renders to no tokens")
    return ids


def _conversation_sequence(
    ld: _Loader, rec: Record, key: str, chat: _ChatOptions, messages: list[Any] | None = None
) -> _Sequence:
    """A conversation as one SFT sequence whose loss covers what the assistant says: each assistant
    message from after its generation prompt through its stop token (a stop id, or the special
    token the template ends a turn with: ``template_turn_end``), as transformers' assistant mask
    covers it. The rest (system, user and tool messages, the template's markup around them and
    after a stop token) is context. The text is tokenized turn by turn, as a multi-turn rollout
    assembles it. ``messages``: the conversation, where it is not column ``key`` alone."""
    conversation = _conversation(rec, key, ld.tokenizer, chat, messages)
    turns = [i for i, m in enumerate(conversation.messages) if m["role"] == "assistant"]
    if not turns:
        roles = sorted({m["role"] for m in conversation.messages})
        sharegpt = " (ShareGPT's human and gpt are user and assistant)" if "gpt" in roles else ""
        raise _RowProblem(EMPTY, key, f"has no assistant message: nothing to train on; its roles are {roles}{sharegpt}")
    if turns[0] == 0:  # templates render no empty conversation, and many add a system message before it
        raise _RowProblem(
            WRONG_TYPE, key, "opens with an assistant message: an answer needs a system or user message before it"
        )
    blank = next((i for i in turns if _blank_answer(conversation.messages[i])), None)
    if blank is not None:  # it would teach the model to answer nothing
        raise _RowProblem(EMPTY, key, f"message {blank} is an assistant message with no content and no tool call")
    # A base model's EOS need not be the template's turn end (Qwen2.5: <|endoftext|>, <|im_end|>).
    turn_end = ld.turn_end(chat.variables)
    stops = set(ld.tokenizer.stop_ids) | ({turn_end} if turn_end is not None else set())
    ids: list[int] = []
    mask: list[int] = []

    def add(piece: list[int], trained: bool) -> None:
        ids.extend(piece)
        mask.extend([int(trained)] * len(piece))

    done = ""  # the text so far
    for i in turns:
        before = conversation.render(i, add_generation_prompt=True)
        after = conversation.render(i + 1, add_generation_prompt=False)
        if not (before.startswith(done) and after.startswith(before)):
            raise _RowProblem(
                TEMPLATE_FAILED,
                key,
                f"the chat template writes the conversation before message {i} (an assistant message) "
                "differently once that message follows, so the assistant's tokens cannot be told apart",
            )
        add(ld.tokenizer.encode(before[len(done) :]), trained=False)
        said = ld.tokenizer.encode(after[len(before) :])
        stop = next((j for j in range(len(said) - 1, -1, -1) if said[j] in stops), None)
        end = len(said) if stop is None else stop + 1
        # A template that writes no stop token: the last message ends with EOS, as a response does.
        eos = [ld.eos] if stop is None and i == turns[-1] and ld.eos is not None else []
        add(said[:end] + eos, trained=True)
        add(said[end:], trained=False)  # markup the template writes after the stop token
        done = after
    whole = conversation.render(len(conversation.messages), add_generation_prompt=False)
    if not whole.startswith(done):
        raise _RowProblem(
            TEMPLATE_FAILED, key, "the chat template writes the conversation differently once its last messages follow"
        )
    add(ld.tokenizer.encode(whole[len(done) :]), trained=False)
    if not any(mask):
        raise _RowProblem(EMPTY, key, "its assistant messages render to no tokens")
    sequence = ld.with_bos(ids)
    ld.check_length(len(sequence), key, f"a conversation of {len(conversation.messages)} messages")
    return sequence, [0] * (len(sequence) - len(ids)) + mask


def _blank_answer(message: Mapping[str, Any]) -> bool:
    """An assistant message that says nothing: no text (or only whitespace) and no tool call."""
    content = message.get("content")
    return not message.get("tool_calls") and (content is None or (isinstance(content, str) and not content.strip()))


def _prompt_ids(ld: _Loader, rec: Record, key: str, chat: _ChatOptions) -> list[int]:
    """A prompt column's ids, with the BOS ``add_bos`` asks for: a conversation rendered with the
    generation prompt (a list of messages, or JSON text of one, as a conversation written with
    json.dumps is), text, or ids."""
    value = rec.data.get(key)
    messages = value if isinstance(value, list) else _json_messages(value) if isinstance(value, str) else None
    if messages is not None:
        if messages is not value:
            ld.report.json_conversations += 1
        ld.report.chat_prompts += 1
        if chat.tools_key and rec.data.get(chat.tools_key) is not None:
            for tool in _row_tools(rec, chat) or []:
                name = tool["function"]["name"]
                ld.report.own_tools[name] = ld.report.own_tools.get(name, 0) + 1
        return ld.with_bos(_message_ids(rec, key, ld.tokenizer, chat, messages))
    if isinstance(value, str) and chat.apply and ld.tokenizer.chat_template is not None:
        ld.report.text_prompts += 1
    return ld.with_bos(ld.field(rec, key), text=key in rec.data)


def _json_messages(text: str) -> list[dict[str, Any]] | None:
    """``text`` parsed, where it is JSON of a non-empty list of messages (objects with a string role)."""
    if not text.lstrip().startswith("[{"):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    is_messages = (
        isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)
    )
    return value if is_messages else None


def _reward_inputs(rec: Record) -> dict[str, Any]:
    """verl's reward inputs of a row, named as its ``compute_score`` takes them: ``data_source``,
    ``ground_truth`` (from the ``reward_model`` struct) and ``extra_info`` (absent or null: {}), as
    verl's ``examples/data_preprocess`` scripts write them. Rows without ``reward_model`` keep their
    ``data_source`` (validation figures are split by it) and their ``extra_info``'s multi-turn inputs
    (a ``generate`` input's ``tools_kwargs`` and ``interaction_kwargs``)."""
    data = rec.data
    if "reward_model" not in data:
        source, extra_info = data.get("data_source"), data.get("extra_info")
        if source is not None and not isinstance(source, str):  # was dropped, and the row's figures with it
            raise _RowProblem(WRONG_TYPE, "data_source", f"must be a string (or null), got {type(source).__name__}")
        if extra_info is not None and not isinstance(extra_info, dict):
            raise _RowProblem(WRONG_TYPE, "extra_info", f"must be an object (or null), got {type(extra_info).__name__}")
        multi_turn = _tool_inputs(extra_info) if extra_info and set(_MULTI_TURN_INPUTS) & set(extra_info) else {}
        return {**({"data_source": source} if source else {}), **multi_turn}
    if "data_source" not in data:
        raise _RowProblem(
            MISSING_COLUMN,
            "data_source",
            "is missing beside 'reward_model' (verl's reward functions are called with both); columns present: "
            f"{_columns(rec)}",
        )
    source, reward_model, extra_info = data["data_source"], data["reward_model"], data.get("extra_info")
    if not isinstance(source, str):
        raise _RowProblem(WRONG_TYPE, "data_source", f"must be a string, got {type(source).__name__}")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise _RowProblem(
            WRONG_TYPE, "reward_model", f"must be an object with a 'ground_truth' field, got {reward_model!r:.80}"
        )
    if extra_info is not None and not isinstance(extra_info, dict):
        raise _RowProblem(WRONG_TYPE, "extra_info", f"must be an object (or null), got {type(extra_info).__name__}")
    return {
        "data_source": source,
        "ground_truth": reward_model["ground_truth"],
        "extra_info": extra_info or {},
        **_tool_inputs(extra_info or {}),
    }


_MULTI_TURN_INPUTS = ("tools_kwargs", "interaction_kwargs", "need_tools_kwargs")
"""The ``extra_info`` fields a multi-turn rollout reads (``_tool_inputs``)."""
_TOOL_KWARGS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")
"""What a tool's entry in ``tools_kwargs`` may hold: the keywords of each of a verl tool's methods."""


def _object_or_empty(value: Any, field: str) -> dict[str, Any]:
    """An object field of ``extra_info``; null (a parquet struct's absent field) is {}."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _RowProblem(
            WRONG_TYPE, "extra_info", f"field '{field}' must be an object (or null), got {type(value).__name__}"
        )
    return value


def _tool_inputs(extra_info: dict[str, Any]) -> dict[str, Any]:
    """A verl row's multi-turn inputs, taken from its ``extra_info`` as verl's ``RLHFDataset``
    takes them: ``tools_kwargs`` (tool name -> its ``create_kwargs``, ``execute_kwargs``, ...),
    ``interaction_kwargs`` and ``need_tools_kwargs`` (default false). A parquet file's structs hold
    every field any row has, null where a row has none: a null tool is another row's and is left
    out, and each tool's four groups of keywords are there, {} where absent or null."""
    tools: dict[str, dict[str, Any]] = {}
    for name, entry in _object_or_empty(extra_info.get("tools_kwargs"), "tools_kwargs").items():
        if entry is None:
            continue
        groups = _object_or_empty(entry, f"tools_kwargs.{name}")
        unknown = sorted(set(groups) - set(_TOOL_KWARGS))
        if unknown:
            raise _RowProblem(
                WRONG_TYPE,
                "extra_info",
                f"field 'tools_kwargs.{name}' holds {unknown}; expected only {list(_TOOL_KWARGS)}",
            )
        tools[name] = {
            group: _object_or_empty(groups.get(group), f"tools_kwargs.{name}.{group}") for group in _TOOL_KWARGS
        }
    need_tools = extra_info.get("need_tools_kwargs")
    if need_tools is not None and not isinstance(need_tools, bool):
        raise _RowProblem(
            WRONG_TYPE, "extra_info", f"field 'need_tools_kwargs' must be a boolean (or null), got {need_tools!r:.40}"
        )
    if need_tools and not tools:
        raise _RowProblem(EMPTY, "extra_info", "field 'need_tools_kwargs' is true but 'tools_kwargs' names no tool")
    return {
        "tools_kwargs": tools,
        "need_tools_kwargs": bool(need_tools),
        "interaction_kwargs": _object_or_empty(extra_info.get("interaction_kwargs"), "interaction_kwargs"),
    }


def _response(ids: list[int], eos: int | None) -> list[int]:
    return ids if eos is None or ids[-1] == eos else ids + [eos]


# --------------------------------------------------------------------------- loaders

_Sequence = tuple[list[int], list[int] | None]  # ids, and loss mask for stores that keep one
_SPANS_PER_WORKER = 4  # several spans per worker, so that a slow span does not leave the others idle


@dataclasses.dataclass
class _Part:
    """The examples of consecutive rows, in row order, and their report: a whole dataset, or one
    worker's span, appended to the others in order."""

    stores: list[_TokenStore]
    extras: list[dict[str, Any]]
    """Each row's extras, for the kinds whose rows have them (prompts); empty for the others."""
    report: DataReport
    rows: list[int] = dataclasses.field(default_factory=list)
    """Each example's row: its 0-based place among the rows read (skipped ones counted)."""

    def add(self, sequences: list[_Sequence], extras: dict[str, Any] | None) -> None:
        for store, (ids, mask) in zip(self.stores, sequences, strict=True):
            store.append(ids, mask)
        if extras is not None:
            self.extras.append(extras)
        self.rows.append(self.report.rows - 1)
        self.report.kept += 1

    def extend(self, other: _Part) -> None:
        for store, theirs in zip(self.stores, other.stores, strict=True):
            store.extend(theirs)
        self.extras.extend(other.extras)
        self.rows.extend(row + self.report.rows for row in other.rows)
        self.report.merge(other.report)


class _Loader:
    """One load: its settings, the kind's row function and the shared loop (read rows, turn problems
    into errors or counted skips). It is what a worker process gets, so it must pickle."""

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        tokenizer: Tokenizer,
        max_length: int,
        length_setting: str,
        on_overlong: OnProblem,
        on_invalid: OnProblem,
        append_eos: bool,
        add_bos: bool | None,
        num_workers: int,
        row: _RowFn,
        masks: tuple[bool, ...],
    ) -> None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be a positive int, got {max_length!r}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
        for name, value in (("on_overlong", on_overlong), ("on_invalid", on_invalid)):
            if value not in get_args(OnProblem):
                raise ValueError(f"{name} must be one of {get_args(OnProblem)}, got {value!r}")
        if append_eos and tokenizer.eos_id is None:
            raise ValueError(f"{tokenizer!r} has no eos_id; pass append_eos=False to train without EOS")
        if add_bos and tokenizer.bos_id is None:
            raise ValueError(f"data.add_bos=true but {tokenizer!r} has no BOS token: set data.add_bos=false")
        self.files: list[Path] = data_files(paths)
        self.tokenizer, self.max_length, self.length_setting = tokenizer, max_length, length_setting
        self.on_overlong, self.on_invalid, self.num_workers = on_overlong, on_invalid, num_workers
        self.eos = tokenizer.eos_id if append_eos else None
        bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
        # add_bos None: text rows as transformers' tokenizer(text) encodes them; conversations as the
        # chat template writes them (HF's apply_chat_template adds nothing), token ids as given.
        self.text_bos: list[int] = bos if (tokenizer.adds_bos if add_bos is None else add_bos) else []
        self.bos: list[int] = bos if add_bos else []
        self.row, self.masks = row, masks
        self.report = DataReport()
        self._turn_ends: dict[str, int | None] = {}

    def turn_end(self, variables: Mapping[str, Any]) -> int | None:
        """``template_turn_end`` with the template ``variables``, worked out once per load."""
        key = json.dumps(variables, sort_keys=True, default=str)
        if key not in self._turn_ends:
            self._turn_ends[key] = template_turn_end(self.tokenizer, variables)
        return self._turn_ends[key]

    def load(self) -> _Part:
        """Every row of every file, in order: here, or in ``num_workers`` processes (same result)."""
        part = self.read(read_records(self.files)) if self.num_workers == 0 else self._read_in_workers()
        if part.report.kept == 0:
            raise DataError(f"no usable examples in {[str(f) for f in self.files]}: {part.report.summary()}")
        return part

    def read(self, records: Iterable[Record]) -> _Part:
        """The examples of ``records``: all rows (in this process) or one span (in a worker)."""
        part = _Part(
            [_TokenStore(with_mask=m) for m in self.masks],
            [],
            DataReport(files=len(self.files)),
        )
        self.report = part.report  # the row functions count what they read in it
        for rec in records:
            part.report.rows += 1
            try:
                sequences, extras = self.row(self, rec)
            except _RowProblem as p:
                self.problem(part.report, rec, p)
                continue
            part.add(sequences, extras)
        return part

    def _read_in_workers(self) -> _Part:
        """Spans of the files read in worker processes, appended in order. A worker's error is raised
        here when its span's turn comes, so the first error in row order wins, as in one process."""
        try:
            loader = pickle.dumps(self)
        except Exception as exc:  # what an object that does not pickle raises varies
            raise ValueError(
                f"num_workers={self.num_workers}: {self.tokenizer!r} cannot be sent to worker "
                f"processes ({type(exc).__name__}: {exc}); set data.num_workers=0"
            ) from exc
        pieces = self.num_workers * _SPANS_PER_WORKER
        spans = split_files(self.files, pieces)
        # spawn, not fork: a forked child of a process running torch's threads (or CUDA) can hang.
        # An executor, not a Pool: a worker that dies (out of memory) breaks it instead of hanging it.
        pool = ProcessPoolExecutor(
            max_workers=min(self.num_workers, len(spans)),
            initializer=_start_worker,
            initargs=(loader,),
            mp_context=multiprocessing.get_context("spawn"),
        )
        try:
            # Many small files make many spans: hand them out a few at a time.
            parts = pool.map(_read_span, spans, chunksize=max(len(spans) // pieces, 1))
            whole = next(parts)
            for part in parts:
                whole.extend(part)
        except BrokenProcessPool as exc:
            files = [str(f) for f in self.files]
            raise RuntimeError(
                f"a data-loading worker process failed to start or died (out of memory?) while "
                f"reading {files[:3]}{' ...' if len(files) > 3 else ''}: lower data.num_workers="
                f"{self.num_workers}, or set it to 0"
            ) from exc
        finally:
            pool.shutdown(cancel_futures=True)
        return whole

    def problem(self, report: DataReport, rec: Record, p: _RowProblem) -> None:
        """Raise ``p`` as a DataError or count it as a skip, per the loader's policy."""
        where = SkippedRow(str(rec.file), rec.row, p.column, p.detail, rec.place)
        if (self.on_overlong if p.reason == OVERLONG else self.on_invalid) == "error":
            option = "on_overlong" if p.reason == OVERLONG else "on_invalid"
            raise DataError(f"{where} (set data.{option}=skip to skip and count such rows)")
        report._skip(p.reason, where)

    def field(self, rec: Record, key: str) -> list[int]:
        return _field_ids(rec, key, self.tokenizer)

    def with_bos(self, prompt: list[int], *, text: bool = False) -> list[int]:
        """[BOS] + prompt where add_bos asks for one (``text``: the prompt is a text column's), unless
        the prompt already starts with BOS (chat templates often write it)."""
        bos = self.text_bos if text else self.bos
        return prompt if prompt[: len(bos)] == bos else bos + prompt

    def check_length(self, n_tokens: int, column: str, parts: str) -> None:
        """An over-long row names the setting that bounds it, so the fix is one edit away."""
        if n_tokens > self.max_length:
            raise _RowProblem(
                OVERLONG, column, f"gives {n_tokens} tokens ({parts}) > {self.length_setting}={self.max_length}"
            )


# A row -> its sequences (one per store) and extras; raises _RowProblem for a bad value.
_RowFn = Callable[[_Loader, Record], tuple[list[_Sequence], dict[str, Any] | None]]

_worker_loader: _Loader | None = None  # the loader of this worker process


def _start_worker(loader: bytes) -> None:
    global _worker_loader
    _worker_loader = pickle.loads(loader)


def _read_span(span: Span) -> _Part:
    assert _worker_loader is not None, "_start_worker runs first in every worker"
    return _worker_loader.read(read_span(span))


def _sft_row(
    ld: _Loader, rec: Record, prompt_key: str, response_key: str, messages_key: str, chat: _ChatOptions
) -> tuple[list[_Sequence], None]:
    has_prompt = prompt_key in rec.data or f"{prompt_key}_ids" in rec.data
    if messages_key and (rec.data.get(messages_key) is not None or (messages_key in rec.data and not has_prompt)):
        return [_conversation_sequence(ld, rec, messages_key, chat)], None
    if messages_key and not has_prompt:
        raise _RowProblem(
            MISSING_COLUMN,
            prompt_key,
            f"is missing (nor pre-tokenized '{prompt_key}_ids'), nor is there a conversation in '{messages_key}'; "
            f"columns present: {_columns(rec)}",
        )
    prompt = _prompt_ids(ld, rec, prompt_key, chat)
    response = _response(ld.field(rec, response_key), ld.eos)
    ld.check_length(len(prompt) + len(response), response_key, f"prompt {len(prompt)} + response {len(response)}")
    return [(prompt + response, [0] * len(prompt) + [1] * len(response))], None


def _preference_conversations(
    ld: _Loader, rec: Record, prompt_key: str, chosen_key: str, rejected_key: str, chat: _ChatOptions
) -> tuple[list[_Sequence], None]:
    """Chosen and rejected as conversations (TRL's conversational preference rows): each the whole
    conversation, or the ``prompt_key`` conversation's continuation when the row has one. Each side
    ends at its last assistant message's stop token, as a rollout's response does where the reward
    model scores it. A text prompt that each side opens with, as its first user message, is a copy
    of it (UltraFeedback's binarized rows) and is left out."""
    prompt = rec.data.get(prompt_key)
    if isinstance(prompt, str) and all(_opens_with(rec.data.get(key), prompt) for key in (chosen_key, rejected_key)):
        prompt = None
    if prompt is not None and not isinstance(prompt, list):
        raise _RowProblem(
            WRONG_TYPE,
            prompt_key,
            f"must be a conversation too when '{chosen_key}' is one, got {_describe(prompt)} (a text prompt is left "
            "out where both sides open with it as their first user message, as UltraFeedback's binarized rows do)",
        )
    sides: dict[str, list[Any]] = {}
    for key in (chosen_key, rejected_key):
        side = rec.data.get(key)
        if not isinstance(side, list):
            raise _RowProblem(WRONG_TYPE, key, f"must be a conversation as '{chosen_key}' is, got {_describe(side)}")
        sides[key] = side
    openings = [_before_first_answer(side) for side in sides.values()]
    if openings[0] != openings[1]:
        raise _RowProblem(
            MISMATCHED_PAIR,
            rejected_key,
            f"opens otherwise than '{chosen_key}' (the messages before the first assistant message differ): a "
            "pair is two answers to one prompt",
        )
    sequences: list[_Sequence] = []
    for key, side in sides.items():
        ids, mask = _conversation_sequence(ld, rec, key, chat, [*(prompt or []), *side])
        assert mask is not None, "a conversation's sequence has its loss mask"
        end = max(i for i, trained in enumerate(mask) if trained) + 1
        sequences.append((ids[:end], mask[:end]))
    return sequences, None


def _before_first_answer(side: list[Any]) -> list[Any]:
    """The messages of a conversation before its first assistant message: its prompt."""
    answers = [i for i, m in enumerate(side) if isinstance(m, dict) and m.get("role") == "assistant"]
    return side[: answers[0]] if answers else side


def _opens_with(side: Any, prompt: str) -> bool:
    """Whether the conversation ``side`` starts with a user message of text ``prompt``."""
    first = side[0] if isinstance(side, list) and side else None
    return (
        isinstance(first, dict)
        and first.get("role") == "user"
        and isinstance(first.get("content"), str)
        and first["content"].strip() == prompt.strip()
    )


def _preference_row(
    ld: _Loader, rec: Record, prompt_key: str, chosen_key: str, rejected_key: str, chat: _ChatOptions
) -> tuple[list[_Sequence], None]:
    if isinstance(rec.data.get(chosen_key), list):
        pair, _ = _preference_conversations(ld, rec, prompt_key, chosen_key, rejected_key, chat)
    else:
        prompt = _prompt_ids(ld, rec, prompt_key, chat)
        chosen = _response(ld.field(rec, chosen_key), ld.eos)
        rejected = _response(ld.field(rec, rejected_key), ld.eos)
        for key, resp in ((chosen_key, chosen), (rejected_key, rejected)):
            ld.check_length(len(prompt) + len(resp), key, f"prompt {len(prompt)} + {key} {len(resp)}")
        prompt_mask = [0] * len(prompt)
        pair = [
            (prompt + chosen, prompt_mask + [1] * len(chosen)),
            (prompt + rejected, prompt_mask + [1] * len(rejected)),
        ]
    if pair[0][0] == pair[1][0]:
        raise _RowProblem(
            IDENTICAL_PAIR,
            rejected_key,
            f"is the same as '{chosen_key}': the pair teaches nothing and counts as wrong in validation accuracy",
        )
    return pair, None


RAW_PROMPT = "raw_prompt"
"""The extras key of a conversation prompt's messages when the loader keeps them (verl's name, as
its ``data.return_raw_chat`` keeps them): an interaction reads the whole conversation."""


def _blank(value: Any) -> bool:
    """A reward input that would score responses against nothing: null, or text of whitespace only."""
    return value is None or (isinstance(value, str) and not value.strip())


def _prompt_row(
    ld: _Loader,
    rec: Record,
    prompt_key: str,
    extra_keys: Sequence[str],
    chat: _ChatOptions,
    keep_raw_prompt: bool,
    require_reward_inputs: bool,
) -> tuple[list[_Sequence], dict[str, Any]]:
    missing = [k for k in extra_keys if k not in rec.data]
    if missing:
        raise _RowProblem(
            MISSING_COLUMN, missing[0], f"is missing (requested in extra_keys); columns present: {_columns(rec)}"
        )
    if require_reward_inputs and "reward_model" not in rec.data:
        raise _RowProblem(
            MISSING_COLUMN,
            "reward_model",
            "is missing: scoring.custom_function is called with each row's data_source and "
            f"reward_model.ground_truth (verl's format); columns present: {_columns(rec)}",
        )
    prompt = _prompt_ids(ld, rec, prompt_key, chat)
    ld.check_length(len(prompt), prompt_key, f"prompt {len(prompt)}")
    blank = [k for k in extra_keys if _blank(rec.data[k])]
    if blank:
        # A reward rule would compare responses with nothing (an empty answer matches an empty response).
        value = rec.data[blank[0]]
        what = "is null" if value is None else f"is empty ({value!r})"
        raise _RowProblem(EMPTY, blank[0], f"{what} (requested in extra_keys: the reward rules read it)")
    extras = {**{k: rec.data[k] for k in extra_keys}, **_reward_inputs(rec)}
    truth = extras.get("ground_truth")
    if require_reward_inputs and _blank(truth):
        raise _RowProblem(
            EMPTY, "reward_model", f"has ground_truth {truth!r}: scoring.custom_function would score against it"
        )
    if keep_raw_prompt:
        if prompt_key not in rec.data:
            raise _RowProblem(
                MISSING_COLUMN,
                prompt_key,
                "is missing (only its pre-tokenized ids are here), and the interactions read each row's prompt "
                "messages (interactions_read_prompts)",
            )
        if isinstance(rec.data[prompt_key], list):  # _prompt_ids checked its messages
            extras[RAW_PROMPT] = [{"role": m["role"], "content": m.get("content")} for m in rec.data[prompt_key]]
    return [(prompt, None)], extras


def load_sft_dataset(
    paths: str | Path | Sequence[str | Path],
    tokenizer: Tokenizer,
    *,
    max_length: int,
    on_overlong: OnProblem = "error",
    on_invalid: OnProblem = "error",
    prompt_key: str = "prompt",
    response_key: str = "response",
    messages_key: str = "messages",
    append_eos: bool = True,
    add_bos: bool | None = None,
    apply_chat_template: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tools_key: str = "tools",
    num_workers: int = 0,
) -> tuple[SFTDataset, DataReport]:
    """SFT sequences from ``.jsonl``/``.parquet`` files or directories (see the module docstring): a
    row's ``messages_key`` conversation when it has one ("": never), else its prompt and response.
    The chat arguments are ``load_prompt_dataset``'s."""
    chat = _chat_options(apply_chat_template, chat_template_kwargs, tools, tools_key)
    row = functools.partial(
        _sft_row, prompt_key=prompt_key, response_key=response_key, messages_key=messages_key, chat=chat
    )
    part = _Loader(
        paths,
        tokenizer,
        max_length,
        "data.max_length",
        on_overlong,
        on_invalid,
        append_eos,
        add_bos,
        num_workers,
        row,
        masks=(True,),
    ).load()
    return SFTDataset(part.stores[0]), part.report


def load_preference_dataset(
    paths: str | Path | Sequence[str | Path],
    tokenizer: Tokenizer,
    *,
    max_length: int,
    on_overlong: OnProblem = "error",
    on_invalid: OnProblem = "error",
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    append_eos: bool = True,
    add_bos: bool | None = None,
    apply_chat_template: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tools_key: str = "tools",
    num_workers: int = 0,
) -> tuple[PreferenceDataset, DataReport]:
    """Preference pairs for reward models / DPO; a row is over-long if either side is. Chosen and
    rejected are texts after a prompt (text, or a conversation rendered with the generation
    prompt), or conversations (TRL's conversational rows: whole, or after a conversation prompt),
    each ending at its last assistant message's stop token. The chat arguments are
    ``load_prompt_dataset``'s."""
    chat = _chat_options(apply_chat_template, chat_template_kwargs, tools, tools_key)
    row = functools.partial(
        _preference_row, prompt_key=prompt_key, chosen_key=chosen_key, rejected_key=rejected_key, chat=chat
    )
    part = _Loader(
        paths,
        tokenizer,
        max_length,
        "data.max_length",
        on_overlong,
        on_invalid,
        append_eos,
        add_bos,
        num_workers,
        row,
        masks=(True, True),
    ).load()
    return PreferenceDataset(*part.stores), part.report


def load_prompt_dataset(
    paths: str | Path | Sequence[str | Path],
    tokenizer: Tokenizer,
    *,
    max_length: int,
    on_overlong: OnProblem = "error",
    on_invalid: OnProblem = "error",
    prompt_key: str = "prompt",
    extra_keys: Sequence[str] = (),
    add_bos: bool | None = None,
    apply_chat_template: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tools_key: str = "tools",
    num_workers: int = 0,
    keep_raw_prompt: bool = False,
    require_reward_inputs: bool = False,
) -> tuple[PromptDataset, DataReport]:
    """RL prompts (``max_length`` bounds the prompt alone); ``extra_keys`` must be in every row. A
    verl row's reward inputs join its extras (and win over extra columns of the same name).
    ``keep_raw_prompt``: a conversation prompt's messages ({role, content}) join its extras as
    ``RAW_PROMPT``, for multi-turn interactions. ``require_reward_inputs``: every row must carry
    verl's reward inputs (a reward function is called with them), checked as the rows are read.

    ``apply_chat_template`` renders message-list prompts with the tokenizer's chat template, given
    ``chat_template_kwargs`` as more template variables (``enable_thinking``) and as ``tools`` a row's
    ``tools_key`` column (when present and not null; "": never) or else ``tools``. Text and
    pre-tokenized prompts are never templated (they may be chat-formatted already), so these do not
    apply to them."""
    chat = _chat_options(apply_chat_template, chat_template_kwargs, tools, tools_key)
    row = functools.partial(
        _prompt_row,
        prompt_key=prompt_key,
        extra_keys=tuple(extra_keys),
        chat=chat,
        keep_raw_prompt=keep_raw_prompt,
        require_reward_inputs=require_reward_inputs,
    )
    part = _Loader(
        paths,
        tokenizer,
        max_length,
        "data.max_prompt_length",
        on_overlong,
        on_invalid,
        False,
        add_bos,
        num_workers,
        row,
        masks=(False,),
    ).load()
    return PromptDataset(part.stores[0], part.extras, part.rows), part.report
