"""Tiny name -> function registry.

Each registry holds functions that share ONE signature, so call sites do
``REGISTRY.get(config.name)(**kwargs)`` and never branch on the name itself.
Unknown names fail loudly with the valid choices and the closest spelling,
because a typo in a YAML config should not cost a cluster allocation.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)

__all__ = ["Registry"]


class Registry(Generic[F]):
    """Maps names (and aliases) to functions of a single shared signature."""

    def __init__(self, kind: str) -> None:
        # ``kind`` is a human-readable label used in error messages,
        # e.g. "advantage estimator".
        self.kind = kind
        self._fns: dict[str, F] = {}

    def register(self, name: str, *aliases: str) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name`` and any ``aliases``."""

        def deco(fn: F) -> F:
            for key in (name, *aliases):
                if key in self._fns:
                    raise ValueError(f"{self.kind} {key!r} is already registered")
                self._fns[key] = fn
            return fn

        return deco

    def get(self, name: str) -> F:
        """Return the function registered as ``name``; ValueError if unknown."""
        try:
            return self._fns[name]
        except (KeyError, TypeError):
            pass
        valid = sorted(self._fns)
        scored = sorted(
            valid, key=lambda k: difflib.SequenceMatcher(None, str(name), k).ratio(), reverse=True
        )
        hint = f" Did you mean {scored[0]!r}?" if scored else ""
        raise ValueError(f"Unknown {self.kind} {name!r}. Valid names: {valid}.{hint}")

    def names(self) -> tuple[str, ...]:
        """All registered names (including aliases), sorted."""
        return tuple(sorted(self._fns))

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self.names())})"
