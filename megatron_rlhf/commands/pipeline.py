"""``megatron-rlhf pipeline``: the built-in task's stages in sequence (``trainer/pipeline.py``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from megatron_rlhf.commands.trainers import Trainer, add_trainer_arguments, run_trainer

if TYPE_CHECKING:
    from megatron_rlhf.parallel.distributed import DistEnv
    from megatron_rlhf.trainer.pipeline_config import PipelineConfig

HELP = "a model made from scratch, then RL: SFT -> reward-model pairs -> RM -> GRPO and PPO -> held-out test"
DESCRIPTION = (
    "Run the stages of the built-in arithmetic task in sequence (sft, pairs, rm, grpo, ppo, test), each a "
    "normal run of its command in output_dir/<stage>; the sections sft, rm, grpo, ppo hold those commands' "
    "configs. With no arguments: the tiny preset (two CPU cores, under 10 minutes; a GPU if present). "
    "Writes pipeline.json with each stage's time and the held-out accuracy of each model."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # The pipeline is the built-in task: its preset is the command, unlike the other trainers'.
    add_trainer_arguments(
        parser, prefix="pipeline-", example="stages=[grpo,test] grpo.max_steps=60", default="pipeline-arith-tiny"
    )


def trainer() -> Trainer:
    from megatron_rlhf.trainer.pipeline_config import PipelineConfig, check_pipeline_config

    return Trainer(PipelineConfig, lambda cfg, _world_size: check_pipeline_config(cfg), _run)


def _run(cfg: PipelineConfig, env: DistEnv, _checked: None) -> object:
    from megatron_rlhf.trainer.pipeline import run_pipeline

    return run_pipeline(cfg, env)


def run(args: argparse.Namespace) -> int:
    return run_trainer(trainer(), args)
