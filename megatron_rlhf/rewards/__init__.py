"""Rewards of a rollout: rule functions (registered, or any ``module:function``) and the reward model's score."""

from .rules import REWARD_RULES, RewardRule, Sample, resolve_rule, rule_scores

__all__ = ["REWARD_RULES", "RewardRule", "Sample", "resolve_rule", "rule_scores"]
