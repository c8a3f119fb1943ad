"""A rank's share of the rule and function scores: its completions decoded into samples, then the
rules and the function called on each. Run by the scorer's thread or by a worker process
(``workers.py``); apart from ``scoring.py`` so that a worker imports no megatron-core."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from megatron_rlhf.data.tokenizer import Tokenizer
from megatron_rlhf.rollout.engine import Completion

from .calls import RewardCalls, Watched
from .config import CUSTOM_FUNCTION
from .custom import CustomRewardFunction, CustomScores
from .rules import RewardRule, Sample, rule_scores

Share = tuple[dict[str, list[float]], CustomScores | None]
"""A rank's rule and function scores of its samples, by part, and what the function returned."""
Decoder = Callable[[list[list[int]]], list[str]]
"""Token rows to the texts rewards read."""


def reward_texts(tokenizer: Tokenizer) -> Decoder:
    """Token rows as rewards, rules and samples.jsonl read them: special tokens skipped, as verl
    decodes the prompts and responses its reward functions read."""
    return functools.partial(tokenizer.decode_batch, skip_special_tokens=True)


def decoded_samples(
    completions: Sequence[Completion],
    decode_batch: Decoder,
    stop_ids: Collection[int],
    extras: Sequence[dict[str, Any]] | None = None,
) -> list[Sample]:
    """The completions as rules read them (``extras[c.prompt_index]`` the prompt row's extra
    columns, none if not given), decoded by one ``decode_batch`` call: each prompt once, not once
    per sample of it, and every response without its final stop token."""
    prompts = {c.prompt_index: c.prompt_ids for c in completions}
    texts = decode_batch([*prompts.values(), *(c.text_ids(stop_ids) for c in completions)])
    prompt_texts = dict(zip(prompts, texts[: len(prompts)], strict=True))
    return [
        Sample(
            c.prompt_ids,
            c.token_ids,
            prompt_texts[c.prompt_index],
            response,
            c.finish_reason,
            extras[c.prompt_index] if extras is not None else {},
            c.trajectory,
        )
        for c, response in zip(completions, texts[len(prompts) :], strict=True)
    ]


def share_scores(
    rules: Mapping[str, RewardRule],
    function: CustomRewardFunction | None,
    completions: Sequence[Completion],
    rows: Sequence[int],
    extras: Sequence[dict[str, Any]],
    decode_batch: Decoder,
    stop_ids: Collection[int],
    calls: RewardCalls,
) -> Share:
    """The rules' and the function's scores of ``completions`` (rows ``rows`` of the rollout)."""
    samples = decoded_samples(completions, decode_batch, stop_ids, extras)
    scores = rule_scores(dict(rules), samples, calls, rows)
    custom = function.score(samples, calls, rows) if function is not None else None
    if custom is not None:
        scores[CUSTOM_FUNCTION] = custom.scores
    return scores, custom


def watched_share(
    rules: Mapping[str, RewardRule],
    function: CustomRewardFunction | None,
    completions: Sequence[Completion],
    rows: Sequence[int],
    extras: Sequence[dict[str, Any]],
    decode_batch: Decoder,
    stop_ids: Collection[int],
    timeout_s: float,
) -> Watched[Share]:
    """``share_scores`` begun on a thread of its own, its calls limited to ``timeout_s`` each: how
    the scorer's thread and each worker process run a share."""
    calls = RewardCalls(timeout_s)
    job = functools.partial(share_scores, rules, function, completions, rows, extras, decode_batch, stop_ids, calls)
    return Watched(job, calls)
