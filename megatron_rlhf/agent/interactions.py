"""Interactions: the user's side of a multi-turn rollout, in verl's ``BaseInteraction`` shape.

After a policy turn that calls no tool, the prompt's interaction answers as the user (a hint, "try
again", the next question) and the policy goes on, or it ends the trajectory. An interaction is a
class built as ``cls(config)`` (the file entry's ``config``, with ``name`` added, as verl passes it)
with these methods, each plain or ``async def`` (verl's are async: a verl interaction ports by
changing its imports):

* ``start_interaction(instance_id, **kwargs) -> str``: its state for one trajectory (``kwargs``: the
  prompt row's ``extra_info.interaction_kwargs``, e.g. the ground truth);
* ``generate_response(instance_id, messages, **kwargs) -> (should_terminate_sequence, response, score,
  metrics)``: ``messages`` is the conversation so far ({role, content}), as verl hands it: the
  prompt's messages (the loader keeps a conversation prompt's for such runs: ``RAW_PROMPT``), then
  the policy's turns, tool results and earlier replies; ``response`` the user's reply, ``score``
  this turn's reward (None: none), ``metrics`` a dict;
* ``finalize_interaction(instance_id, **kwargs)``: drops the state.

The interactions file is verl's ``interaction_config_path`` YAML: ``interaction: [{name, class_name,
config}]``. A prompt picks its interaction by ``extra_info.interaction_kwargs.name``; where the file
holds one interaction the name may be left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_rlhf.agent.tools import import_class
from megatron_rlhf.data.chat_template import check_entry_fields, entry_shape, verl_file_entries

__all__ = ["BaseInteraction", "interaction_of", "load_interactions"]


class BaseInteraction:
    """An interaction that keeps no state: subclasses override ``generate_response`` (and the others
    when they keep state per trajectory)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = dict(config)
        self.name = str(self.config.get("name", "interaction_agent"))

    def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        return instance_id or ""

    def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float | None, dict[str, Any]]:
        raise NotImplementedError(f"{type(self).__name__}.generate_response")

    def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        return None


_METHODS = ("start_interaction", "generate_response", "finalize_interaction")
_BASE = "agent.interactions.BaseInteraction"


FIELDS = ("name", "class_name", "config")
"""The fields of an interactions file's entry (verl's)."""


def load_interactions(path: str) -> dict[str, Any]:
    """The interactions of an interactions file, built and keyed by name; ``ValueError`` names the
    file, the entry's field and what was expected. An entry without ``name`` is named after its
    class, less an ``Interaction`` suffix, in lower case (``Gsm8kInteraction``: ``gsm8k``)."""
    interactions: dict[str, Any] = {}
    entries = verl_file_entries(
        Path(path),
        "interaction",
        "interactions",
        FIELDS,
        "interaction_config_path",
        nonempty=True,
    )
    for i, entry in enumerate(entries):
        where = f"{path}: interaction[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a mapping {entry_shape(FIELDS)}, got {entry!r:.60}")
        check_entry_fields(where, entry, FIELDS)
        cls = import_class(entry.get("class_name"), f"{where}.class_name", _METHODS, _BASE)
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ValueError(f"{where}.config: expected a mapping (or nothing), got {config!r:.60}")
        name = entry.get("name") or cls.__name__.removesuffix("Interaction").lower()
        if not isinstance(name, str):
            raise ValueError(f"{where}.name: expected a string, got {name!r:.60}")
        if name in interactions:
            raise ValueError(f"{where}.name: {name!r} names an earlier interaction too")
        try:
            interactions[name] = cls({**config, "name": name})
        except Exception as exc:  # the user's constructor
            raise ValueError(f"{where}: {entry['class_name']}(config) failed: {type(exc).__name__}: {exc}") from exc
    return interactions


def interaction_of(
    extra_info: Mapping[str, Any] | None, names: Sequence[str], where: str
) -> tuple[str, dict[str, Any]] | None:
    """The interaction a prompt talks to and its keywords, from verl's ``extra_info.interaction_kwargs``
    (``name`` picks it; left out, the file's only one); None when there are no interactions.
    ``ValueError`` (naming ``where``) for an unknown or missing name."""
    if not names:
        return None
    kwargs = dict((extra_info or {}).get("interaction_kwargs") or {})
    name = kwargs.get("name")
    if name is None and len(names) == 1:
        return names[0], kwargs
    if name not in names:
        said = "names no interaction" if name is None else f"names {name!r}"
        raise ValueError(
            f"{where}.interaction_kwargs: {said}; the interactions file has {sorted(names)} "
            "(each prompt picks one by interaction_kwargs.name)"
        )
    return str(name), kwargs
