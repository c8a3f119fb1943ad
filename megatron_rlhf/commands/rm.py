"""``megatron-rlhf rm``: reward-model training on preference pairs (``trainer/rm.py``)."""

from __future__ import annotations

import argparse
import functools
from typing import TYPE_CHECKING

from megatron_rlhf.commands.trainers import OUTPUTS, Trainer, add_trainer_arguments, run_trainer

if TYPE_CHECKING:
    from megatron_rlhf.models.architecture import Architecture
    from megatron_rlhf.parallel.distributed import DistEnv
    from megatron_rlhf.trainer.supervised_config import RMConfig

HELP = "reward-model training on preference pairs (Bradley-Terry)"
DESCRIPTION = (
    "Train a *ForSequenceClassification (score head) on prompt/chosen/rejected rows with the Bradley-Terry "
    f"loss; validation reports preference accuracy. {OUTPUTS} Example: megatron-rlhf rm "
    "model.path=/models/rm-init data.train=[prefs.jsonl] data.validation=[prefs-val.jsonl]"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trainer_arguments(parser, prefix="rm-", example="data.train=[prefs.jsonl] optim.lr=1e-5")


def trainer() -> Trainer:
    from megatron_rlhf.trainer.supervised_config import RMConfig, check_config

    return Trainer(RMConfig, functools.partial(check_config, score_head=True), _run)


def _run(cfg: RMConfig, env: DistEnv, checked: Architecture) -> object:
    from megatron_rlhf.trainer.rm import run_rm

    return run_rm(cfg, env, checked)


def run(args: argparse.Namespace) -> int:
    return run_trainer(trainer(), args)
