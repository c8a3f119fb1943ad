"""The ``megatron-rlhf`` commands, one module each: its help, its settings and its entry.

A command module holds ``HELP`` (its line in ``megatron-rlhf --help``), ``DESCRIPTION`` (the text of
its own ``--help``, or ``None``), ``add_arguments(parser)`` (``commands/config_args.py``'s
``--config``, ``key=value`` settings and ``--print-config``, and the flags that alias keys) and
``run(args)``, which returns the exit status; ``cli.main`` reports a ``ConfigError``,
``FileNotFoundError`` or ``ValueError`` and exits 2. Its settings are a config dataclass: the
trainer commands (and smoke) offer ``trainer()`` (their schema, start-up checks and run), the others
``schema()``, their dataclass declared beside the command. The work is the library's (``trainer/``,
``checkpoint/convert.py``): a command loads and checks its settings and
calls it.

Every command's parser is built before one runs, so a command module imports at module level only
what its arguments need, and what its run needs inside ``run``: no command pays for another's
imports (a trainer's typo, for one, never loads the other trainers).
"""

from __future__ import annotations

import argparse
from typing import Protocol

from megatron_rlhf.commands import convert, generate, pipeline, plan, ppo, rm, sft, smoke
from megatron_rlhf.commands.trainers import Trainer


class Command(Protocol):
    @property
    def HELP(self) -> str: ...

    @property
    def DESCRIPTION(self) -> str | None: ...

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


class TrainerCommand(Command, Protocol):
    def trainer(self) -> Trainer: ...


class SchemaCommand(Command, Protocol):
    def schema(self) -> type: ...


TRAINERS: dict[str, TrainerCommand] = {"ppo": ppo, "sft": sft, "rm": rm, "pipeline": pipeline}
OTHERS: dict[str, SchemaCommand] = {"generate": generate, "plan": plan, "convert": convert}
COMMANDS: dict[str, Command] = {"smoke": smoke, **TRAINERS, **OTHERS}
"""In the order ``megatron-rlhf --help`` lists them."""


def schema_of(name: str) -> type:
    """The config dataclass of the command ``name`` (plan's: a ppo run's, with the ``plan`` section)."""
    command = {"smoke": smoke, **TRAINERS}.get(name)
    return command.trainer().schema if command is not None else OTHERS[name].schema()
