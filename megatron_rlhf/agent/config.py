"""The multi-turn settings (``rollout.multi_turn.*``, verl's ``actor_rollout_ref.rollout.multi_turn``),
apart from the agent so that checking a config builds no tools' workers."""

from __future__ import annotations

import dataclasses

from megatron_rlhf.agent.interactions import load_interactions
from megatron_rlhf.agent.parsers import PARSERS
from megatron_rlhf.agent.tools import load_tools
from megatron_rlhf.config.fields import at_least, check_on_init, file_errors

__all__ = ["MultiTurnConfig"]


@dataclasses.dataclass(kw_only=True)
class MultiTurnConfig:
    enable: bool = False
    """Multi-turn rollouts: a policy turn that calls tools is followed by the tools' results (rendered
    by the chat template as tool messages), one that calls none by the interaction's reply (a user
    message) where there is an interaction, and the policy goes on, in the same sequence."""
    max_assistant_turns: int = 0
    """Policy turns per trajectory (0: no limit but rollout.sampling.max_new_tokens, which bounds the
    whole response, tool results included)."""
    max_user_turns: int = 0
    """Environment turns per trajectory, tool results and interaction replies together, as verl counts
    them (0: no limit but max_assistant_turns and max_new_tokens)."""
    tool_config_path: str = ""
    """The tools, in verl's tool_config_path YAML (tools: [{class_name, config, tool_schema}]); checked
    up front: each class imported and built."""
    interaction_config_path: str = ""
    """The interactions, in verl's interaction_config_path YAML (interaction: [{name, class_name,
    config}]); a prompt picks one by its extra_info.interaction_kwargs.name. Checked up front."""
    format: str = "hermes"
    """How the policy writes tool calls (the parser): hermes, Qwen2.5's <tool_call>{json}</tool_call>."""
    max_parallel_calls: int = 1
    """Tool calls run per policy turn; further calls in the same turn are ignored, as verl does, and
    counted (the trajectory record's tool_errors over_limit)."""
    tool_timeout_s: float = 30.0
    """A call still running after this long answers the model with a timeout error."""
    max_tool_response_length: int = 256
    """Characters of a tool's answer (or of its exception) kept; a longer one keeps its head and tail
    (verl's middle truncation) and is counted as truncated."""
    tool_workers: int = 4
    """Tool calls of all trajectories running at once, each on a host thread; one past
    tool_timeout_s gives its place to the next (its thread finishes in the background). While 8 x
    tool_workers such threads still run, new calls are refused (an exception error, and a warning)."""

    def __post_init__(self) -> None:
        check_on_init(self)

    @property
    def interactions_read_prompts(self) -> bool:
        """Whether the prompts' conversations must be kept (the loader's ``keep_raw_prompt``): an
        interaction reads the whole conversation, the prompt's messages first, as in verl."""
        return self.enable and bool(self.interaction_config_path)

    def offered_tools_errors(self, tools_file: str) -> list[str]:
        """The prompts' tools (``data.tools_file``) against the agent's: the model would be offered
        tools that are not run, and every call answered "unknown tool"."""
        if not (self.enable and tools_file and tools_file != self.tool_config_path):
            return []
        return [
            f"data.tools_file={tools_file!r} offers the prompts other tools than the agent runs "
            f"(rollout.multi_turn.tool_config_path={self.tool_config_path!r}): name the same file"
        ]

    def errors(self) -> list[str]:
        errors = at_least(self, 0, "max_assistant_turns", "max_user_turns")
        errors += at_least(self, 1, "max_parallel_calls", "tool_workers")
        errors += at_least(self, 1, "max_tool_response_length")
        if not self.tool_timeout_s > 0:
            errors.append(f"tool_timeout_s={self.tool_timeout_s} must be > 0")
        errors += PARSERS.field_errors("format", self.format)
        if self.enable and not (self.tool_config_path or self.interaction_config_path):
            errors.append(
                "tool_config_path: multi-turn rollouts (enable=true) need the tools file, or an "
                "interactions file (interaction_config_path)"
            )
        given = [name for name in ("tool_config_path", "interaction_config_path") if getattr(self, name)]
        if given and not self.enable:
            errors.append(f"{' and '.join(given)} given, but enable=false: rollouts are single-turn; set enable=true")
        errors += file_errors("tool_config_path", self.tool_config_path, load_tools)
        return errors + file_errors("interaction_config_path", self.interaction_config_path, load_interactions)
