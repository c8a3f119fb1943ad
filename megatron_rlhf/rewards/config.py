"""The scoring settings (``scoring``) and their checks, apart from the scorer so that reading and
checking a config imports no megatron-core (``scoring.py`` says how a score is made)."""

from __future__ import annotations

import dataclasses
import math

from megatron_rlhf.config.fields import at_least
from megatron_rlhf.metrics.log import snake_case

from .custom import CustomFunctionConfig, CustomRewardFunction, load_custom_function
from .rules import RewardRule, resolve_rule

REWARD_MODEL, CUSTOM_FUNCTION = "reward_model", "custom_function"


@dataclasses.dataclass(kw_only=True)
class OverlongConfig:
    """DAPO's soft over-long punishment (Yu et al. 2025, Eq. 13): a response longer than
    max_new_tokens - buffer loses penalty x (length - (max_new_tokens - buffer)) / buffer."""

    buffer: int = 0
    """Tokens before max_new_tokens where the penalty ramps up linearly; 0: off."""
    penalty: float = 1.0
    """The penalty at max_new_tokens."""

    def errors(self) -> list[str]:
        return at_least(self, 0, "buffer", "penalty")


@dataclasses.dataclass(kw_only=True)
class ScoringConfig:
    """How a response's scalar reward is made (see the module docstring)."""

    use_reward_model: bool = False
    """Score with the reward model (``reward.path``); false (verl's default): no reward model is built."""
    rules: list[str] = dataclasses.field(default_factory=list)
    """Rule names (exact_answer, lowercase_fraction) or import paths ``package.module:function``."""
    custom_function: CustomFunctionConfig = dataclasses.field(default_factory=CustomFunctionConfig)
    """A verl ``compute_score`` function loaded from a file."""
    weights: dict[str, float] = dataclasses.field(default_factory=dict)
    """Weight of each part: reward_model, a rule's name, custom_function (e.g. {reward_model: 0.7,
    exact_answer: 0.3}); a part not named has weight 1."""
    overlong: OverlongConfig = dataclasses.field(default_factory=OverlongConfig)
    timeout_s: float = 60.0
    """Longest one call of a rule or the custom function may take, in seconds; 0: no limit. A call that
    runs longer ends the run with an error naming it, the sample and the line it is at, where a hung
    function would hang every rank (Python cannot stop it, so the run ends rather than skip the
    sample). Keep it well below dist_timeout_s: the other ranks wait that long for this rank's scores."""
    workers: int = 0
    """Processes per rank that run the rules and the custom function, each on a part of the rank's
    share; 0: a thread of the trainer's process. A thread shares the interpreter lock with the
    trainer's GPU launches, so pure-Python reward code overlaps the GPU passes only in workers, which
    also spread it over cores. Each worker is a Python process with torch imported (about 0.3 GB of
    host memory), started at set-up; the rules and the function must load by name in it
    (``rewards/workers.py``)."""

    def errors(self) -> list[str]:
        return (
            at_least(self, 0, "workers")
            + [
                f"weights.{name}={value} must be a finite number"
                for name, value in self.weights.items()
                if not math.isfinite(value)
            ]
            + (
                []
                if 0 <= self.timeout_s < math.inf
                else [f"timeout_s={self.timeout_s} must be >= 0 and finite (0: no limit)"]
            )
        )

    def parts(self) -> list[str]:
        """The names of the configured parts, in scoring order."""
        return (
            ([REWARD_MODEL] if self.use_reward_model else [])
            + list(self.rules)
            + ([CUSTOM_FUNCTION] if self.custom_function.path else [])
        )


def scoring_errors(cfg: ScoringConfig) -> tuple[list[str], dict[str, RewardRule], CustomRewardFunction | None]:
    """The problems of ``scoring`` that need its rules and function loaded; and those."""
    errors: list[str] = []
    rules: dict[str, RewardRule] = {}
    for name in cfg.rules:
        try:
            rules[name] = resolve_rule(name)
        except ValueError as err:
            errors.append(f"scoring.rules: {err}")
    function = None
    if cfg.custom_function.path:
        try:
            function = load_custom_function(cfg.custom_function.path, cfg.custom_function.name)
        except ValueError as err:
            errors.append(str(err))
    metric_of: dict[str, str] = {}
    for name in cfg.rules:
        other = metric_of.setdefault(snake_case(name), name)
        if other != name:
            errors.append(
                f"scoring.rules: {other!r} and {name!r} would both be logged as reward/rule/{snake_case(name)}; "
                "give one of them another name"
            )
    parts = cfg.parts()
    if not parts:
        errors.append(
            "nothing scores the responses: set scoring.use_reward_model=true, give scoring.rules=[...] "
            "or scoring.custom_function.path=FILE"
        )
    errors += [
        f"scoring.weights.{name}: no such part; the parts are {parts}" for name in cfg.weights if name not in parts
    ]
    if parts and all(cfg.weights.get(part, 1.0) == 0 for part in parts):
        errors.append(
            f"scoring.weights={cfg.weights} gives every part ({', '.join(parts)}) weight 0: every reward would be 0 "
            "and the policy would learn nothing; a part not named has weight 1"
        )
    return errors, rules, function
