"""The health watch's pure parts (``trainer/health.py``): its settings' errors, the validation
patience, and each per-step signal against hand-computed figures."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from megatron_rlhf.config.loader import config_errors
from megatron_rlhf.trainer.health import (
    HealthConfig,
    HealthState,
    higher_is_better,
    judge_evaluation,
    step_signals,
    triggered,
    update_streaks,
    warning_due,
    watched_metric,
)
from megatron_rlhf.trainer.loop_config import LoopConfig


def test_settings_are_checked_up_front() -> None:
    bad = HealthConfig(
        val_patience=-1,
        lr_factor=0.0,
        kl_coef_factor=0.5,
        max_uniform_group_fraction=1.5,
        min_response_length=10,
        max_response_length=5,
        max_phase_s={"gen": 0.0},
        signal_steps=0,
        roll_back_on=["kl_blowup", "nonsense"],  # type: ignore[list-item]
    )
    errors = config_errors(LoopConfig(health=bad))
    assert "health.val_patience=-1 must be >= 0" in errors
    assert "health.signal_steps=0 must be >= 1" in errors
    assert any(e.startswith("health.lr_factor=0.0 must be in (0, 1]") for e in errors)
    assert any(e.startswith("health.kl_coef_factor=0.5 must be >= 1") for e in errors)
    # A factor that would raise the learning rate after instability is refused too.
    raised = config_errors(LoopConfig(health=HealthConfig(lr_factor=2.0)))
    assert any(e.startswith("health.lr_factor=2.0 must be in (0, 1]") for e in raised)
    assert config_errors(LoopConfig(health=HealthConfig(lr_factor=1.0, kl_coef_factor=1.0))) == []
    assert "health.max_uniform_group_fraction=1.5 must be <= 1 (a share)" in errors
    assert "health.max_response_length=5 must be above min_response_length=10" in errors
    assert "health.max_phase_s.gen=0.0 must be > 0" in errors
    assert any("['nonsense'] are not signals" in e for e in errors)
    assert any("['kl_blowup'] have no threshold set" in e for e in errors)
    assert config_errors(LoopConfig()) == []
    figures = ["greedy_accuracy", "pass_at_4"]
    assert HealthConfig(val_patience=2).validation_errors([], 5, figures) == [
        "health.val_patience=2 needs evaluations during the run: give data.validation and eval_every > 0 "
        "(now data.validation=[], eval_every=5)"
    ]
    assert HealthConfig(val_patience=2).validation_errors(["v.jsonl"], 5, figures) == []
    assert HealthConfig().validation_errors([], 0, figures) == []
    assert not HealthConfig().active and HealthConfig(max_phase_s={"gen": 1.0}).active


def test_val_metric_must_be_a_figure_of_the_run_before_it_starts() -> None:
    watched = HealthConfig(val_patience=2, val_metric="pass_at_8")
    assert watched.validation_errors(["v.jsonl"], 5, ["greedy_accuracy", "pass_at_4"], per_source=True) == [
        "health.val_metric='pass_at_8' is not a validation figure of this run; they are ['greedy_accuracy', "
        "'pass_at_4'] (each also per data_source, as <data_source>/<figure>)"
    ]
    per_source = HealthConfig(val_patience=2, val_metric="gsm8k/pass_at_4")
    assert per_source.validation_errors(["v.jsonl"], 5, ["pass_at_4"], per_source=True) == []
    assert per_source.validation_errors(["v.jsonl"], 5, ["pass_at_4"]) != []  # sft and rm have no data_source
    assert HealthConfig(val_metric="nonsense").validation_errors([], 0, ["nll"]) == []  # the watch is off


def test_direction_of_the_watched_figure() -> None:
    assert higher_is_better("greedy_accuracy", "auto")
    assert not higher_is_better("nll", "auto") and not higher_is_better("val/loss", "auto")
    assert not higher_is_better("greedy_accuracy", "min") and higher_is_better("nll", "max")
    figures = {"greedy_accuracy": 0.5, "greedy_reward": 0.2}
    assert watched_metric(HealthConfig(), figures) == "greedy_accuracy"  # the headline: the first figure
    assert watched_metric(HealthConfig(val_metric="greedy_reward"), figures) == "greedy_reward"
    with pytest.raises(KeyError, match="'pass_at_4' is not a validation figure"):
        watched_metric(HealthConfig(val_metric="pass_at_4"), figures)


def test_patience_counts_evaluations_in_a_row_below_the_best() -> None:
    state = HealthState()
    verdicts = [judge_evaluation(state, v, higher=True) for v in (0.2, 0.5, 0.4, 0.5, 0.3, 0.1, 0.6, math.nan)]
    assert verdicts == ["best", "best", "below", "equal", "below", "below", "best", "below"]
    assert state.best == 0.6 and state.below == 1
    low = HealthState()
    assert [judge_evaluation(low, v, higher=False) for v in (2.0, 1.5, 1.7, 1.8)] == ["best", "best", "below", "below"]
    assert low.below == 2 and low.best == 1.5
    assert HealthState.from_json(low.as_json()) == low and HealthState.from_json(None) == HealthState()


def test_each_signal_against_hand_computed_figures() -> None:
    cfg = HealthConfig(
        min_entropy=0.5,
        min_response_length=4,
        max_response_length=100,
        max_uniform_group_fraction=1.0,
        max_kl=10.0,
        max_phase_s={"gen": 1.0},
        max_phase_std_s={"update_actor": 0.1},
    )
    healthy = {
        "actor/entropy": 1.2,
        "response_length/mean": 37.5,
        "rollout/uniform_group_fraction": 0.75,
        "kl/per_sequence": 2.0,
        "timing_s/gen": 0.9,
        "timing_s/update_actor/std": 0.05,
    }
    figures, fired = step_signals(cfg, healthy)
    assert fired == [] and set(figures.values()) == {0.0}
    assert sorted(figures) == [
        "health/entropy_collapse",
        "health/jitter/update_actor",
        "health/kl_blowup",
        "health/length_blowup",
        "health/length_collapse",
        "health/slow/gen",
        "health/uniform_groups",
    ]
    sick = {
        "actor/entropy": 0.3,  # < 0.5
        "response_length/mean": 2.0,  # < 4
        "rollout/uniform_group_fraction": 1.0,  # every group: at the line
        "kl/per_sequence": 12.5,  # > 10
        "timing_s/gen": 1.25,  # > 1.0 s
        "timing_s/update_actor/std": math.nan,  # not finite: fires
    }
    figures, fired = step_signals(cfg, sick)
    assert {f.metric for f in fired} == {m for m, v in figures.items() if v} == set(figures) - {"health/length_blowup"}
    by_metric = {f.metric: f for f in fired}
    assert by_metric["health/slow/gen"].warning(7, 1) == (
        "health: step 7: health/slow/gen: timing_s/gen 1.25 is above 1; check data loading and the tokenizer "
        "cache (gen), reward code (reward), host offload and other jobs on the node"
    )
    assert "is above 1 (4 steps in a row; next warning at 8); check" in by_metric["health/slow/gen"].warning(7, 4)
    assert "is below 0.5" in by_metric["health/entropy_collapse"].warning(7, 1)
    assert "is at or above 1" in by_metric["health/uniform_groups"].warning(7, 1)
    # Figures the step does not report, and a KL of 0 (no reference), are not watched.
    assert step_signals(cfg, {"kl/per_sequence": 0.0}) == ({}, [])
    assert step_signals(HealthConfig(), sick) == ({}, [])


def test_a_signal_triggers_after_signal_steps_in_a_row() -> None:
    cfg = HealthConfig(max_kl=10.0, min_entropy=0.5, signal_steps=2, roll_back_on=["kl_blowup"])
    state = HealthState()
    outcomes = []
    for kl, entropy in ((12.0, 0.1), (3.0, 0.1), (12.0, 0.1), (13.0, 0.1)):
        figures, fired = step_signals(cfg, {"kl/per_sequence": kl, "actor/entropy": entropy})
        update_streaks(state, figures)
        outcomes.append([f.metric for f in triggered(cfg, state, fired)])
    # The KL fires at steps 1, 3 and 4: two in a row only at step 4; entropy fires always but is not in roll_back_on.
    assert outcomes == [[], [], [], ["health/kl_blowup"]]
    assert state.streaks == {"health/kl_blowup": 2, "health/entropy_collapse": 4}


def test_a_lasting_signal_is_printed_at_doubling_streaks() -> None:
    assert [streak for streak in range(0, 70) if warning_due(streak)] == [1, 2, 4, 8, 16, 32, 64]


def test_ppos_and_sfts_checks_name_an_unknown_val_metric_before_the_run(tmp_path: Path) -> None:
    from megatron_rlhf.config.loader import ConfigError, load_config
    from megatron_rlhf.trainer.ppo_config import PPOConfig, check_ppo_config
    from megatron_rlhf.trainer.supervised_config import SFTConfig, check_config

    def ppo(*overrides: str) -> PPOConfig:
        watch = ("health.val_patience=2", "eval_every=2", "data.validation=[builtin:lowercase-prompts]", "eval.n=4")
        return load_config("ppo-tiny", [*watch, *overrides], schema=PPOConfig)

    with pytest.raises(ConfigError, match=r"health.val_metric='pass_at_8' is not a validation figure of this run"):
        check_ppo_config(ppo("health.val_metric=pass_at_8"), 1)
    check_ppo_config(ppo("health.val_metric=pass_at_4"), 1)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a", "response": "b"}\n')
    sft = load_config(
        "sft-tiny",
        [f"data.train=[{rows}]", f"data.validation=[{rows}]", "eval_every=2", "health.val_patience=2"]
        + ["health.val_metric=accuracy"],
        schema=SFTConfig,
    )
    with pytest.raises(ConfigError, match=r"they are \['nll', 'perplexity', 'tokens', 'examples'\]"):
        check_config(sft, 1, score_head=False)


def test_a_rollback_that_pruning_would_leave_without_a_checkpoint_is_refused_up_front() -> None:
    """Before: save_every=1 and keep_last=2 pruned the checkpoint from before a 3-step signal, and
    the watch stopped the run (exit 3) where it was to roll back."""
    health = HealthConfig(max_kl=1.0, signal_steps=3, roll_back_on=["kl_blowup"])
    errors = config_errors(LoopConfig(save_every=1, keep_last=2, health=health))
    assert any("set keep_last >= 4 (0 keeps all)" in e for e in errors), errors
    for enough in (
        LoopConfig(save_every=1, keep_last=4, health=health),
        LoopConfig(save_every=2, keep_last=3, health=health),
    ):
        assert config_errors(enough) == []
    assert config_errors(LoopConfig(save_every=1, keep_last=0, health=health)) == []
