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
  (always true here: these are prompts), ``tools`` and ``documents`` (None), and the tokenizer's
  special-token strings (``bos_token``, ``eos_token``, ...).

The rendered text is then tokenized with no special tokens added: the template writes them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError", "SPECIAL_TOKEN_VARIABLES"]

# The special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES), when set.
SPECIAL_TOKEN_VARIABLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template rejected a conversation (``raise_exception``) or failed while rendering it."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it; the
    rendered text is just the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_GenerationBlock, jinja2.ext.loopcontrols])  # fmt: skip
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
            raise ValueError(f"{source}: the chat template does not compile: {exc.message} "
                             f"(line {exc.lineno})") from exc
        self.text, self.source = template, source
        self.special_tokens = dict(special_tokens)

    def __reduce__(self) -> tuple[type[ChatTemplate], tuple[str, str, dict[str, str]]]:
        return ChatTemplate, (self.text, self.source, self.special_tokens)

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The conversation as prompt text, ending with the generation prompt (the assistant's turn)."""
        chat = [{key: value for key, value in message.items() if value is not None} for message in messages]
        try:
            return self._template.render(messages=chat, tools=None, documents=None, add_generation_prompt=True,
                                         **self.special_tokens)  # fmt: skip
        except Exception as exc:  # the template is the model's code: any failure is its verdict on these messages
            raise ChatTemplateError(f"the chat template ({self.source}) failed: {type(exc).__name__}: {exc}") from exc

    def __repr__(self) -> str:
        return f"ChatTemplate({self.source!r})"
