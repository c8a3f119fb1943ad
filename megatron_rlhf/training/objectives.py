"""Loss and output functions that turn a model's output on one micro-batch into numbers.

Shapes: a micro-batch holds ``input_ids (b, s)``; an LM outputs vocab-parallel logits
``(b, s, Vp/tp)``, a score head ``(b, s, 1)``.

Token-level tensors in a batch (``old_logprobs``, ``ref_logprobs``, ``advantages``, ``returns``,
``old_values``, ``response_mask``, ``loss_mask``) are aligned with ``input_ids``: column t is about
token t (column 0, the first token, is never scored). A micro-batch may pack several sequences into
one row; losses read every token-aligned tensor one row per sequence (``_scored``: ``(n, s-1)``,
tokens 1.. of each sequence), so per-sequence aggregations and ``UpdateLogprobs`` see rows as if
unpacked.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rlhf.algorithms import (
    aggregate_loss,
    entropy_bonus,
    kl_loss,
    ppo_policy_loss,
    value_loss,
)
from megatron_rlhf.models.roles import RoleModel
from megatron_rlhf.training.config import PPOLossConfig
from megatron_rlhf.training.logprobs import token_logprobs_and_entropy
from megatron_rlhf.training.schedule import Batch, LossFn, LossOutput, Metric, OutputFn, rows_of


def next_token_logprobs(
    role: RoleModel, piece: Batch, logits: torch.Tensor, *, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(b, s-1) log-probs of tokens 1..s-1, and optionally the policy entropy at each of them. When
    the batch has a ``logits_mask`` the logits are (1, k, V) at the piece's ``logit_index`` only
    (see ``engine.schedule``), and every other position gets 0."""
    settings = {
        "tp_group": role.groups.pg_collection.tp,
        "vocab_size": role.arch.vocab_size,
        "temperature": temperature,
        "compute_entropy": with_entropy,
    }
    if "logit_index" not in piece:
        return token_logprobs_and_entropy(logits[:, :-1], piece["input_ids"][:, 1:], **settings)
    b, s = piece["input_ids"].shape
    index = piece["logit_index"]
    if index.numel() == 0:  # nothing scored in this piece; still a function of the output (backward needs one)
        zeros = logits.sum().float() * 0 + torch.zeros(b, s - 1, device=logits.device)
        return zeros, zeros if with_entropy else None
    # the LM head's logits at the scored positions serve this call alone: their gradient may take their memory
    logprobs, entropy = token_logprobs_and_entropy(
        logits, piece["logit_target"][None], **settings, overwrite_logits=True
    )

    def spread(x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(b * s).index_put((index,), x[0]).view(b, s)[:, :-1]

    return spread(logprobs), None if entropy is None else spread(entropy)


def token_aligned(piece: Batch, x: torch.Tensor) -> torch.Tensor:
    """(b, s-1) about tokens 1..s-1 -> (b, s) aligned with input_ids, 0 at each sequence's first
    token (in a packed row the column before it, which predicted it, ends another sequence)."""
    return F.pad(x, (1, 0)).masked_fill(piece["segment_start"], 0)


def _scored(piece: Batch, aligned: torch.Tensor) -> torch.Tensor:
    """A token-aligned (b, s) tensor of a micro-batch -> (n, s-1): tokens 1.. of each of its sequences."""
    return rows_of(piece, aligned)[:, 1:]


def _scored_next(piece: Batch, x: torch.Tensor) -> torch.Tensor:
    """(b, s-1) about tokens 1..s-1 of a micro-batch's rows -> (n, s-1): tokens 1.. of each sequence."""
    return _scored(piece, F.pad(x, (1, 0)))


def logprobs_output(role: RoleModel, *, temperature: float = 1.0) -> OutputFn:
    """Forward-only: (b, s) token-aligned log-probs (old policy, reference policy)."""
    return lambda piece, logits: token_aligned(
        piece, next_token_logprobs(role, piece, logits, temperature=temperature)[0]
    )


def score_positions(input_ids: torch.Tensor, lengths: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """(rows,) where a score-head model's score of each row is read, as transformers'
    ``*ForSequenceClassification`` reads it: the row's last token that is not ``pad_id`` (the
    model's ``pad_token_id``; 0 where every token is), or its last token where the model names no pad.
    A model whose pad is its EOS is read before a closing EOS, as it would be in transformers."""
    last = lengths.to(input_ids.device) - 1
    if pad_id is None:
        return last
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    real = (input_ids != pad_id) & (positions <= last[:, None])
    return (positions * real).argmax(dim=1)


def values_output() -> OutputFn:
    """Forward-only: (b, s) raw per-position scores of a score head (a reward model reads the last)."""
    return lambda piece, values: values[..., 0].float()


def token_values_output() -> OutputFn:
    """Forward-only: (b, s) critic values aligned with the token they precede (column t is the
    value of the state just before token t, i.e. the score at position t-1)."""
    return lambda piece, values: token_aligned(piece, values[:, :-1, 0].float())


class UpdateLogprobs:
    """The token-aligned (rows, width) log-probs an actor update's forward computes, kept for every
    row of a batch: when a rollout feeds exactly one optimizer step they are the log-probs before
    the update, so this replaces a separate forward pass. Each row is trained on one data-parallel
    rank (the batch's ``row_index`` names it) and recorded on the last pipeline stage;
    ``all_rows`` gathers them. Positions past a row's micro-batch width stay 0."""

    def __init__(self, role: RoleModel, rows: int, width: int) -> None:
        self.role = role
        self.values = torch.zeros(rows, width, device=next(role.model.parameters()).device)

    def record(self, row_index: torch.Tensor, logprobs: torch.Tensor) -> None:
        """``logprobs`` (n, s-1): tokens 1..s-1 of the rows ``row_index`` (n,)."""
        self.values[row_index, 1 : logprobs.shape[1] + 1] = logprobs.detach().float()

    def all_rows(self) -> torch.Tensor:
        """(rows, width) float32 on the CPU, identical on every rank. Collective over the model's ranks."""
        groups, pg = self.role.groups, self.role.groups.pg_collection
        dist.all_reduce(self.values, group=pg.dp)  # every row was recorded by one DP rank, 0 elsewhere
        dist.broadcast(self.values, src=dist.get_global_rank(pg.pp, groups.layout.pp - 1), group=pg.pp)
        return self.values.cpu()


def ppo_actor_loss(
    role: RoleModel, cfg: PPOLossConfig, *, temperature: float, on_policy: UpdateLogprobs | None = None
) -> LossFn:
    """Clipped policy loss - entropy bonus + KL loss; all three share one aggregation and mask,
    hence one denominator. Log-probs are recomputed at the sampling ``temperature``, as the
    sampler produced them. The policy's entropy is always reported (``actor/entropy``, the first
    sign of a collapsing policy): the log-prob pass already holds every sum it needs, so it costs
    one subtraction per token; it enters the loss only with ``entropy_coef > 0``.

    With ``on_policy`` (the rollout feeds exactly one optimizer step, so the policy being updated
    is the one the old log-probs would be computed from) the batch has no ``old_logprobs``: this
    forward's own log-probs, detached, stand in for them (ratio exactly 1, the same gradient) and
    are recorded into ``on_policy``."""

    def loss(piece: Batch, logits: torch.Tensor) -> LossOutput:
        logprobs, entropy = next_token_logprobs(role, piece, logits, temperature=temperature, with_entropy=True)
        assert entropy is not None
        logprobs = _scored_next(piece, logprobs)
        mask = _scored(piece, piece["response_mask"]).float()
        if on_policy is None:
            old_logprobs = _scored(piece, piece["old_logprobs"])
        else:
            old_logprobs = logprobs.detach()
            on_policy.record(piece["row_index"], old_logprobs)
        numerator, denominator, metrics = ppo_policy_loss(
            logprobs,
            old_logprobs,
            _scored(piece, piece["advantages"]),
            mask,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            dual_clip_c=cfg.dual_clip_c,
            agg_mode=cfg.agg_mode,
            loss_scale_factor=cfg.loss_scale_factor,
        )
        reported: dict[str, Metric] = {f"actor/{name}": value for name, value in metrics.items()}
        reported["actor/pg_loss"] = numerator / denominator.clamp(min=1)
        entropy_numerator, _ = entropy_bonus(
            _scored_next(piece, entropy), mask, agg_mode=cfg.agg_mode, loss_scale_factor=cfg.loss_scale_factor
        )
        if cfg.entropy_coef > 0:
            numerator = numerator - cfg.entropy_coef * entropy_numerator
        reported["actor/entropy"] = entropy_numerator / denominator.clamp(min=1)
        if cfg.kl_loss_coef > 0:
            kl_numerator, _ = kl_loss(
                logprobs,
                _scored(piece, piece["ref_logprobs"]),
                mask,
                estimator=cfg.kl_estimator,
                agg_mode=cfg.agg_mode,
                loss_scale_factor=cfg.loss_scale_factor,
            )
            numerator = numerator + cfg.kl_loss_coef * kl_numerator
            reported["actor/kl_loss"] = kl_numerator / denominator.clamp(min=1)
        return numerator, denominator, reported

    return loss


def critic_loss(cfg: PPOLossConfig) -> LossFn:
    """Clipped value loss on response tokens; values are read just before each token."""

    def loss(piece: Batch, values: torch.Tensor) -> LossOutput:
        predicted = _scored_next(piece, values[:, :-1, 0].float())
        mask = _scored(piece, piece["response_mask"]).float()
        numerator, denominator, metrics = value_loss(
            predicted,
            _scored(piece, piece["old_values"]),
            _scored(piece, piece["returns"]),
            mask,
            clip_range=cfg.value_clip,
            agg_mode=cfg.agg_mode,
            loss_scale_factor=cfg.loss_scale_factor,
        )
        return numerator, denominator, {f"critic/{name}": value for name, value in metrics.items()}

    return loss


def sft_loss(role: RoleModel) -> LossFn:
    """Next-token negative log-likelihood on response tokens (``loss_mask`` 1), token-mean."""

    def loss(piece: Batch, logits: torch.Tensor) -> LossOutput:
        logprobs = _scored_next(piece, next_token_logprobs(role, piece, logits)[0])
        mask = _scored(piece, piece["loss_mask"]).float()
        numerator, denominator = aggregate_loss(-logprobs, mask, "token-mean")
        return numerator, denominator, {}

    return loss


def bradley_terry_loss(pad_id: int | None) -> LossFn:
    """Reward-model loss: -log sigmoid(r_chosen - r_rejected) per pair, mean over pairs.

    Rows come in (chosen, rejected) pairs, adjacent; the reward of a row is the score where
    transformers will read it (``score_positions`` with the model's pad id ``pad_id``). Micro-batches
    never split a pair nor pack rows (see ``group_size`` in ``micro_batches``).
    """

    def loss(piece: Batch, values: torch.Tensor) -> LossOutput:
        last = score_positions(piece["input_ids"], piece["attention_mask"].sum(dim=1), pad_id)
        rewards = values[torch.arange(values.shape[0], device=values.device), last, 0].float()
        chosen, rejected = rewards[0::2], rewards[1::2]
        margin = chosen - rejected
        numerator = -F.logsigmoid(margin).sum()
        denominator = torch.tensor(margin.numel(), device=margin.device)
        # Over the step's pairs, not a mean of micro-batch means (micro-batches hold unequal counts).
        return (
            numerator,
            denominator,
            {"accuracy": ((margin > 0).sum(), denominator), "margin": (margin.sum(), denominator)},
        )

    return loss
