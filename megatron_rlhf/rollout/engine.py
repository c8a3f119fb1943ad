"""How the trainer generates (``RolloutEngine``), what generation returns (``Completion``), and the
environment a multi-turn rollout talks to between policy turns (``Agent``, ``Episode``).

The RL trainer (``trainer/ppo.py``) sees generation only through ``RolloutEngine``. Its one
implementation today is ``hybrid.engine.HybridEngine``: the native engine (``rollout/native.py``)
running in the actor's own memory, data parallel over the generation layout. Another backend (an
sglang server colocated with the actor) implements the same two members.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from concurrent.futures import Future
from typing import Literal, Protocol, TypedDict

from megatron_rlhf.metrics.phases import PhaseTimer
from megatron_rlhf.rollout.sampling import SamplingParams

FINISH_REASONS = ("stop", "length")

ToolCallErrorKind = Literal["malformed_json", "unknown_tool", "bad_arguments", "timeout", "exception"]
"""How a tool call failed: its answer to the model is an error message."""
ToolErrorKind = Literal[ToolCallErrorKind, "truncated", "over_limit"]
"""The keys of ``TrajectoryRecord.tool_errors``: a failed call's kind, ``truncated`` for an answer cut
at the length cap (still delivered), or ``over_limit`` for a call past a turn's max_parallel_calls
(neither run nor answered)."""


class TrajectoryRecord(TypedDict):
    """What an ``Episode`` reports of its whole trajectory when it closes: the trainer's multi-turn
    metrics, the reward function's ``extra_info`` additions and samples.jsonl read it."""

    num_turns: int
    """Turns of the conversation, as verl's agent loop counts them (its ``__num_turns__``)."""
    policy_turns: int
    """The policy's turns."""
    user_turns: int
    """The interaction's replies (user messages after a policy turn that called no tool)."""
    turn_scores: list[float]
    """The scores the interaction gave its replies, in order (verl's ``turn_scores``)."""
    interaction_errors: int
    """Interaction calls that raised or timed out: each ended its trajectory."""
    interaction_failure: str
    """The first such failure, as text ("" when none)."""
    tool_calls: int
    """Tool calls the policy made, failed ones included."""
    tool_errors: dict[ToolErrorKind, int]
    """Calls that went back to the model as an error, by kind (kinds without any may be absent)."""
    tool_seconds: float
    """Wall time the trajectory's tool calls took."""
    tool_rewards: dict[str, float]
    """Each tool's ``calc_reward``, by tool name: verl's ``rollout_reward_scores``, which a verl
    reward function reads from its ``extra_info``."""
    tool_call_rewards: list[float]
    """The rewards the tools' ``execute`` returned, call by call (verl's ``tool_rewards``)."""
    messages: list[dict[str, str]]
    """The conversation as the agent parsed it: ``{role, content}`` messages."""


@dataclasses.dataclass
class Completion:
    """One sample for one prompt. ``logprobs[i]`` is log p(token_ids[i]) under softmax(logits / T)
    over the full vocabulary, the same quantity the trainer recomputes."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "length"
    """stop: a stop/EOS token was produced (it is the last token); length: max_new_tokens or the
    context limit was reached."""
    prompt_tokens_dropped: int = 0
    """Tokens cut from the front of an over-long prompt (on_long_prompt=truncate), else 0."""
    policy_mask: list[bool] | None = None
    """Multi-turn: True where the policy sampled ``token_ids[i]``, False on the environment's tokens
    (tool results and the chat template's tokens around them; their ``logprobs`` are 0). None: a
    single-turn completion, every token the policy's."""
    trajectory: TrajectoryRecord | None = None
    """Multi-turn: what the environment reports of the whole trajectory (``Episode.close``): turns,
    tool calls and their errors, tool rewards. None for a single-turn completion."""

    def text_ids(self, stop_ids: Collection[int]) -> list[int]:
        """The response's ids without its final stop token: what its text is decoded from, with
        special tokens skipped as verl decodes the responses it scores (a stop id that is no special
        token would otherwise stay in the text). ``token_ids`` keeps every token."""
        ends_with_stop = self.finish_reason == "stop" and self.token_ids and self.token_ids[-1] in stop_ids
        return self.token_ids[:-1] if ends_with_stop else self.token_ids


@dataclasses.dataclass
class EnvironmentTurn:
    """What the environment appends after a policy turn: tokens the policy did not sample (a tool
    result or a user's reply rendered by the chat template), after which the policy goes on
    decoding; or, with ``ends``, nothing: the trajectory ends at the policy's turn."""

    token_ids: list[int]
    ends: bool = False


class Episode(Protocol):
    """One trajectory's environment (its tools' state). The engine calls ``after_turn`` each time a
    policy turn ends on a stop token, and ``close`` once when the trajectory is over."""

    def after_turn(self, turn_ids: list[int]) -> Future[EnvironmentTurn] | None:
        """The environment's answer to the policy's turn ``turn_ids`` (stop token included), or
        None when the trajectory ends here. A Future: tools and interactions run on host workers
        while the engine keeps decoding the other sequences; its turn may still end the trajectory
        (``EnvironmentTurn.ends``)."""
        ...

    def close(self) -> Future[TrajectoryRecord]:
        """Release the trajectory's tools; the Future of what ``Completion.trajectory`` records. The
        engine closes the trajectories that end together before it waits on any: each Future must
        resolve within the environment's own time limit, which other TP ranks wait on."""
        ...


class Agent(Protocol):
    """Makes each trajectory's ``Episode``: a multi-turn rollout's environment."""

    def episode(self, prompt_index: int, sample_index: int) -> Episode:
        """The environment of sample ``sample_index`` of prompt ``prompt_index`` (indices into the
        prompts the trainer passed to ``generate``)."""
        ...


class RolloutEngine(Protocol):
    """Generation from the actor's current weights, for the trainer."""

    @property
    def layout_description(self) -> str:
        """Where and in which layout generation runs, for the start-up report."""
        ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        timer: PhaseTimer | None = None,
        agent: Agent | None = None,
    ) -> list[Completion]:
        """``params.n`` completions per prompt from the actor's weights as they are now, ordered by
        (prompt_index, sample_index). Collective over the world: every rank passes the same prompts
        and gets every completion. ``timer`` gets the backend's own parts (weight refresh, memory
        switches, generation) under the phase it has open. With ``agent``, each completion is a
        multi-turn trajectory: policy turns interleaved with the environment's."""
        ...
