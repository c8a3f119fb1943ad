"""``megatron-rlhf smoke``: build the four models and run a forward pass (``trainer/smoke.py``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from megatron_rlhf.commands.config_args import add_config_args
from megatron_rlhf.commands.trainers import Trainer, run_trainer

if TYPE_CHECKING:
    from megatron_rlhf.parallel.distributed import DistEnv
    from megatron_rlhf.trainer.smoke_config import SmokeConfig

HELP = "build the four models (actor, critic, reference, reward) in their layouts and run a forward pass"
DESCRIPTION = (
    "Validate the config, build actor, critic, reference and reward models in their own "
    "TP/PP layouts, load their weights and run a forward pass through each. With no arguments it "
    "uses built-in tiny random models: no download, GPU if present, else CPU mode."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)


def trainer() -> Trainer:
    """Smoke's run has the trainers' shape: the checks (also ``--print-config``'s), then the run."""
    from megatron_rlhf.trainer.smoke_config import SmokeConfig, check_smoke_config

    return Trainer(SmokeConfig, check_smoke_config, _run, stops_at_steps=False)


def _run(cfg: SmokeConfig, env: DistEnv, _archs: object) -> object:
    from megatron_rlhf.trainer.smoke import run_smoke

    return run_smoke(cfg, env)


def run(args: argparse.Namespace) -> int:
    return run_trainer(trainer(), args)
