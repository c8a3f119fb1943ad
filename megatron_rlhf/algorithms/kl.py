"""Per-token KL estimators, KL controllers and the reward-penalty helper.

Shape legend: B = batch (sequences), T = response tokens.
  logprobs, ref_logprobs (B, T) float: log pi(a_t|s_t) of the sampled tokens
  under the policy (the sampling distribution) and the reference model.
  -> kl (B, T) float

Estimators follow Schulman, "Approximating KL Divergence" (2020),
http://joschu.net/blog/kl-approx.html, with r = ref / pi:
  k1 = -log r (unbiased, high variance, can be negative)
  k2 = 0.5 (log r)^2 (biased, low variance, >= 0)
  k3 = r - 1 - log r (unbiased, low variance, >= 0)
Names follow verl too: kl = k1, mse = k2, low_var_kl = k3, and a trailing
"+" (k1+, kl+, abs+, k3+, low_var_kl+) keeps the value of the estimator but
takes the gradient of k2 (straight-through).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from megatron_rlhf.config.fields import at_least, check_on_init

from .registry import Registry
from .utils import as_bool_mask, masked_mean, masked_sum

__all__ = [
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "KL_MEASURES",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "KLControllerConfig",
    "apply_kl_penalty",
    "build_kl_controller",
    "controller_kl",
]

KLEstimator = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")

# exp() of a log-ratio above ~20 is a numerical accident, not signal; k3 is
# additionally capped so one bad token cannot dominate a whole batch.
LOG_RATIO_CLAMP = 20.0
K3_MAX = 10.0


@KL_ESTIMATORS.register("k1", "kl")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log pi - log ref: the naive unbiased estimator."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("abs")
def kl_abs(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """|log pi - log ref|: a non-negative but biased variant of k1."""
    return (logprobs - ref_logprobs).abs()


@KL_ESTIMATORS.register("k2", "mse")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = 0.5 (log pi - log ref)^2; its gradient is that of the true KL."""
    return 0.5 * (logprobs - ref_logprobs).square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(x) - 1 - x with x = ref - logp (Schulman 2020), clamped.

    Computed as expm1(x) - x: exp(x) - x - 1 rounds exp(x) near 1 and, for
    |x| ~ 1e-3 in float32, is off by up to ~12% of a value of only ~x^2/2. The
    log ratio is clamped to +-LOG_RATIO_CLAMP and the result to [0, K3_MAX]
    so that exp() cannot overflow in low precision.
    """
    log_r = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.expm1(log_r) - log_r).clamp(0.0, K3_MAX)


def _with_k2_gradient(estimator: KLEstimator) -> KLEstimator:
    """Straight-through: the value of ``estimator``, the gradient of k2.

    k1 and k3 are unbiased for the KL's value but their gradients are not the
    KL's gradient; k2's is (on-policy samples). verl's "+" names.
    """

    def straight_through(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
        k2 = kl_k2(logprobs, ref_logprobs)
        return estimator(logprobs, ref_logprobs).detach() + (k2 - k2.detach())

    return straight_through


KL_ESTIMATORS.register("k1+", "kl+")(_with_k2_gradient(kl_k1))
KL_ESTIMATORS.register("abs+")(_with_k2_gradient(kl_abs))
KL_ESTIMATORS.register("k3+", "low_var_kl+")(_with_k2_gradient(kl_k3))


# --------------------------------------------------------------------------- controllers

# What the adaptive controller compares with target_kl: (B, T) kl, (B, T) mask -> scalar.
# Both average over sequences with at least one valid token (all-masked rows are padding).
KLMeasure = Callable[[Tensor, Tensor], Tensor]
KL_MEASURES: Registry[KLMeasure] = Registry("KL controller measure")


def _row_sums(kl: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    m = as_bool_mask(mask, kl)
    lengths = m.sum(dim=-1)
    return masked_sum(kl, m, dim=-1), lengths.to(kl.dtype), lengths > 0


@KL_MEASURES.register("token_mean")
def _token_mean_kl(kl: Tensor, mask: Tensor) -> Tensor:
    # verl (ray_trainer.apply_kl_penalty): each sequence's mean per-token KL, averaged
    row_sum, row_len, rows = _row_sums(kl, mask)
    return masked_mean(row_sum / row_len.clamp(min=1), rows)


@KL_MEASURES.register("sequence_sum")
def _sequence_sum_kl(kl: Tensor, mask: Tensor) -> Tensor:
    # Ziegler et al. 2019: the KL of a whole sequence (sum over its tokens), averaged
    row_sum, _, rows = _row_sums(kl, mask)
    return masked_mean(row_sum, rows)


def controller_kl(kl: Tensor, mask: Tensor, measure: str = "token_mean") -> float:
    """The host float to pass to ``KLController.update``: (B, T) kl, (B, T) mask -> float.

    ``measure`` is ``KLControllerConfig.kl_measure``: "token_mean" (verl) or
    "sequence_sum" (Ziegler et al.); target_kl is in the same unit. No
    collectives: pass the whole rollout's kl and mask.
    """
    return float(KL_MEASURES.get(measure)(kl, mask))


@dataclass(kw_only=True, frozen=True)
class KLControllerConfig:
    """Which controller to build and its parameters."""

    type: Literal["fixed", "adaptive"] = "fixed"
    coef: float = 1e-3
    """Fixed coefficient, or the initial coefficient of the adaptive one."""
    target_kl: float = 0.1
    """Adaptive only: the KL the controller steers towards, measured as ``kl_measure`` says."""
    horizon: float = 10_000
    """Adaptive only: steps over which a full +-20% correction is applied."""
    kl_measure: Literal["token_mean", "sequence_sum"] = "token_mean"
    """Adaptive only: the KL fed to the controller (``controller_kl``). token_mean (verl's): mean
    over sequences of each one's mean per-token KL; sequence_sum (Ziegler et al. 2019): mean over
    sequences of each one's summed KL. A target_kl set for one is off by about the response length
    for the other."""

    def __post_init__(self) -> None:
        check_on_init(self)

    def errors(self) -> list[str]:
        errors = at_least(self, 0, "coef")
        if self.type == "adaptive" and self.coef == 0:
            errors.append("coef=0 with type=adaptive would stay 0 (the controller scales it): give a start > 0")
        return errors + [
            f"{name}={getattr(self, name)} must be > 0"
            for name in ("target_kl", "horizon")
            if not getattr(self, name) > 0
        ]


class KLController(Protocol):
    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the coefficient, and which controller had it."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from what ``state_dict`` returned (a resumed run's config may name the other kind)."""
        ...


class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op."""

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise ValueError(f"KL coef must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps

    def state_dict(self) -> dict[str, Any]:
        return {"kl_coef": self.value, "kl_controller": "fixed"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing: the config's coefficient applies, which a resumed run may change."""
        del state


class AdaptiveKLController:
    """Proportional controller of Ziegler et al. 2019 (arXiv:1909.08593, Sec. 2.2).

    error = clip(current_kl / target_kl - 1, -0.2, 0.2)
    value *= 1 + error * n_steps / horizon
    ``current_kl`` is a host float: the caller reduces across ranks first.
    """

    def __init__(self, init_coef: float, target_kl: float, horizon: float) -> None:
        if init_coef < 0:
            raise ValueError(f"init_coef must be >= 0, got {init_coef}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"kl_coef": self.value, "kl_controller": "adaptive"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues an adaptive controller's coefficient (its state; the config's coef is only its
        start). After a fixed one, starts from the config's coef: a fixed coefficient of 0 (no
        penalty) would stay 0, as the update only scales it. (Checkpoints that do not say which
        controller saved: continued, unless 0.)"""
        kind = state.get("kl_controller", "adaptive" if state["kl_coef"] > 0 else "fixed")
        if kind == "adaptive":
            self.value = float(state["kl_coef"])


KL_CONTROLLERS: Registry[Callable[[KLControllerConfig], KLController]] = Registry("KL controller")
"""Each with the ``KLControllerConfig`` fields it reads besides ``type`` and ``coef`` (its info)."""
KL_CONTROLLERS.register("fixed", info=frozenset())(lambda c: FixedKLController(c.coef))
KL_CONTROLLERS.register("adaptive", info=frozenset({"target_kl", "horizon", "kl_measure"}))(
    lambda c: AdaptiveKLController(c.coef, c.target_kl, c.horizon)
)


def build_kl_controller(config: KLControllerConfig) -> KLController:
    """Factory: ``config.type`` selects the controller (ValueError if unknown)."""
    return KL_CONTROLLERS.get(config.type)(config)


def apply_kl_penalty(token_rewards: Tensor, kl: Tensor, coef: float | Tensor, mask: Tensor) -> Tensor:
    """Reward-penalty mode: r_t - coef * kl_t on valid tokens (B, T) -> (B, T).

    Masked positions keep their reward untouched, and a NaN/inf kl there is
    ignored (padding log-probs are often -inf).
    """
    m = as_bool_mask(mask, token_rewards)
    if kl.shape != token_rewards.shape:
        raise ValueError(f"kl shape {tuple(kl.shape)} != token_rewards shape {tuple(token_rewards.shape)}")
    return torch.where(m, token_rewards - coef * kl, token_rewards)
