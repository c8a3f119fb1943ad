"""``--config PRESET|FILE.yaml`` and ``key=value`` overrides: how a command is given its settings."""

from __future__ import annotations

import argparse

from megatron_rlhf.config.loader import presets

DEFAULT_PRESET = "smoke"
TRAINER_PRESET_PREFIXES = ("ppo-", "sft-", "rm-", "pipeline-")


def add_config_args(
    parser: argparse.ArgumentParser,
    default: str | None = DEFAULT_PRESET,
    example: str = "actor.tp=2 seed=7",
    prefix: str | tuple[str, ...] | None = None,
) -> None:
    """``--config`` and overrides; the help lists the presets of this command only (those named
    ``prefix``..., or any of a tuple of prefixes; without a prefix, the presets of no trainer)."""
    names = [n for n in presets() if (n.startswith(prefix) if prefix else not n.startswith(TRAINER_PRESET_PREFIXES))]
    shown = f"default: {default}" if default else "default: none, the library defaults"
    parser.add_argument(
        "--config",
        default=default,
        help=f"a preset name ({', '.join(names)}) or a YAML file to build on ({shown})",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=f"dotlist overrides, e.g. {example}")
