"""PPOLossConfig: defaults and the checks made when a run's config is loaded."""

from __future__ import annotations

import pytest

from megatron_rlhf.config.loader import ConfigError, load_config
from megatron_rlhf.trainer.ppo_config import PPOConfig, check_ppo_config
from megatron_rlhf.training.objectives import PPOLossConfig


def test_dual_clip_is_on_by_default_as_in_verl() -> None:
    assert PPOLossConfig().dual_clip_c == 3.0
    assert PPOLossConfig(dual_clip_c=None).dual_clip_c is None
    with pytest.raises(ValueError, match=r"dual_clip_c=1.0 must be > 1"):
        PPOLossConfig(dual_clip_c=1.0)
    cfg = load_config("ppo-tiny", ["algorithm.loss.dual_clip_c=null"], schema=PPOConfig)
    assert cfg.algorithm.loss.dual_clip_c is None
    assert load_config("ppo-tiny", [], schema=PPOConfig).algorithm.loss.dual_clip_c == 3.0


def test_seq_mean_token_sum_norm_needs_a_positive_scale_factor() -> None:
    assert PPOLossConfig(agg_mode="seq-mean-token-sum-norm", loss_scale_factor=512).loss_scale_factor == 512
    with pytest.raises(ValueError, match="agg_mode=seq-mean-token-sum-norm needs loss_scale_factor"):
        PPOLossConfig(agg_mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="loss_scale_factor=0 must be > 0"):
        PPOLossConfig(loss_scale_factor=0)
    # named with its full key by the run's up-front check, before anything is built
    cfg = load_config("ppo-tiny", ["algorithm.loss.agg_mode=seq-mean-token-sum-norm"], schema=PPOConfig)
    with pytest.raises(ConfigError, match=r"algorithm.loss.agg_mode=seq-mean-token-sum-norm needs loss_scale_factor"):
        check_ppo_config(cfg, 1)
    cfg = load_config(
        "ppo-tiny",
        ["algorithm.loss.agg_mode=seq-mean-token-sum-norm", "algorithm.loss.loss_scale_factor=24"],
        schema=PPOConfig,
    )
    assert cfg.algorithm.loss.loss_scale_factor == 24
