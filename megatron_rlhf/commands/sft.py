"""``megatron-rlhf sft``: supervised fine-tuning (``trainer/sft.py``)."""

from __future__ import annotations

import argparse
import functools
from typing import TYPE_CHECKING

from megatron_rlhf.commands.trainers import OUTPUTS, Trainer, add_trainer_arguments, run_trainer

if TYPE_CHECKING:
    from megatron_rlhf.models.architecture import Architecture
    from megatron_rlhf.parallel.distributed import DistEnv
    from megatron_rlhf.trainer.supervised_config import SFTConfig

HELP = "supervised fine-tuning of a causal LM on prompt/response rows"
DESCRIPTION = (
    "Train a *ForCausalLM on prompt -> response rows (.jsonl/.parquet; columns prompt and response by "
    f"default) with next-token NLL on the response. {OUTPUTS} Example: megatron-rlhf sft "
    "data.train=[train.jsonl] data.validation=[val.jsonl] model.path=/models/Qwen2.5-0.5B"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trainer_arguments(parser, prefix="sft-", example="data.train=[train.jsonl] model.tp=2 max_steps=100")


def trainer() -> Trainer:
    from megatron_rlhf.trainer.supervised_config import SFTConfig, check_config

    return Trainer(SFTConfig, functools.partial(check_config, score_head=False), _run)


def _run(cfg: SFTConfig, env: DistEnv, checked: Architecture) -> object:
    from megatron_rlhf.trainer.sft import run_sft

    return run_sft(cfg, env, checked)


def run(args: argparse.Namespace) -> int:
    return run_trainer(trainer(), args)
