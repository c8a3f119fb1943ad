"""Small field rules shared by the config dataclasses' ``errors()`` methods, and field docstrings.

Convention: ``errors()`` returns messages that start with the field's name relative to its
dataclass (``"n=0 must be >= 1"``); ``config.loader.config_errors`` prefixes the dotted path of the
dataclass in the command's tree, so users read the full key (``rollout.sampling.n=0 must be >= 1``).

A setting with a fixed set of values is a ``Literal[...]`` field: the type checker checks it in
code, OmegaConf when a preset or override is merged (the loader names key, value and choices), and
``choice_errors`` when a dataclass is built in code; no ``errors()`` repeats the choices.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import dataclasses
import difflib
import functools
import inspect
import itertools
import textwrap
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

_LOADER_BUILDING = contextvars.ContextVar("loader_building", default=False)


def file_errors(setting: str, path: str, load: Callable[[str], object]) -> list[str]:
    """The up-front check of a setting that names a file (empty: none): reading it with ``load``,
    whose ``ValueError`` (naming the file and what was expected) becomes the setting's error."""
    if not path:
        return []
    try:
        load(path)
    except ValueError as exc:
        return [f"{setting}: {exc}"]
    return []


def field_default(field: dataclasses.Field[Any]) -> Any:
    """A dataclass field's default value, made by its factory where it has one."""
    return field.default if field.default_factory is dataclasses.MISSING else field.default_factory()


def check_on_init(cfg: Any) -> None:
    """For ``__post_init__``: a dataclass built in code raises ``ValueError`` with its
    ``choice_errors`` and ``errors()`` at once; inside the loader (``building_tree``) nothing is
    raised, the loader collects the errors of the whole tree itself and reports them together."""
    if not _LOADER_BUILDING.get():
        errors = choice_errors(cfg) + cfg.errors()
        if errors:
            raise ValueError("; ".join(errors))


@contextlib.contextmanager
def building_tree() -> Iterator[None]:
    token = _LOADER_BUILDING.set(True)
    try:
        yield
    finally:
        _LOADER_BUILDING.reset(token)


def at_least(cfg: Any, low: float, *names: str) -> list[str]:
    """``name=value must be >= low`` for each of ``names`` below ``low``."""
    return [f"{name}={getattr(cfg, name)} must be >= {low}" for name in names if getattr(cfg, name) < low]


def literal_choices(kind: object) -> tuple[object, ...] | None:
    """The values of a ``Literal[...]`` type; None for any other type."""
    return typing.get_args(kind) if typing.get_origin(kind) is Literal else None


def did_you_mean(value: object, choices: Sequence[object]) -> str:
    """``; did you mean 'X'?`` for the choice closest to ``value``, or nothing when none is close."""
    close = difflib.get_close_matches(str(value), [str(choice) for choice in choices], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def not_a_choice(key: str, value: object, choices: Sequence[object]) -> str:
    """``key=value must be one of [...]``, and the closest choice when one is close."""
    return f"{key}={value!r} must be one of {list(choices)}{did_you_mean(value, choices)}"


@functools.cache
def _choice_fields(cls: type) -> dict[str, tuple[object, ...]]:
    """The ``Literal`` fields of the dataclass ``cls`` and their choices."""
    hints = typing.get_type_hints(cls)
    return {
        field.name: choices
        for field in dataclasses.fields(cls)
        if (choices := literal_choices(hints[field.name])) is not None
    }


def choice_errors(cfg: object) -> list[str]:
    """``not_a_choice`` for each ``Literal`` field of the dataclass ``cfg`` whose value is none of its
    choices (a dataclass built in code: the loader's merge refuses such values already)."""
    cls: type = type(cfg)
    return [
        not_a_choice(name, getattr(cfg, name), choices)
        for name, choices in _choice_fields(cls).items()
        if getattr(cfg, name) not in choices
    ]


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (and of its bases), by field name.

    Python keeps no attribute docstrings at run time, so they are read from the class source; they
    feed command-line help, so that flags built from a dataclass say what its fields say.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, following in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs
