"""Tool-call parsers: a policy turn's text -> the tool calls it makes, by model family.

Each parser returns the turn's calls in text order; a call it cannot read is a ``CallError`` in its
place (sent back to the model as a tool message, counted by kind), never an exception: a policy that
writes bad JSON is a normal event of RL, not a crash. ``multi_turn.format`` names the parser.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any

from megatron_rlhf.algorithms.registry import Registry
from megatron_rlhf.rollout.engine import ToolCallErrorKind

__all__ = ["PARSERS", "CallError", "ErrorKind", "ParsedCall", "ToolCall"]

ErrorKind = ToolCallErrorKind
"""How a tool call failed; each kind is counted in the trajectory record."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the function's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class CallError:
    """A call that failed, and the message the model reads about it."""

    kind: ErrorKind
    message: str


ParsedCall = ToolCall | CallError

PARSERS: Registry[Callable[[str], list[ParsedCall]]] = Registry("tool-call format")


def _call_of(payload: str) -> ParsedCall:
    """One ``{"name": ..., "arguments": {...}}`` payload read."""
    try:
        call = json.loads(payload)
    except json.JSONDecodeError as exc:
        return CallError("malformed_json", f"the tool call is not valid JSON: {exc.msg} at character {exc.pos}")
    if not isinstance(call, dict):
        return CallError(
            "malformed_json",
            f'the tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, got {payload.strip()[:80]}',
        )
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return CallError("malformed_json", 'the tool call has no "name" (a non-empty string)')
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return CallError(
            "bad_arguments",
            f'the "arguments" of a call to {name} must be a JSON object, got {json.dumps(arguments)[:80]}',
        )
    return ToolCall(name, arguments)


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@PARSERS.register("hermes")
def parse_hermes(text: str) -> list[ParsedCall]:
    """Qwen2.5 / Hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one or more
    per turn; a block the turn leaves open is malformed."""
    calls: list[ParsedCall] = []
    for match in _HERMES_BLOCK.finditer(text):
        if not match.group(2):
            calls.append(CallError("malformed_json", "the tool call is not closed with </tool_call>"))
        else:
            calls.append(_call_of(match.group(1)))
    return calls
