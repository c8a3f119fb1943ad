"""Policy / value / entropy / KL losses returning (numerator, denominator).

Shape legend: B = batch (sequences), T = response tokens; every per-token
input is (B, T); ``mask`` is (B, T) bool or 0/1. Outputs are scalars.

Why (numerator, denominator)? A mean over a micro-batch, averaged again over
micro-batches and data-parallel ranks, weights tokens differently depending
on how the batch was split. Instead the caller sums numerators and
denominators over all micro-batches (and all-reduces both across ranks),
then uses loss = sum(num) / sum(den): identical to the whole-batch value for
every split. In practice: backprop num_i / global_den per micro-batch.
Metrics are detached scalar tensors (no ``.item()``, no host sync).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .kl import KL_ESTIMATORS, LOG_RATIO_CLAMP, kl_k3
from .registry import Registry
from .utils import as_bool_mask, explained_variance, masked_mean, masked_sum

__all__ = [
    "AGG_MODES",
    "aggregate_loss",
    "entropy_bonus",
    "explained_variance",
    "kl_loss",
    "ppo_policy_loss",
    "value_loss",
]

# (loss_mat, mask, loss_scale_factor) -> (num, den); only "seq-mean-token-sum-norm"
# reads loss_scale_factor, the others share the signature so lookups never branch.
AggFn = Callable[[Tensor, Tensor, float | None], tuple[Tensor, Tensor]]
AGG_MODES: Registry[AggFn] = Registry("loss aggregation mode")


@dataclass(frozen=True)
class AggModeNeeds:
    """What an aggregation mode needs of the loss config, declared at registration."""

    scale_factor: bool = False
    """A constant ``loss_scale_factor`` that each sequence's token sum is divided by."""


@AGG_MODES.register("token-mean", info=AggModeNeeds())
def _token_mean(loss_mat: Tensor, mask: Tensor, loss_scale_factor: float | None) -> tuple[Tensor, Tensor]:
    # every valid token weighs the same, whatever its sequence length
    return masked_sum(loss_mat, mask), mask.sum().to(loss_mat.dtype)


def _rows(loss_mat: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    row_sum = masked_sum(loss_mat, mask, dim=-1)
    row_len = mask.sum(dim=-1).to(loss_mat.dtype)
    return row_sum, row_len, (row_len > 0).sum().to(loss_mat.dtype)


@AGG_MODES.register("seq-mean-token-sum", info=AggModeNeeds())
def _seq_mean_token_sum(loss_mat: Tensor, mask: Tensor, loss_scale_factor: float | None) -> tuple[Tensor, Tensor]:
    # every sequence weighs its token sum (no length bias)
    row_sum, _, n_rows = _rows(loss_mat, mask)
    return row_sum.sum(), n_rows


@AGG_MODES.register("seq-mean-token-sum-norm", info=AggModeNeeds(scale_factor=True))
def _seq_mean_token_sum_norm(loss_mat: Tensor, mask: Tensor, loss_scale_factor: float | None) -> tuple[Tensor, Tensor]:
    # Dr. GRPO (arXiv:2503.20783): token sums over a constant, not over each
    # sequence's own length; verl's agg_loss of the same name
    if loss_scale_factor is None or not loss_scale_factor > 0:
        raise ValueError(
            f"agg mode 'seq-mean-token-sum-norm' needs loss_scale_factor > 0 (verl uses the padded "
            f"response length, i.e. max_new_tokens), got {loss_scale_factor}"
        )
    row_sum, _, n_rows = _rows(loss_mat, mask)
    return row_sum.sum(), n_rows * loss_scale_factor


@AGG_MODES.register("seq-mean-token-mean", info=AggModeNeeds())
def _seq_mean_token_mean(loss_mat: Tensor, mask: Tensor, loss_scale_factor: float | None) -> tuple[Tensor, Tensor]:
    # every sequence weighs the same (original GRPO)
    row_sum, row_len, n_rows = _rows(loss_mat, mask)
    return (row_sum / row_len.clamp(min=1)).sum(), n_rows


def aggregate_loss(
    loss_mat: Tensor, mask: Tensor, mode: str, *, loss_scale_factor: float | None = None
) -> tuple[Tensor, Tensor]:
    """Reduce a (B, T) loss to (numerator, denominator) scalars.

    Modes: "token-mean" (sum over valid tokens, #valid tokens),
    "seq-mean-token-sum" (sum of row token-sums, #rows with a valid token),
    "seq-mean-token-sum-norm" (sum of row token-sums, #rows with a valid
    token x loss_scale_factor; required, a constant such as max_new_tokens),
    "seq-mean-token-mean" (sum of row token-means, #rows with a valid token).
    Rows without valid tokens contribute 0 to both. See module docstring.
    """
    fn = AGG_MODES.get(mode)
    return fn(loss_mat, as_bool_mask(mask, loss_mat), loss_scale_factor)


def _zero(like: Tensor) -> Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347).

    loss_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)),
    r = exp(logp - old_logp). Asymmetric clipping ("clip-higher", DAPO,
    arXiv:2503.14476) lets low-probability tokens grow more. Dual clip
    (Ye et al. 2020, arXiv:1912.09729): for A < 0 the loss is further capped
    at -c A (c > 1) so a huge ratio on a bad token cannot explode the update.
    Metrics (masked means): pg_clipfrac (clip active), pg_clipfrac_lower
    (dual clip active), approx_kl = k3 estimate of KL(old || new), i.e.
    mean of r - 1 - log r over tokens sampled from the old policy.
    """
    m = as_bool_mask(mask, logprobs)
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")

    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipfrac = masked_mean((loss_clipped > loss_unclipped).to(logprobs.dtype), m)

    if dual_clip_c is not None:
        cap = -advantages * dual_clip_c
        neg = advantages < 0
        lower_active = neg & (loss > cap)
        loss = torch.where(neg, torch.minimum(loss, cap), loss)
        clipfrac_lower = masked_mean(lower_active.to(logprobs.dtype), m)
    else:
        clipfrac_lower = _zero(logprobs)

    num, den = aggregate_loss(loss, m, agg_mode, loss_scale_factor=loss_scale_factor)
    metrics = {
        "pg_clipfrac": clipfrac.detach(),
        "pg_clipfrac_lower": clipfrac_lower.detach(),
        "approx_kl": masked_mean(kl_k3(old_logprobs, logprobs), m).detach(),
    }
    return num, den, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip_range: float | None = None,
    agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Critic regression loss 0.5 * max((v - R)^2, (v_clip - R)^2).

    v_clip = old_v + clip(v - old_v, -clip_range, clip_range) keeps the critic
    from moving far from its rollout-time estimate (PPO2 baselines);
    clip_range=None gives plain 0.5 (v - R)^2. Metric vf_clipfrac: fraction
    of valid tokens where the clamp moved v AND the clipped term is the
    larger one (verl's meaning). The clamp's own output decides "moved":
    old_v + (v - old_v) can differ from v by rounding, so comparing the two
    squared errors alone would count clips that did not happen.
    """
    m = as_bool_mask(mask, values)
    err = (values - returns).square()
    if clip_range is None:
        loss, clipfrac = 0.5 * err, _zero(values)
    else:
        if clip_range <= 0:
            raise ValueError(f"clip_range must be > 0 or None, got {clip_range}")
        delta = values - old_values
        delta_clip = delta.clamp(-clip_range, clip_range)
        err_clip = (old_values + delta_clip - returns).square()
        loss = 0.5 * torch.maximum(err, err_clip)
        clipfrac = masked_mean(((delta_clip != delta) & (err_clip > err)).to(values.dtype), m)
    num, den = aggregate_loss(loss, m, agg_mode, loss_scale_factor=loss_scale_factor)
    return num, den, {"vf_clipfrac": clipfrac.detach()}


def entropy_bonus(
    entropy: Tensor, mask: Tensor, *, agg_mode: str = "token-mean", loss_scale_factor: float | None = None
) -> tuple[Tensor, Tensor]:
    """Aggregated token entropy (num, den); the caller SUBTRACTS coef * num/den."""
    return aggregate_loss(entropy, mask, agg_mode, loss_scale_factor=loss_scale_factor)


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    *,
    estimator: str = "low_var_kl",
    agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> tuple[Tensor, Tensor]:
    """KL-to-reference as a loss term (GRPO style, not a reward penalty).

    ``estimator`` is a KL_ESTIMATORS name; the caller ADDS coef * num/den.
    """
    kl = KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs)
    return aggregate_loss(kl, mask, agg_mode, loss_scale_factor=loss_scale_factor)
