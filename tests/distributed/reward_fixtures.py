"""Reward functions the PPO tests load by import path or file (kept apart from the tests so the
trainer imports them the way a user's would be imported)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from megatron_rlhf.rewards import Sample
from megatron_rlhf.rewards.rules import lowercase_fraction


def half_uniform(sample: Sample) -> float:
    """A constant score for about half of the prompts (picked by a hash of the prompt), the share of
    lowercase letters of the response for the others: half the groups carry no signal."""
    if hashlib.sha256(sample.prompt_text.encode()).digest()[0] % 2:
        return 0.5
    text = sample.response_text
    return sum(c.islower() for c in text) / len(text) if text else 0.0


def constant(sample: Sample) -> float:
    """The same score for every response: no group has a spread, so every GRPO advantage is 0."""
    return 1.0


def hostile_after(sample: Sample) -> float:
    """``lowercase_fraction``, until the run has logged ``HOSTILE_AFTER_STEPS`` training steps in
    ``HOSTILE_METRICS`` (its metrics.jsonl, a step counter that a rollback does not turn back); then,
    on training prompts, its opposite (1 - the share), which trains the policy away from lowercase.
    Validation prompts (their ``split`` column is ``validation``) are always scored honestly, so
    the validation figures fall once the training reward has turned."""
    honest = lowercase_fraction(sample)
    if sample.extras.get("split") == "validation":
        return honest
    metrics = Path(os.environ["HOSTILE_METRICS"])
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    done = sum(json.loads(line).get("split") == "train" for line in lines if line.strip())
    return 1.0 - honest if done >= int(os.environ["HOSTILE_AFTER_STEPS"]) else honest
