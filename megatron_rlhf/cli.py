"""The ``megatron-rlhf`` command line. Run it plainly for one process, or under torchrun.

megatron-rlhf ppo [--config PRESET|FILE.yaml] [key=value ...]
megatron-rlhf smoke [--config PRESET|FILE.yaml] [key=value ...]
megatron-rlhf config [--config PRESET|FILE.yaml] [key=value ...]
megatron-rlhf sft [--config PRESET|FILE.yaml] data.train=[FILE.jsonl,...] [key=value ...]
megatron-rlhf rm [--config PRESET|FILE.yaml] data.train=[FILE.jsonl,...] [key=value ...]
megatron-rlhf pipeline [--config PRESET|FILE.yaml] [key=value ...]
megatron-rlhf plan [--config PRESET|FILE.yaml] [key=value ...] --world-size N [--gpu-memory-gib G] [--json]
megatron-rlhf generate --model DIR --input prompts.jsonl --output out.jsonl [--tp N] [sampling flags]
megatron-rlhf convert hf-to-mcore HF_DIR OUT_DIR --tp N --pp M
megatron-rlhf convert mcore-to-hf CKPT_DIR OUT_DIR [--tp N --pp M]

This module only dispatches: each command's flags and entry live in ``megatron_rlhf/commands/``.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_rlhf.commands import COMMANDS
from megatron_rlhf.config.loader import ConfigError
from megatron_rlhf.metrics.log import quiet_console


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rlhf",
        description="Megatron-native RLHF. Runs as one process, or as an SPMD job under torchrun.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        command.add_arguments(commands.add_parser(name, help=command.HELP, description=command.DESCRIPTION))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_console()
    try:
        return COMMANDS[args.command].run(args)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        # Every rank finds the same configuration error: only the first says so. Other errors may
        # be rank-specific (a file missing on one node) and are reported by each rank that hits them.
        if not isinstance(err, ConfigError) or os.environ.get("RANK", "0") == "0":
            print(f"megatron-rlhf: error: {err}", file=sys.stderr)
        return 2
