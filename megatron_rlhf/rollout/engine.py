"""The interface every generation backend implements, and what it returns.

The trainer only sees ``RolloutEngine.generate``: the native engine (``rollout/native.py``) is the
default; sglang or megatron's ``DynamicInferenceEngine`` can plug in behind the same call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from megatron_rlhf.rollout.sampling import SamplingParams

FINISH_REASONS = ("stop", "length")


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

    def text_ids(self, stop_ids: Sequence[int]) -> list[int]:
        """The response's ids without its final stop token: what its text is decoded from, with
        special tokens skipped as verl decodes the responses it scores (a stop id that is no special
        token would otherwise stay in the text). ``token_ids`` keeps every token."""
        ends_with_stop = self.finish_reason == "stop" and self.token_ids and self.token_ids[-1] in stop_ids
        return self.token_ids[:-1] if ends_with_stop else self.token_ids


class RolloutEngine(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """``params.n`` completions per prompt, ordered by (prompt_index, sample_index).
        Collective over the generation model's tensor-parallel group: every rank returns the same."""
        ...
