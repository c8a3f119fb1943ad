"""Speed-of-light figures for the benchmarks: a model's work, and the least time a device takes for it.

The benchmarks (``update.py``, ``rollout.py``, ``e2e.py``) compare a measured time with the least
time the device could take for the same work, given the device's ceilings measured in the same run
(``common.matmul_peak``, ``common.copy_bandwidth``):

* work: FLOPs per token of a forward (``2 N + 4 L h s``) and of a training step (three times that,
  ``6 N + 12 L h s``, the convention of the PaLM and Megatron papers: N the parameters without the
  input embedding, a lookup; ``L h s`` the attention scores and values at context s, counted over
  the whole context as those papers do), and the bytes a decode step reads (all weights but the input
  embedding, and the KV cache so far).

``rl_step_floor`` adds them up for one GRPO/PPO step: prefill and the training passes at the matmul
peak, each decode step at its roofline (the larger of its FLOPs at the peak and its bytes at the
memory rate), the optimizer step at the memory rate. Everything else (rewards, advantages, the
host) counts zero: a floor, not a prediction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.models.hf_weights import hf_tensor_shapes

ADAM_BYTES_PER_PARAM = 30
"""Memory traffic of one Adam step per parameter with fp32 main parameters and a bf16 model copy:
read the fp32 gradient, main parameter and two moments (16), write the main parameter and the
moments (12) and the bf16 parameter (2)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelWork:
    """A causal LM's work per token. ``params``: all parameters; ``embedding``: the input
    embedding's (a lookup, no FLOPs; a decode step does not read it whole)."""

    params: int
    embedding: int
    num_layers: int
    hidden_size: int
    kv_bytes_per_token: int  # K and V of every layer, at the model's dtype
    dtype_bytes: int

    @classmethod
    def of(cls, arch: Architecture, dtype_bytes: int = 2) -> ModelWork:
        shapes = hf_tensor_shapes(arch)
        params = sum(_numel(shape) for shape in shapes.values())
        embedding = 0 if arch.tie_word_embeddings else _numel(shapes["model.embed_tokens.weight"])
        kv = 2 * arch.num_layers * arch.num_query_groups * arch.head_dim * dtype_bytes
        return cls(
            params=params,
            embedding=embedding,
            num_layers=arch.num_layers,
            hidden_size=arch.hidden_size,
            kv_bytes_per_token=kv,
            dtype_bytes=dtype_bytes,
        )

    @property
    def matmul_params(self) -> int:
        return self.params - self.embedding

    def forward_flops_per_token(self, context: float) -> float:
        """FLOPs of one token's forward at context ``context``: 2 N + 4 L h s."""
        return 2 * self.matmul_params + 4 * self.num_layers * self.hidden_size * context

    def train_flops_per_token(self, context: float) -> float:
        """Forward and backward: 6 N + 12 L h s."""
        return 3 * self.forward_flops_per_token(context)

    def weight_bytes(self) -> int:
        """Bytes a decode step reads for the weights (all but the input embedding)."""
        return self.matmul_params * self.dtype_bytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepShape:
    """One RL step's rows: ``num_sequences`` rows of ``prompt_len`` + ``response_len`` tokens."""

    num_sequences: int
    prompt_len: int
    response_len: int

    @property
    def tokens(self) -> int:
        return self.num_sequences * (self.prompt_len + self.response_len)


def forward_seconds(work: ModelWork, shape: StepShape, *, flops_per_s: float) -> float:
    """One forward-only pass over every row at the matmul peak. Every row is s tokens; the attention
    term at the mean causal context is s / 2 per token, but the convention counts the whole context
    (as update.py's MFU does): s."""
    s = shape.prompt_len + shape.response_len
    return shape.tokens * work.forward_flops_per_token(s) / flops_per_s


def update_seconds(work: ModelWork, shape: StepShape, *, flops_per_s: float, bytes_per_s: float) -> dict[str, float]:
    """One optimizer step over every row: the training passes at the matmul peak (``train``), Adam at
    the memory rate (``optimizer``)."""
    return {
        "train": 3 * forward_seconds(work, shape, flops_per_s=flops_per_s),
        "optimizer": work.params * ADAM_BYTES_PER_PARAM / bytes_per_s,
    }


def generate_seconds(work: ModelWork, shape: StepShape, *, flops_per_s: float, bytes_per_s: float) -> dict[str, float]:
    """The rollout: the prompts' prefill at the matmul peak, then each decode step at its roofline."""
    b, p, r = shape.num_sequences, shape.prompt_len, shape.response_len
    prefill = b * p * work.forward_flops_per_token(p) / flops_per_s
    decode_compute = decode_memory = decode = 0.0
    for t in range(1, r):  # the prefill gives the first response token; each later one is a decode step
        context = p + t
        step_flops = b * work.forward_flops_per_token(context) / flops_per_s
        step_bytes = (work.weight_bytes() + b * context * work.kv_bytes_per_token) / bytes_per_s
        decode_compute += step_flops
        decode_memory += step_bytes
        decode += max(step_flops, step_bytes)
    return {
        "prefill": prefill,
        "decode": decode,
        "decode_compute_bound": decode_compute,
        "decode_memory_bound": decode_memory,
    }


def rl_step_floor(
    policy: ModelWork,
    shape: StepShape,
    *,
    flops_per_s: float,
    bytes_per_s: float,
    forward_passes: Sequence[ModelWork] = (),
    updated: Sequence[ModelWork] | None = None,
) -> dict[str, float]:
    """The least seconds of each part of one RL step (see the module docstring) and their sum, ``step``.

    ``policy`` generates; ``forward_passes`` lists the model of each forward-only pass over all rows
    (reference and old log-probs: the policy's work; values: the critic's; the reward model's);
    ``updated`` the models that take one optimizer step each (default: the policy)."""
    rates = {"flops_per_s": flops_per_s, "bytes_per_s": bytes_per_s}
    gen = generate_seconds(policy, shape, **rates)
    updates = [update_seconds(work, shape, **rates) for work in ((policy,) if updated is None else updated)]
    parts = {
        "prefill": gen["prefill"],
        "decode": gen["decode"],
        "forward_passes": sum(forward_seconds(work, shape, flops_per_s=flops_per_s) for work in forward_passes),
        "train": sum(u["train"] for u in updates),
        "optimizer": sum(u["optimizer"] for u in updates),
    }
    return {
        **parts,
        "decode_compute_bound": gen["decode_compute_bound"],
        "decode_memory_bound": gen["decode_memory_bound"],
        "generate": gen["prefill"] + gen["decode"],
        "step": sum(parts.values()),
    }
