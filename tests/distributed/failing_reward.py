"""A reward rule that fails on its first sample: a run that dies at step 1, after its start-up wrote
config.yaml (loaded by import path, as a user's rule would be)."""

from __future__ import annotations

from megatron_rlhf.rewards import Sample


def fails(sample: Sample) -> float:
    raise ValueError(f"failing_reward.fails: no score for {sample.prompt_text[:20]!r}")
