"""Command-line flags made from a config dataclass, so that a command's flags and the YAML settings
of the same dataclass share one declaration: name, type, default and help.

A field ``max_new_tokens: int = 256`` becomes ``--max-new-tokens`` (int, default 256, help from the
field's docstring); ``metadata={"flag": "--num-samples"}`` names the flag differently; a bool
becomes ``--x``/``--no-x``; a tuple of ints takes several values.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import TYPE_CHECKING, Any

from megatron_rlhf.config.fields import field_docs

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def _flag(field: dataclasses.Field) -> str:
    return field.metadata.get("flag", "--" + field.name.replace("_", "-"))


def add_flags(parser: argparse._ActionsContainer, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of ``cls`` (except ``skip``), defaulting to the dataclass's default."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        kind = hints[field.name]
        default = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
        kwargs: dict[str, Any] = {"dest": field.name, "default": default, "help": docs.get(field.name, "")}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is tuple:
            kwargs.update(type=typing.get_args(kind)[0], nargs="*")
        elif typing.get_origin(kind) is typing.Literal:
            kwargs["choices"] = typing.get_args(kind)
        else:
            kwargs["type"] = kind
        kwargs["help"] += " (default: %(default)s)"
        parser.add_argument(_flag(field), **kwargs)


def from_flags[T: DataclassInstance](args: argparse.Namespace, cls: type[T], **fixed: Any) -> T:
    """``cls`` built from the parsed flags of ``add_flags`` (and ``fixed`` values for skipped fields)."""
    values = {field.name: getattr(args, field.name) for field in dataclasses.fields(cls) if field.name not in fixed}
    for field in dataclasses.fields(cls):
        if isinstance(values.get(field.name), list):
            values[field.name] = tuple(values[field.name])
    return cls(**values, **fixed)
