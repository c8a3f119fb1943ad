"""What the trainer reports of multi-turn rollouts (``Completion.policy_mask`` and ``.trajectory``):
a step's ``multi_turn/`` figures and the turns a samples.jsonl row shows.

A multi-turn response alternates runs of tokens the policy sampled (its turns) with runs the
environment appended (tool results, or an interaction's reply, in the chat template's tokens);
``policy_mask`` tells them apart, and the ``TrajectoryRecord`` the environment closed the trajectory
with says what its tools and its interaction did. Single-turn completions have neither and get no
figures and no turns.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, get_args

from megatron_rlhf.rollout.engine import Completion, ToolErrorKind, TrajectoryRecord

POLICY_ROLE = "assistant"
ENVIRONMENT_ROLE = "environment"
"""An environment turn's role where the record's messages do not say (an ``Agent`` that keeps none)."""


def environment_roles(messages: Sequence[dict[str, str]]) -> list[str]:
    """The role of each run of the environment's messages (``tool`` or ``user``), in order: what
    each of a trajectory's environment turns held."""
    roles: list[str] = []
    for previous, message in zip([{"role": POLICY_ROLE}, *messages], messages, strict=False):
        if message["role"] != POLICY_ROLE and previous["role"] == POLICY_ROLE:
            roles.append(message["role"])
    return roles


def turn_spans(policy_mask: Sequence[bool]) -> list[tuple[bool, slice]]:
    """The runs of equal ``policy_mask`` values, in order: (sampled by the policy, its positions)."""
    spans: list[tuple[bool, slice]] = []
    start = 0
    for end in range(1, len(policy_mask) + 1):
        if end == len(policy_mask) or policy_mask[end] != policy_mask[start]:
            spans.append((policy_mask[start], slice(start, end)))
            start = end
    return spans


def trajectory_fields(
    completions: Sequence[Completion], decode_batch: Callable[[list[list[int]]], list[str]], stop_ids: Collection[int]
) -> list[dict[str, Any]]:
    """Each completion's samples.jsonl fields as a trajectory ({} for a single-turn one): ``turns``,
    ``[{role: assistant | tool | user, text}]`` decoded by one ``decode_batch`` call (special tokens
    kept: the turns show what the model read and wrote, the final stop token left out as in
    ``response``), and from its record ``num_turns``, ``tool_calls``, the ``tool_errors`` that
    happened and ``tool_rewards``; with an interaction also ``user_turns``, ``turn_scores``,
    ``interaction_errors`` and the first failure's text (``interaction_failure``)."""
    pieces: list[list[int]] = []
    spans_of: list[list[tuple[bool, slice]]] = []
    for c in completions:
        ids = c.text_ids(stop_ids)
        spans = turn_spans(c.policy_mask[: len(ids)]) if c.trajectory is not None and c.policy_mask else []
        spans_of.append(spans)
        pieces += [ids[span] for _, span in spans]
    texts = iter(decode_batch(pieces))
    fields: list[dict[str, Any]] = []
    for c, spans in zip(completions, spans_of, strict=True):
        record = c.trajectory
        if record is None:
            fields.append({})
            continue
        roles = iter(environment_roles(record["messages"]))
        row = {
            "turns": [
                {"role": POLICY_ROLE if policy else next(roles, ENVIRONMENT_ROLE), "text": next(texts)}
                for policy, _ in spans
            ],
            "num_turns": record["num_turns"],
            "tool_calls": record["tool_calls"],
            "tool_errors": {kind: n for kind, n in record["tool_errors"].items() if n},
            "tool_rewards": dict(record["tool_rewards"]),
        }
        if _had_interaction(record):
            row |= {key: record[key] for key in ("user_turns", "turn_scores", "interaction_errors")}
        if record["interaction_failure"]:
            row["interaction_failure"] = record["interaction_failure"]
        fields.append(row)
    return fields


def trajectory_metrics(completions: Sequence[Completion]) -> dict[str, float]:
    """A step's ``multi_turn/`` figures over its trajectories (none without one): turns and tool
    calls per trajectory (mean, max), tool errors of each kind per trajectory (every kind, 0 when
    none happened), seconds spent in tools per trajectory (mean, max), the policy's tokens and the
    environment's per trajectory, and the environment's share of all response tokens; where a
    trajectory had an interaction, its replies and errors per trajectory and its mean turn score."""
    records = [(c, c.trajectory) for c in completions if c.trajectory is not None]
    if not records:
        return {}
    count = len(records)
    turns = [r["num_turns"] for _, r in records]
    calls = [r["tool_calls"] for _, r in records]
    seconds = [r["tool_seconds"] for _, r in records]
    errors: dict[str, int] = dict.fromkeys(get_args(ToolErrorKind), 0)
    for _, record in records:
        for kind, n in record["tool_errors"].items():
            errors[kind] = errors.get(kind, 0) + n
    policy_tokens = sum(sum(c.policy_mask) if c.policy_mask is not None else len(c.token_ids) for c, _ in records)
    all_tokens = sum(len(c.token_ids) for c, _ in records)
    return {
        "multi_turn/num_turns/mean": sum(turns) / count,
        "multi_turn/num_turns/max": float(max(turns)),
        "multi_turn/tool_calls/mean": sum(calls) / count,
        "multi_turn/tool_calls/max": float(max(calls)),
        **{f"multi_turn/tool_errors/{kind}": n / count for kind, n in errors.items()},
        "multi_turn/tool_seconds/mean": sum(seconds) / count,
        "multi_turn/tool_seconds/max": max(seconds),
        "multi_turn/policy_tokens/mean": policy_tokens / count,
        "multi_turn/tool_tokens/mean": (all_tokens - policy_tokens) / count,
        "multi_turn/tool_token_fraction": (all_tokens - policy_tokens) / max(all_tokens, 1),
        **_interaction_metrics([r for _, r in records]),
    }


def _had_interaction(record: TrajectoryRecord) -> bool:
    """Whether an interaction replied to, scored or failed the trajectory."""
    return bool(record["user_turns"] or record["turn_scores"] or record["interaction_errors"])


def _interaction_metrics(records: Sequence[TrajectoryRecord]) -> dict[str, float]:
    if not any(_had_interaction(r) for r in records):
        return {}
    scores = [score for r in records for score in r["turn_scores"]]
    return {
        "multi_turn/user_turns/mean": sum(r["user_turns"] for r in records) / len(records),
        "multi_turn/interaction_errors": sum(r["interaction_errors"] for r in records) / len(records),
        **({"multi_turn/turn_score/mean": sum(scores) / len(scores)} if scores else {}),
    }
