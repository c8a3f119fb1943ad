"""RL algorithms as pure, registered tensor functions (no collectives, no state)."""

from .advantages import ADVANTAGE_ESTIMATORS, AdvantageConfig, AdvantageEstimator, EstimatorNeeds, compute_advantages
from .kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    KL_MEASURES,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    KLControllerConfig,
    apply_kl_penalty,
    build_kl_controller,
    controller_kl,
)
from .losses import AGG_MODES, aggregate_loss, entropy_bonus, kl_loss, ppo_policy_loss, value_loss
from .registry import Registry
from .utils import explained_variance, masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "KL_MEASURES",
    "AdaptiveKLController",
    "AdvantageConfig",
    "AdvantageEstimator",
    "EstimatorNeeds",
    "FixedKLController",
    "KLController",
    "KLControllerConfig",
    "Registry",
    "aggregate_loss",
    "apply_kl_penalty",
    "build_kl_controller",
    "compute_advantages",
    "controller_kl",
    "entropy_bonus",
    "explained_variance",
    "kl_loss",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_policy_loss",
    "value_loss",
]
