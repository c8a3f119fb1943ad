"""A model's Jinja chat template, rendered as transformers' ``apply_chat_template`` renders it.

Chat prompts must turn into the token ids the model was fine-tuned on, so rendering follows
transformers 5.x (``utils/chat_template_utils.py``) step by step:

* an immutable sandboxed Jinja environment (templates come from model repositories: untrusted
  code) with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, and a
  ``{% generation %}`` block that renders its body (transformers uses it to mark assistant text);
* ``raise_exception(message)``, ``strftime_now(format)`` and a ``tojson`` filter that, unlike
  Jinja's own, neither HTML-escapes nor ASCII-escapes;
* the variables ``messages`` (keys whose value is null dropped, as transformers does: parquet
  structs fill absent fields with null and templates test for presence), ``add_generation_prompt``
  (true for prompts; a multi-turn agent also renders a conversation without it to find where an
  assistant turn ends), ``tools`` (the tool schemas, or None), ``documents``
  (None), the tokenizer's special-token strings (``bos_token``, ``eos_token``, ...) and the caller's
  own variables (``enable_thinking``: transformers' ``**kwargs``), which win over the special tokens.

Tool schemas are OpenAI function schemas, ``{type: function, function: {name, description,
parameters}}``, as templates read them (``tool | tojson``, ``tool.function.name``); a tools file is
verl's ``tool_config_path`` YAML: ``load_tool_entries`` reads and checks it once; prompts need only
each tool's ``tool_schema`` (``load_tool_schemas``), the agent (``agent/tools.py``) also its class.

The rendered text is then tokenized with no special tokens added: the template writes them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import yaml
from jinja2.sandbox import ImmutableSandboxedEnvironment

from megatron_rlhf.config.fields import did_you_mean

__all__ = [
    "RESERVED_VARIABLES",
    "SPECIAL_TOKEN_VARIABLES",
    "ChatTemplate",
    "ChatTemplateError",
    "check_entry_fields",
    "entry_shape",
    "load_tool_entries",
    "load_tool_schemas",
    "template_variable_errors",
    "tool_schema_problem",
    "tools_file_path",
    "verl_file_entries",
]

# The special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES), when set.
SPECIAL_TOKEN_VARIABLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Names a caller's template variables may not take: the variables rendering sets itself, and the
# arguments of transformers' apply_chat_template (verl passes its apply_chat_template_kwargs there, so
# such a key changes how transformers renders or tokenizes instead of reaching the template).
RESERVED_VARIABLES = (
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "tokenize",
    "sanitize_control_tokens",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
)


class ChatTemplateError(ValueError):
    """The template rejected a conversation (``raise_exception``) or failed while rendering it."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it; the
    rendered text is just the body."""

    tags: ClassVar[set[str]] = {"generation"}  # type: ignore[misc]  # jinja2 declares Extension.tags without ClassVar

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template and the special-token strings it is rendered with.

    ``source`` names where the template came from (a file, or a field of one), for error messages.
    It pickles as its text, compiled again on loading (for data-loading worker processes).
    """

    def __init__(self, template: str, source: str, special_tokens: Mapping[str, str]) -> None:
        try:
            self._template = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(
                f"{source}: the chat template does not compile: {exc.message} (line {exc.lineno})"
            ) from exc
        self.text, self.source = template, source
        self.special_tokens = dict(special_tokens)

    def __reduce__(self) -> tuple[type[ChatTemplate], tuple[str, str, dict[str, str]]]:
        return ChatTemplate, (self.text, self.source, self.special_tokens)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The conversation as prompt text, ending with the generation prompt (the assistant's turn)
        unless ``add_generation_prompt`` is false. ``tools``: the schemas the template offers the
        model; ``variables``: more template variables (not named in ``RESERVED_VARIABLES``;
        ``template_variable_errors`` checks them)."""
        chat = [{key: value for key, value in message.items() if value is not None} for message in messages]
        try:
            return self._template.render(
                messages=chat,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **(variables or {})},
            )
        except Exception as exc:  # the template is the model's code: any failure is its verdict on these messages
            raise ChatTemplateError(f"the chat template ({self.source}) failed: {type(exc).__name__}: {exc}") from exc

    def __repr__(self) -> str:
        return f"ChatTemplate({self.source!r})"


def template_variable_errors(setting: str, variables: Mapping[str, Any]) -> list[str]:
    """Problems with a caller's template variables (``setting`` names them in the messages)."""
    return [
        f"{setting}: key {name!r} is not a template variable of its own: the renderer sets it (tool schemas go "
        "in data.tools_file or a row's tools column)"
        for name in variables
        if name in RESERVED_VARIABLES
    ]


def tool_schema_problem(schema: Any, where: str) -> str | None:
    """What makes ``schema`` (found at ``where``, e.g. ``tools[0].tool_schema``) no OpenAI function
    schema: its bad field and what was expected; None for a schema."""
    if not isinstance(schema, dict):
        return (
            f"{where}: expected an OpenAI function schema {{type: function, function: {{name, description, "
            f"parameters}}}}, got {type(schema).__name__} {schema!r:.60}"
        )
    function = schema.get("function")
    if not isinstance(function, dict):
        return f"{where}.function: expected an object {{name, description, parameters}}, got {function!r:.60}"
    if not isinstance(function.get("name"), str) or not function["name"]:
        got = f"{function.get('name')!r:.60}"
        return f"{where}.function.name: expected the function's name (a non-empty string), got {got}"
    if schema.get("type", "function") != "function":
        return f"{where}.type: expected 'function' (or no type), got {schema['type']!r:.60}"
    return _parameters_problem(function.get("parameters"), f"{where}.function.parameters")


JSON_SCHEMA_TYPES = ("string", "integer", "number", "boolean", "array", "object", "null")


def _parameters_problem(parameters: Any, where: str) -> str | None:
    """What makes a function's ``parameters`` no JSON Schema of an object whose ``required``
    arguments are among its ``properties`` (None: fine, or absent): the calls the model makes are
    checked against it, so a slip here would refuse every call, mid-run."""
    if parameters is None:
        return None
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        return f"{where}: expected a JSON Schema {{type: object, properties, required}}, got {parameters!r:.60}"
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict):
        return f"{where}.properties: expected a mapping of argument name -> schema, got {properties!r:.60}"
    for name, spec in properties.items():
        kinds = spec.get("type") if isinstance(spec, dict) else None
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not isinstance(spec, dict) or (kinds is not None and not set(kinds) <= set(JSON_SCHEMA_TYPES)):
            expected = f"a schema whose type is one of {list(JSON_SCHEMA_TYPES)}"
            return f"{where}.properties.{name}: expected {expected}, got {spec!r:.60}"
    required = parameters.get("required", [])
    unknown = [r for r in required if r not in properties] if isinstance(required, list) else required
    if unknown:
        return f"{where}.required: {unknown!r:.60} are not among its properties {list(properties)}"
    return None


BUILTIN_TOOLS_DIR = Path(__file__).resolve().parents[1] / "config" / "tools"
BUILTIN_TOOLS_FILES = tuple(sorted(p.stem for p in BUILTIN_TOOLS_DIR.glob("*.yaml")))
"""``builtin:calculator`` (the Calculator) and ``builtin:python`` (the sandboxed Python tool)."""


def tools_file_path(path: str | Path) -> Path:
    """Where a tools file is: ``builtin:NAME`` is this package's ``config/tools/NAME.yaml``; a
    missing file or an unknown built-in name is a ``ValueError`` naming it."""
    text = str(path)
    if text.startswith("builtin:"):
        name = text.removeprefix("builtin:")
        if name not in BUILTIN_TOOLS_FILES:
            raise ValueError(f"{text}: no such built-in tools file; the built-in ones are {list(BUILTIN_TOOLS_FILES)}")
        return BUILTIN_TOOLS_DIR / f"{name}.yaml"
    if not Path(path).is_file():
        raise ValueError(f"{path}: the tools file does not exist")
    return Path(path)


def verl_file_entries(
    path: Path, key: str, noun: str, fields: tuple[str, ...], setting: str, *, nonempty: bool = False
) -> list[Any]:
    """The top-level ``key`` list of one of verl's YAML files (its ``setting``: a tools or an
    interactions file); ``ValueError`` names the file and says what was expected (``fields``: those
    of one entry, any other is refused as a slip; ``nonempty``: at least one)."""
    entry = entry_shape(fields)
    try:
        content = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the {noun} file: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from exc
    entries = content.get(key) if isinstance(content, dict) else None
    if not isinstance(entries, list) or (nonempty and not entries):
        raise ValueError(
            f"{path}: {key}: expected a top-level '{key}' list of {entry} (verl's {setting} format), "
            f"got {entries!r:.60}"
        )
    return entries


def entry_shape(fields: tuple[str, ...]) -> str:
    """How one entry of a verl file looks, for messages: ``{name, class_name, config}``."""
    return "{" + ", ".join(fields) + "}"


def check_entry_fields(where: str, item: dict[str, Any], fields: tuple[str, ...]) -> None:
    """A ``ValueError`` for a field of one entry of a verl file (at ``where``) that is none of
    ``fields``: a slip that would otherwise be dropped unseen (``confg:``)."""
    unknown = sorted(set(item) - set(fields))
    if unknown:
        raise ValueError(
            f"{where}: unknown field(s) {unknown}, expected {entry_shape(fields)}{did_you_mean(unknown[0], fields)}"
        )


def load_tool_entries(path: str | Path) -> list[dict[str, Any]]:
    """The tools of a tools file in verl's ``tool_config_path`` format (YAML, ``tools: [{class_name,
    config, tool_schema}]``), in file order, each with a valid ``tool_schema``; ``ValueError`` names
    the file and the bad field. The other fields are checked by their reader (``agent/tools.py``).
    ``builtin:NAME`` is a tools file of this package (``BUILTIN_TOOLS_FILES``)."""
    path = tools_file_path(path)
    fields = ("class_name", "config", "tool_schema")
    tools = verl_file_entries(path, "tools", "tools", fields, "tool_config_path")
    if not tools:
        raise ValueError(f"{path}: tools is empty: a tools file offers the model at least one tool")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or "tool_schema" not in tool:
            raise ValueError(
                f"{path}: tools[{i}].tool_schema: missing (MCP tools, whose schemas come from their "
                f"server, are not supported); the entry is {tool!r:.80}"
            )
        problem = tool_schema_problem(tool["tool_schema"], f"tools[{i}].tool_schema")
        if problem is not None:
            raise ValueError(f"{path}: {problem}")
        check_entry_fields(f"{path}: tools[{i}]", tool, fields)
    return tools


def load_tool_schemas(path: str | Path) -> list[dict[str, Any]]:
    """The ``tool_schema`` of each tool of a tools file (``load_tool_entries``), in file order."""
    return [tool["tool_schema"] for tool in load_tool_entries(path)]
