"""Tools a multi-turn rollout calls, in verl's ``BaseTool`` shape, and the tools file that declares them.

A tool is a class built as ``cls(config, tool_schema)`` with four methods, each either a plain or an
``async def`` method (verl's are async: a verl tool ports by changing its imports):

* ``create(instance_id, **kwargs) -> (instance_id, response)``: the tool's state for one trajectory
  (``kwargs["create_kwargs"]``: the prompt row's ``extra_info.tools_kwargs[name].create_kwargs``);
* ``execute(instance_id, parameters, **kwargs) -> (response, reward, metrics)``: one call, with the
  call's arguments (a dict checked against the schema first); ``response`` is a string or anything
  with a ``text`` attribute (verl's ``ToolResponse``), ``reward`` a number or None, ``metrics`` a dict;
* ``calc_reward(instance_id, **kwargs) -> float``: the trajectory's tool reward, asked once at its end;
* ``release(instance_id, **kwargs)``: drops the state.

The tools file is verl's ``tool_config_path`` YAML (``tools: [{class_name, config, tool_schema}]``),
read by ``data.chat_template.load_tool_entries``; ``class_name`` is imported by its dotted path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from megatron_rlhf.config.fields import did_you_mean
from megatron_rlhf.data.chat_template import load_tool_entries

__all__ = [
    "BaseTool",
    "ToolResponse",
    "argument_problems",
    "call_method",
    "import_class",
    "load_tools",
    "response_text",
    "tool_name",
]


@dataclasses.dataclass
class ToolResponse:
    """What a call returns to the model (verl's ``ToolResponse``, text only)."""

    text: str = ""


class BaseTool:
    """A tool that keeps no state: subclasses override ``execute`` (and the others when they keep
    state per trajectory). ``tool_schema`` is the OpenAI function schema, a plain dict (verl's is a
    pydantic model: ``schema.function.name`` becomes ``schema["function"]["name"]``, or ``self.name``)."""

    def __init__(self, config: Mapping[str, Any], tool_schema: Mapping[str, Any]) -> None:
        self.config = dict(config)
        self.tool_schema = dict(tool_schema)
        self.name = tool_name(tool_schema)

    def create(self, instance_id: str, **kwargs: Any) -> tuple[str, ToolResponse]:
        return instance_id, ToolResponse()

    def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse | str, float | None, dict[str, Any]]:
        raise NotImplementedError(f"{type(self).__name__}.execute")

    def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    def release(self, instance_id: str, **kwargs: Any) -> None:
        return None


def tool_name(schema: Mapping[str, Any]) -> str:
    """The function name an OpenAI function schema declares."""
    return str(schema["function"]["name"])


def call_method(method: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a tool's method, sync or async: a coroutine runs to completion on an event loop of its own
    (the caller is a worker thread, which has none)."""
    result = method(*args, **kwargs)
    return asyncio.run(result) if inspect.isawaitable(result) else result  # type: ignore[arg-type]


def response_text(response: Any) -> str:
    """The text of what ``execute`` returned as its response: a string, or an object with ``text``."""
    if isinstance(response, str):
        return response
    if not hasattr(response, "text"):
        raise TypeError(
            f"execute returned a response of type {type(response).__name__}, not a string nor a ToolResponse"
        )
    return "" if response.text is None else str(response.text)


def import_class(class_name: Any, where: str, methods: tuple[str, ...], base: str) -> type:
    """The class a file entry names by its dotted path, with each of ``methods`` (``base``: the
    module whose base class documents them); ``ValueError`` names ``where`` and the problem."""
    if not isinstance(class_name, str) or "." not in class_name:
        raise ValueError(f"{where}: expected a dotted class path (package.module.Class), got {class_name!r:.80}")
    module_name, _, attribute = class_name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: any failure to import it is reported as such
        hint = (
            " (verl's own classes import verl, which is not installed here: port the class)"
            if module_name.startswith("verl.")
            else ""
        )
        raise ValueError(f"{where}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}{hint}") from exc
    cls = getattr(module, attribute, None)
    if not isinstance(cls, type):
        classes = sorted(name for name, value in vars(module).items() if isinstance(value, type))
        raise ValueError(
            f"{where}: module {module_name!r} has no class {attribute!r}{did_you_mean(attribute, classes)}"
        )
    missing = [name for name in methods if not callable(getattr(cls, name, None))]
    if missing:
        raise ValueError(f"{where}: class {class_name} lacks the methods {missing} (see megatron_rlhf.{base})")
    return cls


_TOOL_METHODS = ("create", "execute", "calc_reward", "release")


def load_tools(path: str) -> dict[str, Any]:
    """The tools of a tools file, built and keyed by their function name; ``ValueError`` names the
    file, the entry's field and what was expected."""
    tools: dict[str, Any] = {}
    for i, entry in enumerate(load_tool_entries(path)):
        where = f"{path}: tools[{i}]"
        cls = import_class(entry.get("class_name"), f"{where}.class_name", _TOOL_METHODS, "agent.tools.BaseTool")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ValueError(f"{where}.config: expected a mapping (or nothing), got {config!r:.60}")
        name = tool_name(entry["tool_schema"])
        if name in tools:
            raise ValueError(f"{where}.tool_schema.function.name: {name!r} names an earlier tool too")
        try:
            tools[name] = cls(config, entry["tool_schema"])
        except Exception as exc:  # the user's constructor
            raise ValueError(
                f"{where}: {entry['class_name']}(config, tool_schema) failed: {type(exc).__name__}: {exc}"
            ) from exc
    return tools


# JSON Schema type -> the Python types json.loads gives for it (bool is no integer in JSON).
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _has_json_type(value: Any, kind: str) -> bool:
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    return isinstance(value, _JSON_TYPES.get(kind, (object,)))


def argument_problems(schema: Mapping[str, Any], arguments: Mapping[str, Any]) -> list[str]:
    """What is wrong with a call's arguments for the function ``schema`` declares: missing required
    keys, keys it does not declare, values of another JSON type than declared (empty: none)."""
    parameters = schema["function"].get("parameters")
    parameters = parameters if isinstance(parameters, dict) else {}
    properties = parameters.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    problems = [
        f"missing required argument {key!r}" for key in parameters.get("required") or [] if key not in arguments
    ]
    for key, value in arguments.items():
        if key not in properties:
            problems.append(f"unknown argument {key!r} (the function takes {sorted(properties)})")
            continue
        declared = properties[key].get("type") if isinstance(properties[key], dict) else None
        kinds = [declared] if isinstance(declared, str) else list(declared or [])
        if kinds and not any(_has_json_type(value, kind) for kind in kinds):
            problems.append(f"argument {key!r} must be of type {' or '.join(kinds)}, got {_json_type(value)}")
    return problems


def _json_type(value: Any) -> str:
    """The JSON name of a decoded JSON value's type."""
    for kind in ("boolean", "integer", "number", "string", "array", "object", "null"):
        if _has_json_type(value, kind):
            return kind
    return type(value).__name__
