"""Advantage estimators, registered in ``ADVANTAGE_ESTIMATORS``.

Shape legend: B = batch (sequences), T = response tokens.
  token_rewards (B, T) float  per-token reward: the scalar score at the last
                              valid token plus any per-token KL penalty
  response_mask (B, T) bool   True on valid response tokens: the tokens the
                              policy sampled (a multi-turn response's
                              environment tokens are gaps, False)
  values        (B, T) float  critic values V(s_t), or None
  group_index   (B,)   int64  prompt id; rows sharing an id form a group
  -> advantages (B, T), returns (B, T); both exactly 0 on masked positions

Every estimator takes the SAME keyword-only arguments so the trainer calls
``ADVANTAGE_ESTIMATORS.get(name)(**kwargs)`` without branching on the name.
Group statistics only use rows with at least one valid token (all-masked
rows are padding, not samples). Size-1 and zero-variance groups give 0.
Gaps inside a row are skipped: every estimator gives what it gives on the
row with the masked tokens removed (so a tool's output between two turns
neither earns reward nor discounts the return), except REINFORCE++ with
``reset_return_at_gaps``, which ends the return at a gap on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from megatron_rlhf.config.fields import check_on_init

from .registry import Registry
from .utils import as_bool_mask, last_valid, masked_sum, masked_whiten

__all__ = ["ADVANTAGE_ESTIMATORS", "AdvantageConfig", "AdvantageEstimator", "EstimatorNeeds", "compute_advantages"]


@dataclass(kw_only=True, frozen=True)
class AdvantageConfig:
    """Hyper-parameters shared by all estimators (each uses the ones it needs)."""

    gamma: float = 1.0
    """Discount factor (GAE, REINFORCE++). 1.0 is usual for LLM episodes."""
    lam: float = 1.0
    """GAE lambda: bias/variance trade-off, 1.0 = Monte-Carlo returns minus V."""
    whiten: bool = True
    """Whiten GAE advantages over all valid tokens of the batch."""
    eps: float = 1e-6
    """Added to standard deviations before dividing, keeps outputs finite."""
    norm_by_std: bool = True
    """GRPO: divide by the group std (False reproduces Dr. GRPO)."""
    reset_return_at_gaps: bool = False
    """REINFORCE++ (reinforce_pp) only: restart the discounted return at every masked token inside
    a response (e.g. tool output between turns), so a token's return stops at the next gap. verl
    up to v0.8 did this; verl v0.9 (PR #7300) carries the return across gaps like the default
    False, which is also what GAE does here."""

    def __post_init__(self) -> None:
        check_on_init(self)

    def errors(self) -> list[str]:
        errors = [
            f"{name}={getattr(self, name)} must be in [0, 1]"
            for name in ("gamma", "lam")
            if not 0.0 <= getattr(self, name) <= 1.0
        ]
        return errors + ([f"eps={self.eps} must be > 0"] if self.eps <= 0.0 else [])


@dataclass(frozen=True)
class EstimatorNeeds:
    """What an estimator needs of the run, declared at registration; the trainer builds models and
    checks the config from it and never compares estimator names."""

    critic: bool = False
    """Per-token values from a critic model (``values`` is required)."""
    groups: bool = False
    """Several samples per prompt (``group_index``; rollout.sampling.n >= 2)."""
    reads: frozenset[str] | None = None
    """The ``AdvantageConfig`` fields it reads; None: any of them. A value given for another one is
    reported at start-up as having no effect."""


class AdvantageEstimator(Protocol):
    def __call__(
        self,
        *,
        token_rewards: Tensor,
        response_mask: Tensor,
        values: Tensor | None,
        group_index: Tensor | None,
        config: AdvantageConfig,
    ) -> tuple[Tensor, Tensor]: ...


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def compute_advantages(
    name: str,
    *,
    token_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor | None = None,
    group_index: Tensor | None = None,
    config: AdvantageConfig | None = None,
) -> tuple[Tensor, Tensor]:
    """Convenience front door: look up ``name`` and call it."""
    return ADVANTAGE_ESTIMATORS.get(name)(
        token_rewards=token_rewards,
        response_mask=response_mask,
        values=values,
        group_index=group_index,
        config=config if config is not None else AdvantageConfig(),
    )


# --------------------------------------------------------------------------- helpers


def _check(token_rewards: Tensor, response_mask: Tensor) -> Tensor:
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards must be (B, T), got {tuple(token_rewards.shape)}")
    return as_bool_mask(response_mask, token_rewards)


def _zero_masked(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _discounted_scan(
    rewards: Tensor, mask: Tensor, values: Tensor | None, gamma: float, lam: float, *, reset_at_gaps: bool = False
) -> Tensor:
    """Reverse scan of GAE deltas; (B, T) -> (B, T) advantages.

    Masked positions add no reward. By default they do not break the chain
    either, so the next *valid* token's value and advantage bootstrap across
    gaps (e.g. tool-output tokens in multi-turn rollouts); ``reset_at_gaps``
    instead ends the chain there, as if the episode stopped. ``values=None``
    means V = 0, which with lam=1 gives the discounted return-to-go.
    """
    B, T = rewards.shape
    zero = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    next_value, carry = zero, zero
    out = torch.zeros_like(rewards)
    for t in reversed(range(T)):
        v_t = values[:, t] if values is not None else zero
        delta = rewards[:, t] + gamma * next_value - v_t
        adv_t = delta + gamma * lam * carry
        m_t = mask[:, t]
        out[:, t] = torch.where(m_t, adv_t, zero)
        carry = torch.where(m_t, adv_t, zero if reset_at_gaps else carry)
        next_value = torch.where(m_t, v_t, zero if reset_at_gaps else next_value)
    return out


def _outcome_scores(token_rewards: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(B,) sequence score = sum of valid token rewards, and (B,) row-has-tokens flag."""
    return masked_sum(token_rewards, mask, dim=-1), mask.any(dim=-1)


def _group_stats(scores: Tensor, group_index: Tensor | None, valid_rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row (B,) group mean, unbiased group std and group size over valid rows."""
    if group_index is None:
        raise ValueError("this advantage estimator needs group_index (B,) int64, got None")
    if group_index.shape != scores.shape:
        raise ValueError(f"group_index must be ({scores.shape[0]},), got {tuple(group_index.shape)}")
    _, inv = torch.unique(group_index, return_inverse=True)
    G = int(inv.max()) + 1 if inv.numel() else 0
    w = valid_rows.to(scores.dtype)
    x = torch.where(valid_rows, scores, torch.zeros_like(scores))
    count = torch.zeros(G, dtype=scores.dtype, device=scores.device).index_add_(0, inv, w)
    total = torch.zeros_like(count).index_add_(0, inv, x)
    mean = total / count.clamp(min=1)
    dev2 = torch.where(valid_rows, (scores - mean[inv]) ** 2, torch.zeros_like(scores))
    ss = torch.zeros_like(count).index_add_(0, inv, dev2)
    std = (ss / (count - 1).clamp(min=1)).sqrt()
    return mean[inv], std[inv], count[inv]


def _broadcast(row_adv: Tensor, mask: Tensor, valid_rows: Tensor) -> tuple[Tensor, Tensor]:
    row_adv = torch.where(valid_rows, row_adv, torch.zeros_like(row_adv))
    adv = _zero_masked(row_adv.unsqueeze(-1).expand_as(mask).to(row_adv.dtype), mask)
    return adv, adv.clone()


# --------------------------------------------------------------------------- estimators


@ADVANTAGE_ESTIMATORS.register(
    "gae", info=EstimatorNeeds(critic=True, reads=frozenset({"gamma", "lam", "whiten", "eps"}))
)
def gae(
    *,
    token_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor | None,
    group_index: Tensor | None,
    config: AdvantageConfig,
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

    A_t = sum_l (gamma*lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t,
    over valid tokens only. returns = A + V (un-whitened, the critic target);
    advantages are then whitened over valid tokens if ``config.whiten``.
    values (B, T) is required.
    """
    mask = _check(token_rewards, response_mask)
    if values is None:
        raise ValueError("advantage estimator 'gae' needs critic values (B, T), got None")
    if values.shape != token_rewards.shape:
        raise ValueError(f"values shape {tuple(values.shape)} != token_rewards shape {tuple(token_rewards.shape)}")
    values = _zero_masked(values.to(token_rewards.dtype), mask)
    adv = _discounted_scan(token_rewards, mask, values, config.gamma, config.lam)
    returns = _zero_masked(adv + values, mask)
    if config.whiten:
        adv = masked_whiten(adv, mask, eps=config.eps)
    return adv, returns


def _grpo_like(
    token_rewards: Tensor, response_mask: Tensor, group_index: Tensor | None, config: AdvantageConfig, norm_by_std: bool
) -> tuple[Tensor, Tensor]:
    mask = _check(token_rewards, response_mask)
    scores, valid_rows = _outcome_scores(token_rewards, mask)
    mean, std, _ = _group_stats(scores, group_index, valid_rows)
    row_adv = scores - mean
    if norm_by_std:
        row_adv = row_adv / (std + config.eps)
    return _broadcast(row_adv, mask, valid_rows)


@ADVANTAGE_ESTIMATORS.register("grpo", info=EstimatorNeeds(groups=True, reads=frozenset({"norm_by_std", "eps"})))
def grpo(
    *,
    token_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor | None,
    group_index: Tensor | None,
    config: AdvantageConfig,
) -> tuple[Tensor, Tensor]:
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

    A_i = (R_i - mean_g R) / (std_g R + eps) for every valid token of row i,
    R_i = sum of its token rewards, std unbiased. ``config.norm_by_std=False``
    drops the division. returns == advantages. group_index (B,) is required.
    """
    return _grpo_like(token_rewards, response_mask, group_index, config, config.norm_by_std)


@ADVANTAGE_ESTIMATORS.register("dr_grpo", info=EstimatorNeeds(groups=True, reads=frozenset()))
def dr_grpo(
    *,
    token_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor | None,
    group_index: Tensor | None,
    config: AdvantageConfig,
) -> tuple[Tensor, Tensor]:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783).

    A_i = R_i - mean_g R: no std division, which the paper shows biases
    updates towards too-easy/too-hard prompts. returns == advantages.
    """
    return _grpo_like(token_rewards, response_mask, group_index, config, norm_by_std=False)


@ADVANTAGE_ESTIMATORS.register("rloo", info=EstimatorNeeds(groups=True, reads=frozenset()))
def rloo(
    *,
    token_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor | None,
    group_index: Tensor | None,
    config: AdvantageConfig,
) -> tuple[Tensor, Tensor]:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740).

    A_i = R_i - mean_{j != i} R_j = n/(n-1) (R_i - mean_g R), n = group size;
    groups of one have no baseline sample and get 0. returns == advantages.
    """
    mask = _check(token_rewards, response_mask)
    scores, valid_rows = _outcome_scores(token_rewards, mask)
    mean, _, n = _group_stats(scores, group_index, valid_rows)
    scale = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.zeros_like(n))
    return _broadcast(scale * (scores - mean), mask, valid_rows)


@ADVANTAGE_ESTIMATORS.register(
    "reinforce_pp", info=EstimatorNeeds(reads=frozenset({"gamma", "reset_return_at_gaps", "eps"}))
)
def reinforce_pp(
    *,
    token_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor | None,
    group_index: Tensor | None,
    config: AdvantageConfig,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262).

    returns G_t = r_t + gamma G_{t+1} over valid tokens (masked ones skipped,
    or ending the return if ``config.reset_return_at_gaps``); advantages = G
    whitened globally over valid tokens. No critic, no groups.
    """
    mask = _check(token_rewards, response_mask)
    returns = _discounted_scan(token_rewards, mask, None, config.gamma, 1.0, reset_at_gaps=config.reset_return_at_gaps)
    return masked_whiten(returns, mask, eps=config.eps), returns


@ADVANTAGE_ESTIMATORS.register(
    "reinforce_pp_baseline", info=EstimatorNeeds(groups=True, reads=frozenset({"gamma", "eps"}))
)
def reinforce_pp_baseline(
    *,
    token_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor | None,
    group_index: Tensor | None,
    config: AdvantageConfig,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262, group-mean baseline variant).

    The group mean of the outcome reward R is subtracted from each row's
    reward at its last valid token, then REINFORCE++ discounting and global
    whitening follow. returns = discounted baselined return-to-go.
    """
    mask = _check(token_rewards, response_mask)
    scores, valid_rows = _outcome_scores(token_rewards, mask)
    mean, _, _ = _group_stats(scores, group_index, valid_rows)
    shifted = token_rewards - last_valid(mask).to(token_rewards.dtype) * mean.unsqueeze(-1)
    returns = _discounted_scan(shifted, mask, None, config.gamma, 1.0)
    return masked_whiten(returns, mask, eps=config.eps), returns
