"""A config as YAML with each setting's docstring as a comment above it: what ``--print-config``
prints. Comments are all the annotation, so the text loads again as a config file
(``--config FILE.yaml``) and gives the same config."""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any

import yaml
from omegaconf import OmegaConf

from megatron_rlhf.config.fields import field_docs

WIDTH = 100
"""Comment lines are wrapped to this many columns, indentation included."""
INDENT = "  "


def annotated_yaml(cfg: Any, header: str = "") -> str:
    """The dataclass tree ``cfg`` as YAML, each field's docstring a comment above its key and indented
    with it; ``header``'s lines first, as comments."""
    values = OmegaConf.to_container(OmegaConf.structured(cfg))
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    return "\n".join(lines + _section_lines(cfg, values, "")) + "\n"


def _section_lines(cfg: Any, values: Any, indent: str) -> list[str]:
    cls: type = type(cfg)
    docs = field_docs(cls)
    lines: list[str] = []
    for field in dataclasses.fields(cfg):
        doc = docs.get(field.name)
        if doc:
            wrapped = textwrap.wrap(doc, WIDTH - len(indent) - 2, break_long_words=False, break_on_hyphens=False)
            lines += [f"{indent}# {line}" for line in wrapped]
        value = getattr(cfg, field.name)
        if dataclasses.is_dataclass(value) and dataclasses.fields(value):
            lines.append(f"{indent}{field.name}:")
            lines += _section_lines(value, values[field.name], indent + INDENT)
        else:
            lines.append(f"{indent}{field.name}: {_flow(values[field.name])}")
    return lines


def _flow(value: Any) -> str:
    """``value`` as one line of YAML (lists and mappings in flow style)."""
    dumped = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**9)
    return dumped.removesuffix("\n").removesuffix("\n...")
