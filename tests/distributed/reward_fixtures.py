"""Reward functions the PPO tests load by import path or file (kept apart from the tests so the
trainer imports them the way a user's would be imported)."""

from __future__ import annotations

import hashlib

from megatron_rlhf.rewards import Sample


def half_uniform(sample: Sample) -> float:
    """A constant score for about half of the prompts (picked by a hash of the prompt), the share of
    lowercase letters of the response for the others: half the groups carry no signal."""
    if hashlib.sha256(sample.prompt_text.encode()).digest()[0] % 2:
        return 0.5
    text = sample.response_text
    return sum(c.islower() for c in text) / len(text) if text else 0.0
