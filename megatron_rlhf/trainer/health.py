"""The health watch (``health.*``): a run that collapses with finite numbers is caught, rolled back to
its best evaluation's checkpoint and continued with a gentler recovery, or stopped.

Two kinds of watch, both off by default:

* **Validation regression** (``val_patience``): each evaluation is compared with the best so far
  (``val_metric``, by default the run's headline validation figure, the first one the task reports).
  An evaluation that sets a new best is saved as a checkpoint whatever ``save_every`` says, and that
  checkpoint is kept by ``keep_last``'s pruning; ``val_patience`` evaluations in a row below the best
  roll the run back to it.
* **Collapse signals, every step**: each has a threshold (0: off), a ``health/<signal>`` metric (1 when
  it fires, 0 when not) and a warning line that says what to check. A signal named in
  ``roll_back_on`` that fires ``signal_steps`` steps in a row also rolls the run back: to the best
  evaluation's checkpoint, else the newest checkpoint from before the signal's run of steps.

A rollback (``loop._Steps.roll_back``, the same code as the rollback after non-finite losses) loads the
checkpoint, multiplies the learning rates by ``lr_factor`` and the KL coefficients by
``kl_coef_factor`` (cumulatively: the second rollback applies them twice), and redoes the steps after
the checkpoint with another data order, so with fresh prompts and samples. When ``max_rollbacks``
rollbacks are spent, the next one stops the run with exit code 3 after exporting the best
evaluation's model (else the newest checkpoint's) as ``hf/``.

This module holds the settings and the pure decisions (no megatron-core, no process group): the loop
calls them with the figures every rank has alike, so every rank decides alike.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Literal

from megatron_rlhf.config.fields import at_least

Signal = Literal[
    "entropy_collapse", "length_collapse", "length_blowup", "uniform_groups", "kl_blowup", "slow", "jitter"
]
"""The per-step collapse signals; ``slow`` and ``jitter`` cover every phase ``max_phase_s`` and
``max_phase_std_s`` name (metrics ``health/slow/<phase>``, ``health/jitter/<phase>``)."""
SIGNALS: tuple[Signal, ...] = (
    "entropy_collapse",
    "length_collapse",
    "length_blowup",
    "uniform_groups",
    "kl_blowup",
    "slow",
    "jitter",
)

SIGNAL_SETTINGS: dict[Signal, str] = {
    "entropy_collapse": "min_entropy",
    "length_collapse": "min_response_length",
    "length_blowup": "max_response_length",
    "uniform_groups": "max_uniform_group_fraction",
    "kl_blowup": "max_kl",
    "slow": "max_phase_s",
    "jitter": "max_phase_std_s",
}
"""Each signal's setting: its threshold (0 or empty: off)."""

_NO_FIGURE: dict[Signal, str] = {
    "entropy_collapse": "no policy entropy: only RL steps report it",
    "length_collapse": "no sampled responses: only RL steps have them",
    "length_blowup": "no sampled responses: only RL steps have them",
    "uniform_groups": "no groups: only RL steps with rollout.sampling.n > 1 have them",
    "kl_blowup": "no KL: it needs a reference, which a KL penalty or KL loss brings",
    "slow": "",
    "jitter": "",
}
"""Why a run may have no figure for a signal (``reach_errors``)."""

ENTROPY_METRIC = "actor/entropy"
LENGTH_METRIC = "response_length/mean"
UNIFORM_METRIC = "rollout/uniform_group_fraction"
KL_METRIC = "kl/per_sequence"

_LOWER_IS_BETTER = ("loss", "nll", "perplexity", "ppl")


@dataclasses.dataclass(kw_only=True)
class HealthConfig:
    """The health watch: validation patience with rollback to the best evaluation, the recovery a
    rollback applies, and per-step collapse signals (each 0: off)."""

    val_patience: int = 0
    """Evaluations in a row below the best one that roll the run back to the best evaluation's
    checkpoint (saved at every new best, whatever save_every says). 0: off. Needs validation data
    and eval_every."""
    val_metric: str = ""
    """The validation figure watched; empty: the run's headline one (the first the task reports:
    ppo's greedy_accuracy, sft's nll, rm's accuracy)."""
    val_mode: Literal["auto", "max", "min"] = "auto"
    """Whether higher (max) or lower (min) is better for val_metric; auto: min for a name ending in
    loss, nll or perplexity, else max."""
    max_rollbacks: int = 2
    """Rollbacks the watch may make; when they are spent, the next one stops the run with exit code
    3, exporting the best evaluation's model as hf/ (not the last one)."""
    lr_factor: float = 0.5
    """Each rollback multiplies every trained model's learning rate (its schedule's peak and floor)
    by this, in (0, 1]."""
    kl_coef_factor: float = 2.0
    """Each rollback multiplies the KL coefficients (the reward penalty's and the actor loss's
    kl_loss_coef; an adaptive controller restarts from its coef times the factors) by this, >= 1."""
    min_entropy: float = 0.0
    """Entropy collapse: the policy's mean token entropy (actor/entropy, nats) below this. 0: off."""
    min_response_length: float = 0.0
    """Response length collapse: the mean response length (tokens) below this. 0: off."""
    max_response_length: float = 0.0
    """Response length blow-up: the mean response length (tokens) above this. 0: off."""
    max_uniform_group_fraction: float = 0.0
    """All groups uniform: the share of prompts whose samples all got the same score (no signal for
    GRPO) at or above this; 1.0: every group. 0: off."""
    max_kl: float = 0.0
    """KL blow-up: the sampled responses' KL to the reference (kl/per_sequence, summed over a
    response's tokens) above this. 0: off."""
    max_phase_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Phase time water-lines: phase -> seconds (e.g. {gen: 1.0}); a step whose timing_s/<phase>
    exceeds its line fires health/slow/<phase>."""
    max_phase_std_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Phase jitter water-lines: phase -> seconds (e.g. {update_actor: 0.1}); the std of the phase's
    time over recent steps (timing_s/<phase>/std) above its line fires health/jitter/<phase>."""
    signal_steps: int = 1
    """Steps in a row a signal must fire before roll_back_on acts on it (a warning is printed at the
    1st, 2nd, 4th, 8th, ... firing step in a row; its health/ metric is written at every step)."""
    roll_back_on: list[Signal] = dataclasses.field(default_factory=list)
    """Signals that also roll the run back (entropy_collapse, length_collapse, length_blowup,
    uniform_groups, kl_blowup, slow, jitter); each needs its threshold set."""

    def errors(self) -> list[str]:
        errors = at_least(
            self,
            0,
            "val_patience",
            "max_rollbacks",
            "min_entropy",
            "min_response_length",
            "max_response_length",
            "max_uniform_group_fraction",
            "max_kl",
        ) + at_least(self, 1, "signal_steps")
        # A rollback answers instability: it may keep the learning rate or the KL weight, never
        # raise the one or lower the other.
        if not 0 < self.lr_factor <= 1:
            errors.append(
                f"lr_factor={self.lr_factor} must be in (0, 1]: a rollback lowers the learning rate or keeps it"
            )
        if not self.kl_coef_factor >= 1:
            errors.append(
                f"kl_coef_factor={self.kl_coef_factor} must be >= 1: a rollback raises the KL weight or keeps it"
            )
        if self.max_uniform_group_fraction > 1:
            errors.append(f"max_uniform_group_fraction={self.max_uniform_group_fraction} must be <= 1 (a share)")
        if 0 < self.max_response_length <= self.min_response_length:
            errors.append(
                f"max_response_length={self.max_response_length} must be above "
                f"min_response_length={self.min_response_length}"
            )
        for name in ("max_phase_s", "max_phase_std_s"):
            limits = getattr(self, name).items()
            errors += [f"{name}.{phase}={limit} must be > 0" for phase, limit in limits if not limit > 0]
        bad = [s for s in self.roll_back_on if s not in SIGNALS]
        if bad:
            errors.append(f"roll_back_on={self.roll_back_on}: {bad} are not signals; they are {list(SIGNALS)}")
        off = [s for s in self.roll_back_on if s in SIGNALS and not self.signal_enabled(s)]
        if off:
            errors.append(f"roll_back_on={self.roll_back_on}: {off} have no threshold set (0 or empty: off)")
        return errors

    def signal_enabled(self, signal: Signal) -> bool:
        return bool(getattr(self, SIGNAL_SETTINGS[signal]))

    def reach_errors(self, reported: Collection[Signal], phases: Collection[str]) -> list[str]:
        """What a run could never act on: a signal set whose figure it does not report (``reported``:
        the signals it can fire), and a phase it does not time (``phases``, each with a
        ``timing_s/<phase>/std``; ``step``, every trainer's whole step, has no std)."""
        errors = [
            f"health.{SIGNAL_SETTINGS[s]}={getattr(self, SIGNAL_SETTINGS[s])}: this run has no figure the {s} "
            f"signal could act on ({_NO_FIGURE[s]})"
            for s in SIGNALS
            if s not in ("slow", "jitter") and self.signal_enabled(s) and s not in reported
        ]
        for name, allowed in (("max_phase_s", [*phases, "step"]), ("max_phase_std_s", list(phases))):
            unknown = [phase for phase in getattr(self, name) if phase not in allowed]
            if unknown:
                errors.append(f"health.{name}: {unknown} are not phases of this run; they are {allowed}")
        return errors

    def validation_errors(
        self, validation: list[str], eval_every: int, figures: Sequence[str], *, per_source: bool = False
    ) -> list[str]:
        """The patience needs evaluations during the run: validation data and ``eval_every``; and
        ``val_metric`` must be one of the run's validation ``figures`` (with ``per_source``, also as
        ``<data_source>/<figure>``), found now rather than at the first evaluation."""
        if not self.val_patience:
            return []
        errors = []
        if not (validation and eval_every > 0):
            errors.append(
                f"health.val_patience={self.val_patience} needs evaluations during the run: give data.validation "
                f"and eval_every > 0 (now data.validation={validation}, eval_every={eval_every})"
            )
        name = self.val_metric.rsplit("/", 1)[-1] if per_source else self.val_metric
        if self.val_metric and name not in figures:
            errors.append(
                f"health.val_metric={self.val_metric!r} is not a validation figure of this run; they are "
                f"{list(figures)}" + (" (each also per data_source, as <data_source>/<figure>)" if per_source else "")
            )
        return errors

    @property
    def active(self) -> bool:
        """Whether any part of the watch is on."""
        return bool(self.val_patience) or any(self.signal_enabled(s) for s in SIGNALS)


# --------------------------------------------------------------------------- validation patience


def higher_is_better(metric: str, mode: Literal["auto", "max", "min"]) -> bool:
    """max/min as given; auto: lower is better for a name ending in loss, nll, perplexity or ppl."""
    if mode != "auto":
        return mode == "max"
    return not metric.rsplit("/", 1)[-1].endswith(_LOWER_IS_BETTER)


def watched_metric(cfg: HealthConfig, figures: Mapping[str, float]) -> str:
    """``val_metric``, or the first figure of an evaluation (its headline)."""
    if cfg.val_metric:
        if cfg.val_metric not in figures:
            raise KeyError(
                f"health.val_metric={cfg.val_metric!r} is not a validation figure; they are {sorted(figures)}"
            )
        return cfg.val_metric
    return next(iter(figures))


@dataclasses.dataclass
class HealthState:
    """What the watch carries from evaluation to evaluation and across rollbacks (kept in every
    checkpoint's ``run_state.json`` under ``loop.health``)."""

    best: float | None = None
    """The best value of the watched figure so far (None: no evaluation yet)."""
    best_step: int = -1
    """The step of that evaluation; its checkpoint is ``step_<best_step>`` (-1: none)."""
    below: int = 0
    """Evaluations in a row below the best."""
    rollbacks: int = 0
    """Rollbacks the watch has made."""
    lr_scale: float = 1.0
    """The product of the lr_factor of every rollback made: the learning rates are the config's
    times this."""
    kl_scale: float = 1.0
    """The same for kl_coef_factor and the KL coefficients."""
    streaks: dict[str, int] = dataclasses.field(default_factory=dict)
    """Per signal metric (``health/...``): the steps in a row it has fired, up to now."""

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> HealthState:
        return cls(**data) if data else cls()


Verdict = Literal["best", "equal", "below"]


def judge_evaluation(state: HealthState, value: float, *, higher: bool) -> Verdict:
    """Update ``state`` with an evaluation's watched ``value``: a new best (also the first
    evaluation) resets the count, an equal one too, one below the best adds to it. A non-finite value
    counts as below."""
    if state.best is None and math.isfinite(value):
        state.best, state.below = value, 0
        return "best"
    better = math.isfinite(value) and (value > state.best if higher else value < state.best)  # type: ignore[operator]
    if better:
        state.best, state.below = value, 0
        return "best"
    if value == state.best:
        state.below = 0
        return "equal"
    state.below += 1
    return "below"


# --------------------------------------------------------------------------- per-step signals


@dataclasses.dataclass(frozen=True)
class Firing:
    """A signal that fired at a step."""

    metric: str
    """Its ``health/...`` metric."""
    signal: Signal
    figure: str
    """The metric it read, e.g. ``actor/entropy``."""
    value: float
    threshold: float
    check: str
    """What to check, for the warning line."""

    def warning(self, step: int, streak: int) -> str:
        """The warning line at the ``streak``-th step in a row it fired."""
        relation = "below" if self.signal in ("entropy_collapse", "length_collapse") else "above"
        if self.signal == "uniform_groups":
            relation = "at or above"
        repeated = f" ({streak} steps in a row; next warning at {2 * streak})" if streak > 1 else ""
        return (
            f"health: step {step}: {self.metric}: {self.figure} {self.value:.4g} is {relation} "
            f"{self.threshold:g}{repeated}; {self.check}"
        )


def warning_due(streak: int) -> bool:
    """Whether a signal firing for the ``streak``-th step in a row is printed: at 1, 2, 4, 8, ..., so
    that a lasting signal does not flood the log (its ``health/...`` metric is written every step)."""
    return streak > 0 and streak & (streak - 1) == 0


_CHECKS: dict[Signal, str] = {
    "entropy_collapse": (
        "the policy is becoming deterministic (entropy collapse): check the learning rate and clipping, "
        "add algorithm.loss.entropy_coef or a KL term, and whether the rewards are being hacked"
    ),
    "length_collapse": (
        "responses are collapsing to a few tokens: check samples.jsonl for an early EOS the reward favours, "
        "and the length penalty or reward scale"
    ),
    "length_blowup": (
        "responses are growing to the length limit: check response_length/clip_ratio, samples.jsonl for "
        "repetition, and whether the reward favours length"
    ),
    "uniform_groups": (
        "every sample of most prompts got the same score, so GRPO has no signal: check the reward "
        "function on samples.jsonl, the task's difficulty, rollout.sampling.n and temperature, or set "
        "rollout.filter_groups"
    ),
    "kl_blowup": (
        "the policy is running away from the reference (KL blow-up): lower the learning rate, raise the "
        "KL coefficient (algorithm.kl_penalty.coef, algorithm.loss.kl_loss_coef) or tighten the clip"
    ),
    "slow": (
        "check data loading and the tokenizer cache (gen), reward code (reward), host offload and other "
        "jobs on the node"
    ),
    "jitter": "an unsteady phase time: check the interconnect (PCIe, NVLink), host memory pressure, other jobs",
}


def step_signals(cfg: HealthConfig, metrics: Mapping[str, float]) -> tuple[dict[str, float], list[Firing]]:
    """The ``health/...`` metrics of a step (1.0: fired, 0.0: not) for every enabled signal whose
    figure the step reports (sft has no entropy; a run without a reference has no KL), and the
    signals that fired. A non-finite figure fires its signal."""
    figures: dict[str, float] = {}
    fired: list[Firing] = []

    def watch(
        metric: str, signal: Signal, figure: str, threshold: float, beyond: Callable[[float, float], bool]
    ) -> None:
        if not threshold or figure not in metrics:
            return
        value = float(metrics[figure])
        fires = beyond(value, threshold) or not math.isfinite(value)
        figures[metric] = float(fires)
        if fires:
            fired.append(Firing(metric, signal, figure, value, threshold, _CHECKS[signal]))

    watch("health/entropy_collapse", "entropy_collapse", ENTROPY_METRIC, cfg.min_entropy, operator.lt)
    watch("health/length_collapse", "length_collapse", LENGTH_METRIC, cfg.min_response_length, operator.lt)
    watch("health/length_blowup", "length_blowup", LENGTH_METRIC, cfg.max_response_length, operator.gt)
    # At or above: 1.0 means every group uniform, and the share cannot exceed it.
    watch("health/uniform_groups", "uniform_groups", UNIFORM_METRIC, cfg.max_uniform_group_fraction, operator.ge)
    if metrics.get(KL_METRIC, 0.0) != 0.0:  # 0: no reference (a NaN is != 0 and fires)
        watch("health/kl_blowup", "kl_blowup", KL_METRIC, cfg.max_kl, operator.gt)
    for phase, limit in cfg.max_phase_s.items():
        watch(f"health/slow/{phase}", "slow", f"timing_s/{phase}", limit, operator.gt)
    for phase, limit in cfg.max_phase_std_s.items():
        watch(f"health/jitter/{phase}", "jitter", f"timing_s/{phase}/std", limit, operator.gt)
    return figures, fired


def update_streaks(state: HealthState, figures: Mapping[str, float]) -> None:
    """Each ``health/...`` metric's run of firing steps: one more where it fired, reset where not."""
    state.streaks = {metric: state.streaks.get(metric, 0) + 1 for metric, value in figures.items() if value}


def triggered(cfg: HealthConfig, state: HealthState, fired: list[Firing]) -> list[Firing]:
    """The fired signals that roll the run back: named in ``roll_back_on``, and fired
    ``signal_steps`` steps in a row (``update_streaks`` first)."""
    return [f for f in fired if f.signal in cfg.roll_back_on and state.streaks.get(f.metric, 0) >= cfg.signal_steps]
