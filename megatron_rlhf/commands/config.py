"""``megatron-rlhf config``: the resolved configuration of the four models, as YAML."""

from __future__ import annotations

import argparse

from megatron_rlhf.commands.config_args import add_config_args
from megatron_rlhf.config.loader import config_errors, load_config, raise_if_errors, to_yaml

HELP = "print the resolved configuration (preset + overrides) as YAML"
DESCRIPTION = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)


def run(args: argparse.Namespace) -> int:
    """Print the config once every field passes its own check (checks that need the models or the
    world size run when a command starts)."""
    from megatron_rlhf.trainer.smoke import SmokeConfig

    cfg = load_config(args.config, args.overrides, schema=SmokeConfig)
    raise_if_errors(config_errors(cfg))
    print(to_yaml(cfg), end="")
    return 0
