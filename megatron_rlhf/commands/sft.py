"""``megatron-rlhf sft``: supervised fine-tuning (``trainer/sft.py``)."""

from __future__ import annotations

import argparse
import functools

from megatron_rlhf.commands.trainers import OUTPUTS, Trainer, add_trainer_arguments, run_trainer

HELP = "supervised fine-tuning of a causal LM on prompt/response rows"
DESCRIPTION = (
    "Train a *ForCausalLM on prompt -> response rows (.jsonl/.parquet; columns prompt and response by "
    f"default) with next-token NLL on the response. {OUTPUTS} Example: megatron-rlhf sft "
    "data.train=[train.jsonl] data.validation=[val.jsonl] model.path=/models/Qwen2.5-0.5B"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trainer_arguments(parser, prefix="sft-", example="data.train=[train.jsonl] model.tp=2 max_steps=100")


def trainer() -> Trainer:
    from megatron_rlhf.trainer.sft import SFTConfig, run_sft
    from megatron_rlhf.trainer.supervised import check_config

    return Trainer(SFTConfig, functools.partial(check_config, score_head=False), run_sft)


def run(args: argparse.Namespace) -> int:
    return run_trainer(trainer(), args)
