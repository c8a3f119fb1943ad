"""Loss and output functions that turn a model's output on one micro-batch into numbers.

Shapes: a micro-batch holds ``input_ids (b, s)``; an LM outputs vocab-parallel logits
``(b, s, Vp/tp)``, a score head ``(b, s, 1)``. Token-level quantities are aligned with the token
they score: position t of ``logprobs (b, s-1)`` is log p(input_ids[t+1] | input_ids[:t+1]), and the
matching masks are the input masks shifted by one (``mask[:, 1:]``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_rlhf.algorithms import aggregate_loss
from megatron_rlhf.engine.logprobs import token_logprobs_and_entropy
from megatron_rlhf.engine.schedule import Batch, LossFn, OutputFn
from megatron_rlhf.models.roles import RoleModel


def next_token_logprobs(
    role: RoleModel, piece: Batch, logits: torch.Tensor, *, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(b, s-1) log-probs of each next token, and optionally the entropy there."""
    return token_logprobs_and_entropy(
        logits[:, :-1],
        piece["input_ids"][:, 1:],
        tp_group=role.groups.pg_collection.tp,
        vocab_size=role.arch.vocab_size,
        temperature=temperature,
        compute_entropy=with_entropy,
    )


def logprobs_output(role: RoleModel, *, temperature: float = 1.0) -> OutputFn:
    """Forward-only: (b, s-1) next-token log-probs (reference policy, old policy)."""
    return lambda piece, logits: next_token_logprobs(role, piece, logits, temperature=temperature)[0]


def values_output() -> OutputFn:
    """Forward-only: (b, s) per-token scores of a score head."""
    return lambda piece, values: values[..., 0].float()


def sft_loss(role: RoleModel) -> LossFn:
    """Next-token negative log-likelihood on response tokens (``loss_mask`` 1), token-mean."""

    def loss(piece: Batch, logits: torch.Tensor):
        logprobs, _ = next_token_logprobs(role, piece, logits)
        mask = piece["loss_mask"][:, 1:].float()
        numerator, denominator = aggregate_loss(-logprobs, mask, "token-mean")
        return numerator, denominator, {"nll_token_mean": numerator / denominator.clamp(min=1)}

    return loss


def bradley_terry_loss() -> LossFn:
    """Reward-model loss: -log sigmoid(r_chosen - r_rejected) per pair, mean over pairs.

    Rows come in (chosen, rejected) pairs, adjacent; the reward of a row is the score at its last
    real token. Micro-batches never split a pair (see ``group_size`` in ``micro_batches``).
    """

    def loss(piece: Batch, values: torch.Tensor):
        last = piece["attention_mask"].sum(dim=1) - 1
        rewards = values[torch.arange(values.shape[0], device=values.device), last, 0].float()
        chosen, rejected = rewards[0::2], rewards[1::2]
        margin = chosen - rejected
        numerator = -F.logsigmoid(margin).sum()
        denominator = torch.tensor(margin.numel(), device=margin.device)
        return numerator, denominator, {"accuracy": (margin > 0).float().mean(), "margin": margin.mean()}

    return loss
