"""Small field rules shared by the config dataclasses' ``errors()`` methods, and field docstrings.

Convention: ``errors()`` returns messages that start with the field's name relative to its
dataclass (``"n=0 must be >= 1"``); ``config.loader.config_errors`` prefixes the dotted path of the
dataclass in the command's tree, so users read the full key (``rollout.sampling.n=0 must be >= 1``).
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import dataclasses
import functools
import inspect
import itertools
import textwrap
from collections.abc import Iterable, Iterator
from typing import Any

_LOADER_BUILDING = contextvars.ContextVar("loader_building", default=False)


def check_on_init(cfg: Any) -> None:
    """For ``__post_init__``: a dataclass built in code raises ``ValueError`` with its ``errors()``
    at once; inside the loader (``building_tree``) nothing is raised, the loader collects the
    errors of the whole tree itself and reports them together."""
    if not _LOADER_BUILDING.get():
        errors = cfg.errors()
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


def one_of(cfg: Any, name: str, choices: Iterable[Any]) -> list[str]:
    """``name=value must be one of [...]`` when the value is not a choice."""
    choices = list(choices)
    value = getattr(cfg, name)
    return [] if value in choices else [f"{name}={value!r} must be one of {choices}"]


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
