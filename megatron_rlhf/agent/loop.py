"""The tool-calling agent of a multi-turn rollout: ``ToolAgent`` (rollout/engine.py's ``Agent``) and its
``ToolEpisode`` (an ``Episode``, one per trajectory).

After each policy turn the engine hands over the turn's tokens; the episode parses its tool calls
(``multi_turn.format``), runs them on the agent's tool workers and answers with the tokens of the tool
messages as the chat template writes them, up to the next assistant generation prompt. Every failure
of a call becomes a tool message the model reads, counted by kind in the trajectory record. A turn
without calls goes to the prompt's interaction (``agent/interactions.py``), if it has one: its reply
comes back as a user message, or it ends the trajectory.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, get_args

from megatron_rlhf.agent.config import MultiTurnConfig
from megatron_rlhf.agent.executor import CallOutcome, ToolWorkers, gather_calls, truncate_middle
from megatron_rlhf.agent.interactions import interaction_of, load_interactions
from megatron_rlhf.agent.parsers import PARSERS, CallError, ParsedCall, ToolCall
from megatron_rlhf.agent.tools import argument_problems, call_method, load_tools, response_text, tool_name
from megatron_rlhf.data.chat_template import ChatTemplate, tool_schema_problem
from megatron_rlhf.data.datasets import RAW_PROMPT
from megatron_rlhf.data.tokenizer import Tokenizer
from megatron_rlhf.rollout.engine import EnvironmentTurn, ToolErrorKind, TrajectoryRecord

__all__ = ["AgentParts", "EnvironmentMessages", "ToolAgent", "ToolEpisode", "tools_kwargs_of"]

_ASSISTANT = "ASSISTANT-TURN-PLACEHOLDER"


class EnvironmentMessages:
    """Renders the environment's messages (tool results, an interaction's reply) as the text the chat
    template writes between the end of an assistant turn and the next assistant generation prompt.

    The template is rendered twice around a placeholder assistant turn: without the messages and
    without a generation prompt (A), and with both (B). What B adds to A, plus what A writes after the
    assistant's content (its end-of-turn text, less the stop token the policy itself sampled), is the
    environment's text: it depends on the messages only, not on the conversation before.
    """

    def __init__(self, template: ChatTemplate, variables: Mapping[str, Any] | None = None) -> None:
        self.template, self.variables = template, dict(variables or {})
        self._opening = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _ASSISTANT}]
        self._closed = template.render(self._opening, variables=self.variables, add_generation_prompt=False)
        if self._closed.count(_ASSISTANT) != 1:
            raise ValueError(f"{template.source}: the chat template does not write an assistant message's content once")
        self._turn_end = self._closed[self._closed.index(_ASSISTANT) + len(_ASSISTANT) :]

    def check(self, role: str) -> None:
        """Fail now, not mid-rollout, if the template cannot extend a trajectory with ``role`` messages."""
        self.text(["probe"], stop_text="", role=role)

    def text(self, contents: Sequence[str], stop_text: str, role: str = "tool") -> str:
        """The environment's text after a policy turn ending in ``stop_text``, for ``role`` messages
        with ``contents``."""
        messages = [{"role": role, "content": content} for content in contents]
        rendered = self.template.render([*self._opening, *messages], variables=self.variables)
        if not rendered.startswith(self._closed):
            raise ValueError(
                f"{self.template.source}: with {role} messages after an assistant turn the chat template "
                "rewrites the conversation before them, so a trajectory cannot be extended in place"
            )
        turn_end = self._turn_end.removeprefix(stop_text) if stop_text else self._turn_end
        return turn_end + rendered[len(self._closed) :]


@dataclasses.dataclass(frozen=True)
class AgentParts:
    """What a ``ToolAgent`` runs, built once from the multi-turn settings' files: the tools by function
    name and the interactions by name (either may be empty)."""

    tools: dict[str, Any]
    interactions: dict[str, Any]

    @classmethod
    def load(cls, config: MultiTurnConfig) -> AgentParts:
        return cls(
            load_tools(config.tool_config_path) if config.tool_config_path else {},
            load_interactions(config.interaction_config_path) if config.interaction_config_path else {},
        )

    def foreign_tools_warning(self, own_tools: Mapping[str, int]) -> str | None:
        """Tools that prompts offer through their own tools column (``DataReport.own_tools``: name ->
        prompts) and the agent does not run: the model is offered them, and each call of one is
        answered as an unknown tool. (``data.tools_file`` unlike the agent's is refused up front:
        ``MultiTurnConfig.offered_tools_errors``.)"""
        foreign = {name: count for name, count in own_tools.items() if name not in self.tools}
        if not foreign:
            return None
        offered = ", ".join(f"{name} ({count} prompts)" for name, count in sorted(foreign.items()))
        return (
            f"warning: prompts offer tools of their own (their tools column) that the agent does not run: {offered}; "
            f"the agent runs {sorted(self.tools)} (rollout.multi_turn.tool_config_path). The model is offered "
            "them, and each call of one is answered as an unknown tool (multi_turn/tool_errors/unknown_tool)"
        )

    def unrendered_tools_warning(self, tokenizer: Tokenizer) -> str | None:
        """A warning where the chat template writes nothing of the tools into a prompt: only a model
        trained to call them without their schemas (as the built-in arithmetic tool task's is, by SFT)
        will; any other makes no call, and every trajectory ends after one turn with no error."""
        template, probe = tokenizer.chat_template, [{"role": "user", "content": "?"}]
        if not self.tools or template is None:
            return None  # ToolAgent refuses a tokenizer without a template
        if template.render(probe, tools=[tool.tool_schema for tool in self.tools.values()]) != template.render(probe):
            return None
        return (
            f"warning: {template.source}: the chat template writes nothing of the tools' schemas into the prompt "
            "(it renders the same with and without them): the policy is not told of the tools, and calls them "
            "only if trained to; a model tuned for tool use wants a template that renders `tools` (e.g. "
            "Qwen2.5's, Qwen3's, Llama 3.1's)"
        )


def tools_kwargs_of(extra_info: Mapping[str, Any] | None, tool_names: Sequence[str], where: str) -> dict[str, dict]:
    """A prompt's ``create_kwargs`` per tool, from verl's ``extra_info.tools_kwargs[tool].create_kwargs``;
    ``ValueError`` (naming ``where``) for a malformed entry, an unknown tool, or ``need_tools_kwargs``
    without any (verl only warns: here a tool would silently miss its ground truth)."""
    extra_info = extra_info or {}
    tools_kwargs = extra_info.get("tools_kwargs") or {}
    if not isinstance(tools_kwargs, Mapping):
        raise ValueError(
            f"{where}.tools_kwargs: expected a mapping tool name -> {{create_kwargs: {{...}}}}, "
            f"got {tools_kwargs!r:.80}"
        )
    if extra_info.get("need_tools_kwargs") and not tools_kwargs:
        raise ValueError(f"{where}: need_tools_kwargs is true but tools_kwargs is empty")
    create_kwargs: dict[str, dict] = {}
    for name, kwargs in tools_kwargs.items():
        if kwargs is None:
            continue  # parquet writes a struct's absent fields (another row's tools) as null
        if name not in tool_names:
            raise ValueError(f"{where}.tools_kwargs: {name!r} is not a tool of the tools file {sorted(tool_names)}")
        create = kwargs.get("create_kwargs") if isinstance(kwargs, Mapping) else None
        if not isinstance(kwargs, Mapping) or not isinstance(create or {}, Mapping):
            raise ValueError(f"{where}.tools_kwargs.{name}: expected {{create_kwargs: {{...}}}}, got {kwargs!r:.80}")
        create_kwargs[name] = dict(create or {})
    return create_kwargs


class ToolAgent:
    """The environment of multi-turn trajectories: the tools and the interactions (each built once,
    from its file), the workers that run their calls (``ToolWorkers``), and each prompt's ``create_kwargs`` and
    interaction.

    ``extra_infos``: each prompt's extras (None where a row has none), in prompt order: verl's
    ``tools_kwargs`` and ``interaction_kwargs``, and the conversation an interaction reads first
    (``RAW_PROMPT``, where the loader kept it).
    ``template_variables``: the chat template's variables of the prompts (``data.chat_template_kwargs``).
    Call ``shutdown`` when done with it (or use it as a context manager).
    """

    def __init__(
        self,
        config: MultiTurnConfig,
        tokenizer: Tokenizer,
        tools: Mapping[str, Any],
        extra_infos: Sequence[Mapping[str, Any] | None],
        template_variables: Mapping[str, Any] | None = None,
        interactions: Mapping[str, Any] | None = None,
    ) -> None:
        if tokenizer.chat_template is None:
            raise ValueError(
                f"{tokenizer!r} has no chat template: multi-turn rollouts render the environment's messages "
                "with it (rollout.multi_turn.enable needs a chat model's tokenizer)"
            )
        for name, tool in tools.items():
            schema: Any = getattr(tool, "tool_schema", None)
            problem = tool_schema_problem(schema, f"tool {name!r}: its tool_schema")
            if problem is None and tool_name(schema) != name:
                problem = f"tool {name!r}: its tool_schema names the function {tool_name(schema)!r}"
            if problem is not None:
                raise ValueError(f"{problem} (tools are keyed by their schema's function name, see load_tools)")
        self.config, self.tokenizer, self.tools = config, tokenizer, dict(tools)
        self.interactions = dict(interactions or {})
        self.parse = PARSERS.get(config.format)
        self.messages = EnvironmentMessages(tokenizer.chat_template, template_variables)
        for role, needed in (("tool", self.tools), ("user", self.interactions)):
            if needed:
                self.messages.check(role)
        self.create_kwargs = [
            tools_kwargs_of(extra, list(self.tools), f"prompt {i}: extra_info") for i, extra in enumerate(extra_infos)
        ]
        self.interaction_of = [
            interaction_of(extra, list(self.interactions), f"prompt {i}: extra_info")
            for i, extra in enumerate(extra_infos)
        ]
        self.extra_infos = extra_infos
        self.workers = ToolWorkers(config.tool_workers, "agent-tool")

    def episode(self, prompt_index: int, sample_index: int) -> ToolEpisode:
        return ToolEpisode(self, prompt_index, sample_index)

    def shutdown(self) -> None:
        """Stop the workers (calls still queued are dropped; running ones finish in the background)."""
        self.workers.shutdown()

    def __enter__(self) -> ToolAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class ToolEpisode:
    """One trajectory: its tools' instances (created on a tool's first call, with the prompt's
    ``create_kwargs``; released at ``close``), its interaction's instance (started on its first
    reply, with the prompt's ``interaction_kwargs``; finalized at ``close``) and its record.
    ``after_turn`` and ``close`` come from the engine's thread, calls finish on the workers': the
    record is updated under a lock."""

    def __init__(self, agent: ToolAgent, prompt_index: int, sample_index: int) -> None:
        self.agent, self.prompt_index, self.sample_index = agent, prompt_index, sample_index
        self._lock = threading.Lock()
        self._creating = threading.Lock()  # not the record's lock: a create that hangs delays no timeout
        self._instances: dict[str, str] = {}
        self._conversation: str | None = None  # the interaction's instance, once started
        self._closed = False
        self.policy_turns = self.tool_turns = self.tool_calls = self.truncated = self.over_limit = 0
        self.user_turns = self.interaction_errors = 0
        self.interaction_failure = ""
        self.errors: dict[ToolErrorKind, int] = dict.fromkeys(get_args(ToolErrorKind), 0)
        self.tool_seconds = 0.0
        self.call_rewards: list[float] = []
        self.turn_scores: list[float] = []
        self.messages: list[dict[str, str]] = []

    def after_turn(self, turn_ids: list[int]) -> Future[EnvironmentTurn] | None:
        agent, config = self.agent, self.agent.config
        text = agent.tokenizer.decode(turn_ids[:-1])
        stop_text = agent.tokenizer.decode(turn_ids[-1:])
        with self._lock:
            self.policy_turns += 1
            self.messages.append({"role": "assistant", "content": text})
            environment_turns = self.tool_turns + self.user_turns
        if (config.max_assistant_turns and self.policy_turns >= config.max_assistant_turns) or (
            config.max_user_turns and environment_turns >= config.max_user_turns
        ):
            return None
        parsed = agent.parse(text) if agent.tools else []
        calls = parsed[: config.max_parallel_calls]
        if len(parsed) > len(calls):
            with self._lock:
                self.over_limit += len(parsed) - len(calls)
        if calls:
            return gather_calls(
                agent.workers,
                [functools.partial(self._call, call) for call in calls],
                config.tool_timeout_s,
                lambda i: CallOutcome(
                    f"Error: the call to {_name(calls[i])} did not finish within {config.tool_timeout_s} s",
                    "timeout",
                    seconds=config.tool_timeout_s,
                ),
                lambda outcomes: self._environment_turn(outcomes, stop_text),
            )
        chosen = agent.interaction_of[self.prompt_index]
        if chosen is None:
            return None
        return gather_calls(
            agent.workers,
            [self._reply],
            config.tool_timeout_s,
            lambda _: CallOutcome(f"{chosen[0]}: no answer within {config.tool_timeout_s} s", "timeout", ends=True),
            lambda outcomes: self._user_turn(outcomes[0], stop_text),
        )

    def _reply(self) -> CallOutcome:
        """The interaction's answer to the policy's turn, run on a worker. Its failure ends the
        trajectory (counted in ``interaction_errors``): it is the environment's fault, not the model's."""
        chosen = self.agent.interaction_of[self.prompt_index]
        assert chosen is not None, "after_turn asks for a reply only where the prompt has an interaction"
        name, kwargs = chosen
        interaction = self.agent.interactions[name]
        try:
            if self._conversation is None:  # replies come one at a time: no other worker starts it
                wanted = f"{self.prompt_index}-{self.sample_index}-{name}-{uuid.uuid4().hex[:8]}"
                started = call_method(interaction.start_interaction, wanted, **kwargs) or wanted
                with self._lock:
                    closed = self._closed
                    if not closed:
                        self._conversation = started
                if closed:  # closed while starting: close() has not seen this instance
                    call_method(interaction.finalize_interaction, started, **kwargs)
                    raise RuntimeError("the trajectory is closed")
            prompt = (self.agent.extra_infos[self.prompt_index] or {}).get(RAW_PROMPT) or []
            with self._lock:  # the whole conversation, as verl hands it: the prompt's messages first
                messages = [dict(m) for m in (*prompt, *self.messages)]
            ends, response, score, _ = call_method(
                interaction.generate_response, self._conversation, messages, **kwargs
            )
            return CallOutcome(response_text(response), reward=None if score is None else float(score), ends=bool(ends))
        except BaseException as exc:  # the user's code: any failure, SystemExit included, is its own
            return CallOutcome(f"{name}: {type(exc).__name__}: {exc}", "exception", ends=True)

    def _user_turn(self, outcome: CallOutcome, stop_text: str) -> EnvironmentTurn:
        """The interaction's reply as a user message the policy reads next, or the trajectory's end."""
        with self._lock:
            if outcome.error is not None:
                self.interaction_errors += 1
                self.interaction_failure = self.interaction_failure or outcome.text
            if outcome.reward is not None:
                self.turn_scores.append(outcome.reward)
            if outcome.error is None:
                self.messages.append({"role": "user", "content": outcome.text})
            if outcome.ends:
                return EnvironmentTurn([], ends=True)
            self.user_turns += 1
        text = self.agent.messages.text([outcome.text], stop_text, role="user")
        return EnvironmentTurn(self.agent.tokenizer.encode(text))

    def _call(self, call: ParsedCall) -> CallOutcome:
        """One call, run on a worker; every failure is an outcome (a tool is the user's code: any
        exception, SystemExit included, is its failure, never the run's). What the tool wrote (its
        answer, its exception) is truncated to max_tool_response_length; our own messages are not."""
        if isinstance(call, CallError):
            return CallOutcome(f"Error: {call.message}", call.kind)
        tool = self.agent.tools.get(call.name)
        if tool is None:
            return CallOutcome(
                f"Error: unknown tool {call.name!r}; the tools are {sorted(self.agent.tools)}", "unknown_tool"
            )
        problems = argument_problems(tool.tool_schema, call.arguments)
        if problems:
            return CallOutcome(f"Error: wrong arguments for {call.name}: {'; '.join(problems)}", "bad_arguments")
        limit = self.agent.config.max_tool_response_length
        try:
            result = call_method(tool.execute, self._instance(call.name), call.arguments)
            response, reward = (result[0], result[1]) if isinstance(result, tuple) else (result, None)
            text, cut = truncate_middle(response_text(response), limit)
            return CallOutcome(text, reward=None if reward is None else float(reward), truncated=cut)
        except BaseException as exc:
            text, cut = truncate_middle(f"{type(exc).__name__}: {exc}", limit)
            return CallOutcome(f"Error: {call.name} failed: {text}", "exception", truncated=cut)

    def _instance(self, name: str) -> str:
        """The trajectory's instance of tool ``name``, created on its first call."""
        with self._creating:
            if name not in self._instances:
                if self._closed:
                    raise RuntimeError("the trajectory is closed")
                tool = self.agent.tools[name]
                create_kwargs = self.agent.create_kwargs[self.prompt_index].get(name, {})
                wanted = f"{self.prompt_index}-{self.sample_index}-{name}-{uuid.uuid4().hex[:8]}"
                created = call_method(tool.create, wanted, create_kwargs=create_kwargs)
                instance_id = created[0] if isinstance(created, tuple) else created
                with self._lock:
                    closed = self._closed
                    if not closed:
                        self._instances[name] = instance_id
                if closed:  # closed while creating: close() has not seen this instance
                    call_method(tool.release, instance_id)
                    raise RuntimeError("the trajectory is closed")
            return self._instances[name]

    def _environment_turn(self, outcomes: list[CallOutcome], stop_text: str) -> EnvironmentTurn:
        with self._lock:
            for outcome in outcomes:
                self.messages.append({"role": "tool", "content": outcome.text})
                self.tool_calls += 1
                self.truncated += outcome.truncated
                self.tool_seconds += outcome.seconds
                if outcome.error is not None:
                    self.errors[outcome.error] += 1
                if outcome.reward is not None:
                    self.call_rewards.append(outcome.reward)
            self.tool_turns += 1
        text = self.agent.messages.text([outcome.text for outcome in outcomes], stop_text)
        return EnvironmentTurn(self.agent.tokenizer.encode(text))

    def close(self) -> Future[TrajectoryRecord]:
        """Ask each created tool instance its reward, release it, finalize the interaction's instance;
        the Future of the trajectory record. These calls run on the workers, and the Future resolves
        within ``tool_timeout_s`` of this call however they fare (a tool's failure or timeout counts as
        a tool error, reward 0; the interaction's as an interaction error): a hanging tool cannot stall
        the engine's thread, and the trajectories that end at one decode step close side by side.
        ``num_turns`` counts as verl's tool agent loop does (assistant turns + user turns + 1): the
        prompt, each policy turn, each tool turn and each reply of the interaction."""
        with self._lock:
            self._closed = True
            instances = list(self._instances.items())
            conversation = self._conversation
        calls = [functools.partial(self._finish, name, instance) for name, instance in instances]
        chosen = self.agent.interaction_of[self.prompt_index]
        if chosen is not None and conversation is not None:
            interaction = self.agent.interactions[chosen[0]]
            calls.append(functools.partial(self._finalize, interaction, conversation, chosen[1]))
        timeout_s = self.agent.config.tool_timeout_s
        return gather_calls(
            self.agent.workers,
            calls,
            timeout_s,
            lambda _: CallOutcome("", "timeout"),
            functools.partial(self._record, [name for name, _ in instances]),
            deadline_s=timeout_s,
        )

    def _record(self, tools: list[str], outcomes: list[CallOutcome]) -> TrajectoryRecord:
        rewards: dict[str, float] = {}
        for name, outcome in zip(tools, outcomes, strict=False):
            rewards[name] = 0.0 if outcome.error or outcome.reward is None else outcome.reward
            if outcome.error:
                self.errors[outcome.error] += 1
        if len(outcomes) > len(tools) and outcomes[-1].error:
            self.interaction_errors += 1
        return {
            "num_turns": 1 + self.policy_turns + self.tool_turns + self.user_turns,
            "policy_turns": self.policy_turns,
            "user_turns": self.user_turns,
            "turn_scores": list(self.turn_scores),
            "interaction_errors": self.interaction_errors,
            "interaction_failure": self.interaction_failure,
            "tool_calls": self.tool_calls,
            "tool_errors": {**self.errors, "truncated": self.truncated, "over_limit": self.over_limit},
            "tool_seconds": self.tool_seconds,
            "tool_rewards": rewards,
            "tool_call_rewards": list(self.call_rewards),
            "messages": list(self.messages),
        }

    @staticmethod
    def _finalize(interaction: Any, conversation: str, kwargs: Mapping[str, Any]) -> CallOutcome:
        call_method(interaction.finalize_interaction, conversation, **kwargs)
        return CallOutcome("")

    def _finish(self, name: str, instance_id: str) -> CallOutcome:
        tool = self.agent.tools[name]
        try:
            return CallOutcome("", reward=float(call_method(tool.calc_reward, instance_id)))
        finally:
            call_method(tool.release, instance_id)


def _name(call: ParsedCall) -> str:
    return call.name if isinstance(call, ToolCall) else "a tool"
