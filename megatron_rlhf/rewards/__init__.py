"""Rewards of a rollout: rule functions (registered, or any ``module:function``), verl-style reward
functions from a file, and the reward model's score; the user's code called through ``calls.py``."""

from .calls import RewardCalls, RewardFunctionError, ScoringInterrupted
from .custom import CustomFunctionConfig, CustomRewardFunction, CustomScores, load_custom_function, metric_means
from .rules import REWARD_RULES, RewardRule, Sample, as_number, resolve_rule, rule_scores, score_of

__all__ = [
    "REWARD_RULES",
    "CustomFunctionConfig",
    "CustomRewardFunction",
    "CustomScores",
    "RewardCalls",
    "RewardFunctionError",
    "RewardRule",
    "Sample",
    "ScoringInterrupted",
    "as_number",
    "load_custom_function",
    "metric_means",
    "resolve_rule",
    "rule_scores",
    "score_of",
]
