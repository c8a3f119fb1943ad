"""One config tree: each dataclass checks its own fields, the loader's ``config_errors`` collects
them with their full keys, registries declare what an entry needs, and the ``generate`` flags are
made from the same dataclasses as ``ppo``'s rollout settings."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from megatron_rlhf.algorithms.advantages import ADVANTAGE_ESTIMATORS, EstimatorNeeds
from megatron_rlhf.config.loader import ConfigError, config_errors, load_config
from megatron_rlhf.config.run import DTYPES, Dtype
from megatron_rlhf.rollout.native_config import NativeEngineConfig
from megatron_rlhf.trainer.ppo_config import PPOConfig, check_ppo_config, models_used
from megatron_rlhf.training.optim import OptimConfig

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rlhf"


def _ppo(*overrides: str) -> PPOConfig:
    return load_config("ppo-tiny", list(overrides), schema=PPOConfig)


def test_field_errors_of_every_section_come_together_with_full_keys():
    cfg = _ppo(
        "rollout.sampling.n=0",
        "rollout.engine.max_batch_size=0",
        "actor_optim.lr=0",
        "seed=3",
        "algorithm.loss.agg_mode=mean",
        "algorithm.advantage.gamma=2",
    )
    errors = config_errors(dataclasses.replace(cfg, warmup="sometimes"))  # type: ignore[arg-type]
    for key in (
        "rollout.sampling.n=0",
        "rollout.engine.max_batch_size=0",
        "actor_optim.lr=0",
        "algorithm.loss.agg_mode='mean'",
        "algorithm.advantage.gamma=2",
        "warmup='sometimes' must be one of ['auto', 'always', 'never']",  # a tree built in code
    ):
        assert any(e.startswith(key) for e in errors), (key, errors)
    assert len(errors) == 6
    with pytest.raises(ConfigError) as info:
        check_ppo_config(cfg, 1)
    assert all(e in str(info.value) for e in errors if not e.startswith("warmup="))


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.on_invalid=drop", "data.on_invalid='drop' must be one of ['error', 'skip']"),
        ("device=cdua", "device='cdua' must be one of ['auto', 'cuda', 'cpu']; did you mean 'cuda'?"),
        (
            "rollout.engine.on_long_prompt=truncated",
            "rollout.engine.on_long_prompt='truncated' must be one of ['error', 'truncate']; did you mean 'truncate'?",
        ),
        ("wandb.mode=1", "wandb.mode=1 must be one of ['', 'online', 'offline', 'disabled']"),
    ],
)
def test_a_setting_outside_its_choices_is_refused_when_loaded(override: str, message: str) -> None:
    """Key, value, choices and the closest choice, where one is close, as the merge meets it."""
    with pytest.raises(ConfigError) as info:
        _ppo(override)
    assert str(info.value) == f"override '{override}': {message}"


def test_a_yaml_file_with_a_setting_outside_its_choices_is_named(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("_base_: ppo-tiny\nreference:\n  update: period\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(config), schema=PPOConfig)
    assert str(info.value) == (
        f"{config}: reference.update='period' must be one of ['none', 'periodic', 'ema']; did you mean 'periodic'?"
    )


def test_a_dataclass_built_in_code_checks_its_choices() -> None:
    with pytest.raises(ValueError, match=r"^on_long_prompt='cut' must be one of \['error', 'truncate'\]$"):
        NativeEngineConfig(on_long_prompt="cut")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^decay_style='cosin' must be one of .*; did you mean 'cosine'\?$"):
        OptimConfig(decay_style="cosin")  # type: ignore[arg-type]


def test_every_dtype_but_auto_names_a_torch_dtype() -> None:
    assert set(typing.get_args(Dtype)) == {"auto", *DTYPES}


def test_a_dataclass_built_in_code_checks_itself_at_once():
    with pytest.raises(ValueError, match=r"^max_batch_size=0 must be >= 1"):
        NativeEngineConfig(max_batch_size=0)


def test_unused_models_and_optimizers_are_not_checked():
    """GRPO without a critic: the critic's optimizer settings do not matter and are not checked."""
    cfg = _ppo("critic_optim.lr=0", "critic.tp=0")
    assert "critic" not in models_used(cfg)
    check_ppo_config(cfg, 1)
    with pytest.raises(ConfigError, match=r"critic_optim.lr=0.0 must be > 0"):
        check_ppo_config(_ppo("critic_optim.lr=0", "algorithm.advantage_estimator=gae"), 1)


def test_a_new_estimator_declares_its_needs_and_the_trainer_follows():
    """A toy estimator needing neither a critic nor groups runs through the checks with n=1."""

    @ADVANTAGE_ESTIMATORS.register("toy_outcome", info=EstimatorNeeds())
    def toy(*, token_rewards, response_mask, values, group_index, config):
        advantages = token_rewards.sum(1, keepdim=True) * response_mask
        return advantages, advantages

    try:
        cfg = _ppo("algorithm.advantage_estimator=toy_outcome", "rollout.sampling.n=1", "prompts_per_step=16")
        assert "critic" not in check_ppo_config(cfg, 1).archs
    finally:
        ADVANTAGE_ESTIMATORS.unregister("toy_outcome")
    # A built-in one that needs no groups: REINFORCE++ with one sample per prompt.
    check_ppo_config(
        _ppo("algorithm.advantage_estimator=reinforce_pp", "rollout.sampling.n=1", "prompts_per_step=16"), 1
    )
    with pytest.raises(ConfigError, match="the grpo estimator compares the samples"):
        check_ppo_config(_ppo("rollout.sampling.n=1", "prompts_per_step=16"), 1)
    assert "critic" in models_used(_ppo("algorithm.advantage_estimator=gae"))


def _names_compared_with_literals(source: str) -> list[str]:
    """``x.advantage_estimator == "gae"``-style comparisons of a registered name with a literal."""
    registered = ("estimator", "agg_mode", "kl_penalty", "kl_controller")
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            literal = any(isinstance(s, ast.Constant) and isinstance(s.value, str) for s in sides)
            named = [ast.unparse(s) for s in sides if isinstance(s, (ast.Attribute, ast.Name))]
            if literal and any(word in name for name in named for word in registered):
                found.append(ast.unparse(node))
    return found


def test_no_call_site_compares_a_registered_name_with_a_literal():
    assert _names_compared_with_literals('if algo.advantage_estimator != "gae": pass')  # the check can fail
    offenders = {
        str(p.relative_to(PACKAGE)): hits
        for p in PACKAGE.rglob("*.py")
        if (hits := _names_compared_with_literals(p.read_text()))
    }
    assert not offenders, offenders


def test_rules_logged_under_the_same_metric_name_are_refused():
    """Rule names are snake_cased into their metric key, reward/rule/<name>: two that meet are refused."""
    rules = "[megatron_rlhf.rewards.rules:lowercase_fraction,megatron_rlhf.rewards.rules:lowercase.fraction]"
    with pytest.raises(
        ConfigError,
        match=r"scoring.rules: 'megatron_rlhf.rewards.rules:lowercase_fraction' and "
        r"'megatron_rlhf.rewards.rules:lowercase.fraction' would both be logged as "
        r"reward/rule/megatron_rlhf_rewards_rules_lowercase_fraction",
    ):
        check_ppo_config(_ppo(f"scoring.rules={rules}"), 1)
