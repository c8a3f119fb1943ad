"""What the trainer commands (ppo, sft, rm, pipeline) share: their config arguments and
``--print-config``, the run's start-up checks before torch.distributed starts, and the run."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megatron_rlhf.commands.config_args import add_config_args, print_config, settings_report
from megatron_rlhf.config.loader import load_config_with_sources

if TYPE_CHECKING:
    from megatron_rlhf.parallel.distributed import DistEnv

OUTPUTS = (
    "Writes metrics.jsonl, TensorBoard events (tb/) and, with save_hf=true, an HF checkpoint (hf/) under "
    "output_dir; loggers=[console,jsonl,tensorboard,wandb] chooses where metrics go."
)
"""What ppo, sft and rm write, for their ``--help``."""


@dataclasses.dataclass(frozen=True)
class Trainer:
    """A trainer command's config schema, its start-up checks and its run."""

    schema: type[Any]
    check: Callable[[Any, int], object]
    """Every check a run makes before it builds anything (``ConfigError``), given the world size."""
    run: Callable[[Any, DistEnv, Any], object]
    """The run, given the config, the process's ``DistEnv`` and what ``check`` returned (so that set-up
    does not check again: a user's reward file is executed once). The schema and the check import no
    megatron-core (``tests/unit/test_schema_imports.py``); the run imports it when it is called, so
    that a bad setting is reported within moments of the start."""
    stops_at_steps: bool = True
    """The run trains through ``trainer/loop.run_loop``, which stops at a step boundary on a signal:
    one from the start of the run on is a stop request (``StopSignals``). False (smoke): INT and
    TERM keep their default action."""


def add_trainer_arguments(
    parser: argparse.ArgumentParser, *, prefix: str, example: str, default: str | None = None
) -> None:
    """``--config`` (a trainer run is the user's own: it builds on the library defaults unless
    ``--config`` names a preset), the overrides and ``--print-config``."""
    add_config_args(parser, default=default, example=example, prefix=prefix)


def run_trainer(trainer: Trainer, args: argparse.Namespace) -> int:
    """Load and check the config, then print it (``--print-config``) or run it; the exit status."""
    cfg, sources = load_config_with_sources(args.config, args.overrides, schema=trainer.schema)
    # The run's own checks, before torch.distributed starts or anything is built: a run and
    # --print-config accept and refuse the same configs. torchrun names the world size.
    checked = trainer.check(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    if args.print_config:
        print_config(cfg, sources)
        return 0
    if os.environ.get("RANK", "0") == "0":
        print(settings_report(cfg, sources), flush=True)
    import torch

    from megatron_rlhf.parallel.distributed import init_distributed
    from megatron_rlhf.trainer.stop import RunStopped, StopSignals

    try:
        # From here on a stop signal is a request, which the loop honours before its first step.
        with StopSignals() if trainer.stops_at_steps else contextlib.nullcontext():
            env = init_distributed(cfg.device, cfg.dist_timeout_s)
            threads = cfg.host_thread_count(env.device)
            if threads is not None:
                torch.set_num_threads(threads)
            trainer.run(cfg, env, checked)
    except RunStopped as stop:  # a signal asked for it (after its checkpoint), or training diverged
        if os.environ.get("RANK", "0") == "0":
            print(f"megatron-rlhf: {stop}", file=sys.stderr if stop.code else sys.stdout, flush=True)
        return stop.code
    return 0
