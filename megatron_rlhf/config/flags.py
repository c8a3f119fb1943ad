"""Command-line flags that are other names of settings: ``generate --num-samples 4`` is
``rollout.sampling.n=4``.

Every command takes its settings as ``key=value``; the flags of the commands that had flags before
(``generate``, ``plan``, ``convert``) stay as aliases. ``FLAG_ALIASES`` is the one table of them;
``add_flag_aliases`` makes each an argparse option whose type, choices, help and default come from
the schema field it names, and which adds ``key=value`` to the command's settings, so that a flag
and its key are loaded, checked and reported the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from collections.abc import Sequence
from typing import Any

from megatron_rlhf.config.fields import field_default, field_docs, literal_choices

FLAG_ALIASES: dict[str, dict[str, str]] = {
    "generate": {
        "--model": "model",
        "--input": "input",
        "--output": "output",
        "--tp": "rollout.tp",
        "--device": "device",
        "--dtype": "dtype",
        "--temperature": "rollout.sampling.temperature",
        "--top-k": "rollout.sampling.top_k",
        "--top-p": "rollout.sampling.top_p",
        "--max-new-tokens": "rollout.sampling.max_new_tokens",
        "--num-samples": "rollout.sampling.n",
        "--stop-token-ids": "rollout.sampling.stop_token_ids",
        "--ignore-eos": "rollout.sampling.ignore_eos",
        "--seed": "rollout.sampling.seed",
        "--max-batch-size": "rollout.engine.max_batch_size",
        "--max-seq-len": "rollout.engine.max_seq_len",
        "--on-long-prompt": "rollout.engine.on_long_prompt",
        "--cuda-graphs": "rollout.engine.cuda_graphs",
        "--graph-kv-bucket": "rollout.engine.graph_kv_bucket",
    },
    "plan": {
        "--trainer": "plan.trainer",
        "--world-size": "plan.world_size",
        "--gpu-memory-gib": "plan.gpu_memory_gib",
        "--json": "plan.json",
    },
    "convert": {"--tp": "tp", "--pp": "pp", "--device": "device"},
}
"""Each command's flags and the key each one sets. A bool key's flag ``--x`` sets it true and
``--no-x`` false; a tuple key's flag takes several values."""

POSITIONAL_ALIASES: dict[str, tuple[str, ...]] = {"convert": ("direction", "source", "output")}
"""Keys that a command also takes as bare words, in this order (``convert hf-to-mcore HF_DIR OUT_DIR``)."""

SETTING = re.compile(r"^[A-Za-z_][\w.]*=")
"""A ``key=value`` item (a bare word, such as a path, has no key before its first ``=``)."""
ALIASED = "aliased_settings"
"""The parsed namespace's list of ``key=value`` items set by flags, in command-line order."""


@dataclasses.dataclass(frozen=True)
class SchemaField:
    """A leaf setting of a config schema: its type, docstring and library default."""

    kind: Any
    doc: str
    default: Any


def schema_field(schema: type, key: str) -> SchemaField:
    """The field a dotted ``key`` names in the dataclass ``schema`` (a ``KeyError`` if none)."""
    cls, *sections = schema, *key.split(".")[:-1]
    for section in sections:
        cls = typing.get_type_hints(cls)[section]
    name = key.rpartition(".")[2]
    field = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    if field is None:
        raise KeyError(key)
    return SchemaField(typing.get_type_hints(cls)[name], field_docs(cls).get(name, ""), field_default(field))


def dotlist_value(value: object) -> str:
    """A parsed flag's value as the right-hand side of ``key=value``."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Sequence) and not isinstance(value, str):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


class _SetKey(argparse.Action):
    """Adds ``key=value`` to the namespace's ``ALIASED`` list (a fresh list each parse)."""

    def __init__(self, option_strings: list[str], dest: str, *, key: str, **kwargs: Any) -> None:
        super().__init__(option_strings, ALIASED, **kwargs)
        self.key = key

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        settings: list[str] = []
        if self.nargs == 0:  # a bool flag: --x or --no-x
            values = not (option_string or "").startswith("--no-")
        elif isinstance(values, list):  # several values: key=value items after them are settings
            settings = [value for value in values if SETTING.match(value)]
            values = [value for value in values if not SETTING.match(value)]
        aliased = [*(getattr(namespace, ALIASED, None) or []), f"{self.key}={dotlist_value(values)}", *settings]
        setattr(namespace, ALIASED, aliased)


def add_flag_aliases(parser: argparse._ActionsContainer, command: str, schema: type) -> None:
    """The options of ``FLAG_ALIASES[command]``, each documented with the key it sets."""
    for flag, key in FLAG_ALIASES.get(command, {}).items():
        field = schema_field(schema, key)
        kind = field.kind
        optional = type(None) in typing.get_args(kind)
        if optional:  # X | None: the flag takes an X
            kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
        metavar = {int: "N", float: "X"}.get(kind, key.rpartition(".")[2].upper())
        kwargs: dict[str, Any] = {"key": key, "default": [], "metavar": metavar}
        flags = [flag]
        if kind is bool:
            flags.append("--no-" + flag.removeprefix("--"))
            kwargs.update(nargs=0, metavar=None)
        elif typing.get_origin(kind) is tuple:
            kwargs["nargs"] = "*"
        elif (choices := literal_choices(kind)) is not None:
            kwargs.update(choices=choices, metavar="{" + ",".join(map(str, choices)) + "}")
        shown = "true/false" if kind is bool else kwargs["metavar"]
        default = "" if field.default in ("", None) else f" (default: {dotlist_value(field.default)})"
        kwargs["help"] = f"= {key}={shown}. {field.doc}{default}".replace("%", "%%")
        parser.add_argument(*flags, action=_SetKey, **kwargs)
