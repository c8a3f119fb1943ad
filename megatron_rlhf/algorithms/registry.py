"""Tiny name -> function registry.

Each registry holds functions that share ONE signature, so call sites do
``REGISTRY.get(config.name)(**kwargs)`` and never branch on the name itself. What a caller must
know about an entry beyond calling it (an advantage estimator needs a critic, say) is declared with
it at registration (``info=``) and read with ``REGISTRY.info(name)``.
Unknown names fail loudly with the valid choices and the closest spelling,
because a typo in a YAML config should not cost a cluster allocation.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable)

__all__ = ["Registry"]


class Registry[F: Callable]:
    """Maps names (and aliases) to functions of a single shared signature."""

    def __init__(self, kind: str) -> None:
        # ``kind`` is a human-readable label used in error messages,
        # e.g. "advantage estimator".
        self.kind = kind
        self._fns: dict[str, F] = {}
        self._info: dict[str, Any] = {}

    def register(self, name: str, *aliases: str, info: Any = None) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name`` and any ``aliases``, with what callers must
        know about it (``info``, read back with ``info(name)``)."""

        def deco(fn: F) -> F:
            for key in (name, *aliases):
                if key in self._fns:
                    raise ValueError(f"{self.kind} {key!r} is already registered")
                self._fns[key] = fn
                self._info[key] = info
            return fn

        return deco

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests that register a temporary entry clean up with it)."""
        del self._fns[name], self._info[name]

    def get(self, name: str) -> F:
        """Return the function registered as ``name``; ValueError if unknown."""
        try:
            return self._fns[name]
        except (KeyError, TypeError):
            pass
        raise ValueError(f"Unknown {self.kind} {name!r}. Valid names: {sorted(self._fns)}.{self._hint(name)}")

    def field_errors(self, field: str, value: object) -> list[str]:
        """For a config dataclass's ``errors()``: the field ``field`` must name an entry."""
        if isinstance(value, str) and value in self._fns:
            return []
        return [f"{field}={value!r} must be one of {list(self.names())} (unknown {self.kind}.{self._hint(value)})"]

    def _hint(self, name: object) -> str:
        scored = sorted(self._fns, key=lambda k: difflib.SequenceMatcher(None, str(name), k).ratio(), reverse=True)
        return f" Did you mean {scored[0]!r}?" if scored else ""

    def info(self, name: str) -> Any:
        """What was declared with ``name`` at registration; ValueError if unknown."""
        self.get(name)
        return self._info[name]

    def names(self) -> tuple[str, ...]:
        """All registered names (including aliases), sorted."""
        return tuple(sorted(self._fns))

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self.names())})"
