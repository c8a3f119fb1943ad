"""The ``megatron-rlhf`` commands, one module each: its help, its flags and its entry.

A command module holds ``HELP`` (its line in ``megatron-rlhf --help``), ``DESCRIPTION`` (the text of
its own ``--help``, or ``None``), ``add_arguments(parser)`` and ``run(args)``, which returns the exit
status; ``cli.main`` reports a ``ConfigError``, ``FileNotFoundError`` or ``ValueError`` and exits 2.
The work is the library's (``trainer/``, ``rollout/offline.py``, ``checkpoint/convert.py``): a
command loads and checks its settings and calls it. The trainer commands also offer ``trainer()``:
their config schema, start-up checks and run.

Every command's parser is built before one runs, so a command module imports at module level only
what its flags need, and what its run needs inside ``run``: no command pays for another's imports
(``config``'s check of a typo, for one, never loads the trainers).
"""

from __future__ import annotations

import argparse
from typing import Protocol

from megatron_rlhf.commands import config, convert, generate, pipeline, plan, ppo, rm, sft, smoke
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


TRAINERS: dict[str, TrainerCommand] = {"ppo": ppo, "sft": sft, "rm": rm, "pipeline": pipeline}
COMMANDS: dict[str, Command] = {
    "smoke": smoke,
    **TRAINERS,
    "generate": generate,
    "plan": plan,
    "config": config,
    "convert": convert,
}
"""In the order ``megatron-rlhf --help`` lists them."""
