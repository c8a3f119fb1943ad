"""``megatron-rlhf ppo``: RL from prompts with the hybrid engine (``trainer/ppo.py``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from megatron_rlhf.commands.trainers import OUTPUTS, Trainer, add_trainer_arguments, run_trainer

if TYPE_CHECKING:
    from megatron_rlhf.parallel.distributed import DistEnv
    from megatron_rlhf.trainer.ppo_config import CheckedConfig, PPOConfig

HELP = "RL from prompts: PPO (critic, GAE) or GRPO-style group baselines, with the hybrid engine"
DESCRIPTION = (
    "Each step: generate responses with the hybrid engine, score them (reward model and/or rule functions), "
    "compute reference log-probs and values, advantages, then update the actor and critic. Without "
    "--config it builds on the library defaults (docs/defaults.md): name the model (actor.path), the prompts "
    "(data.train) and the reward (scoring.*). The demo, --config ppo-tiny: GRPO on built-in tiny models and "
    f"prompts (no download; GPU if present, else CPU). {OUTPUTS}"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trainer_arguments(parser, prefix="ppo-", example="actor.tp=2 rollout.tp=1 prompts_per_step=64")


def trainer() -> Trainer:
    from megatron_rlhf.trainer.ppo_config import PPOConfig, check_ppo_config

    return Trainer(PPOConfig, check_ppo_config, _run)


def _run(cfg: PPOConfig, env: DistEnv, checked: CheckedConfig) -> object:
    from megatron_rlhf.trainer.ppo import run_ppo

    return run_ppo(cfg, env, checked)


def run(args: argparse.Namespace) -> int:
    return run_trainer(trainer(), args)
