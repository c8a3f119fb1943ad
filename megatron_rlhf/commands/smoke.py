"""``megatron-rlhf smoke``: build the four models and run a forward pass (``trainer/smoke.py``)."""

from __future__ import annotations

import argparse

from megatron_rlhf.commands.config_args import add_config_args
from megatron_rlhf.config.loader import load_config

HELP = "build the four models (actor, critic, reference, reward) in their layouts and run a forward pass"
DESCRIPTION = (
    "Validate the config, build actor, critic, reference and reward models in their own "
    "TP/PP layouts, load their weights and run a forward pass through each. With no arguments it "
    "uses built-in tiny random models: no download, GPU if present, else CPU mode."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)


def run(args: argparse.Namespace) -> int:
    from megatron_rlhf.parallel.distributed import init_distributed
    from megatron_rlhf.trainer.smoke import SmokeConfig, run_smoke

    cfg = load_config(args.config, args.overrides, schema=SmokeConfig)
    run_smoke(cfg, init_distributed(cfg.device, cfg.dist_timeout_s))
    return 0
