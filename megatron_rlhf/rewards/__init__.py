"""Rewards of a rollout: rule functions (registered, or any ``module:function``), verl-style reward
functions from a file, and the reward model's score."""

from .custom import (
    CustomFunctionConfig,
    CustomRewardFunction,
    CustomScores,
    RewardFunctionError,
    load_custom_function,
    metric_means,
)
from .rules import REWARD_RULES, RewardRule, Sample, as_score, resolve_rule, rule_scores

__all__ = [
    "REWARD_RULES",
    "CustomFunctionConfig",
    "CustomRewardFunction",
    "CustomScores",
    "RewardFunctionError",
    "RewardRule",
    "Sample",
    "as_score",
    "load_custom_function",
    "metric_means",
    "resolve_rule",
    "rule_scores",
]
