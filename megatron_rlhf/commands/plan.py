"""``megatron-rlhf plan``: a ppo, sft or rm run's layouts and per-GPU memory, without a GPU
(``trainer/plan.py``)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import typing
from pathlib import Path
from typing import Any, Literal

from megatron_rlhf.commands import ppo, rm, sft
from megatron_rlhf.commands.config_args import add_config_args, print_config
from megatron_rlhf.config.fields import at_least
from megatron_rlhf.config.flags import add_flag_aliases
from megatron_rlhf.config.loader import ConfigError, config_errors, load_config_with_sources, raise_if_errors

PLANNED = {"ppo": ppo, "sft": sft, "rm": rm}
Planned = Literal["ppo", "sft", "rm"]

HELP = "each model's layout and the per-GPU memory of a ppo, sft or rm run, without a GPU"
DESCRIPTION = (
    "Check a run's config for a world size as the run would, then print each model's layout, the "
    "generation layout, and per-GPU memory (weights, gradients, optimizer state, activations, KV cache) with the "
    "peaks of the training and the generation phase, with and without hybrid.offload, and what "
    "hybrid.offload=auto would decide. Reads only config.json files: no weights, no GPU, no processes. Exits 2 "
    "naming the settings when the run would be refused or its peak exceeds plan.gpu_memory_gib. The settings "
    "are the planned run's, and the plan's own under plan.*. Example: megatron-rlhf plan --config ppo-grpo-1.5b "
    "plan.world_size=8 actor.tp=2"
)


@dataclasses.dataclass(kw_only=True)
class PlanSettings:
    """What ``plan`` plans for and how it prints: the ``plan`` section beside the run's settings."""

    trainer: Planned | None = None
    """The command the run's settings are for (none: from the preset's name, else ppo)."""
    world_size: int = 1
    """GPUs of the run."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU in GiB (an 80 GB A100/H100; an H200 offers about 139.8)."""
    json: bool = False
    """Print the plan as JSON."""

    def errors(self) -> list[str]:
        return at_least(self, 1, "world_size") + ([] if self.gpu_memory_gib > 0 else ["gpu_memory_gib must be > 0"])


@dataclasses.dataclass(kw_only=True)
class WithPlan:
    """A planned run's config: the trainer's settings and ``plan``'s own."""

    plan: PlanSettings = dataclasses.field(default_factory=PlanSettings)
    """What the plan is for (the trainer, the world size, the GPU's memory) and how it is printed."""


@functools.cache
def planned_schema(trainer: Planned) -> type[Any]:
    """``trainer``'s config schema with the ``plan`` section."""
    run_schema = PLANNED[trainer].trainer().schema
    return dataclasses.dataclass(kw_only=True)(type(f"Planned{run_schema.__name__}", (run_schema, WithPlan), {}))


def schema() -> type:
    return planned_schema("ppo")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(
        parser, default=None, example="actor.path=/models/Qwen2.5-7B actor.tp=2", prefix=("ppo-", "sft-", "rm-")
    )
    add_flag_aliases(parser.add_argument_group("flags (each sets the key it names)"), "plan", WithPlan)


def _trainer_of(args: argparse.Namespace) -> Planned:
    """The command a plan is for: the last ``plan.trainer=`` given, else a config file's
    ``plan.trainer`` (a printed plan's), else the preset's name, else ppo."""
    given = [item.partition("=")[2] for item in args.overrides if item.startswith("plan.trainer=")]
    config = Path(args.config or "")
    if not given and config.suffix in (".yaml", ".yml") and config.is_file():
        from omegaconf import OmegaConf

        given = [str(OmegaConf.select(OmegaConf.load(config), "plan.trainer", default=""))]
    named = given[-1] if given and given[-1] else next((n for n in PLANNED if config.name.startswith(f"{n}-")), "ppo")
    # A name that is none of them is the loader's to refuse, naming the choices.
    return typing.cast(Planned, named if named in PLANNED else "ppo")


def _loads_as(trainer: Planned, args: argparse.Namespace) -> bool:
    try:
        load_config_with_sources(args.config, args.overrides, schema=planned_schema(trainer))
    except ConfigError:
        return False
    return True


def run(args: argparse.Namespace) -> int:
    """Print the plan of ``plan.trainer``'s config; a ``ConfigError`` when the run would be refused
    or would not fit, with the plan."""
    command = _trainer_of(args)
    try:
        cfg, sources = load_config_with_sources(args.config, args.overrides, schema=planned_schema(command))
    except ConfigError as err:
        if command != "ppo" or not _loads_as("sft", args):
            raise
        raise ConfigError(f"{err}\nit loads as an sft or rm run's config: add plan.trainer=sft (or rm)") from None
    cfg.plan.trainer = command
    if args.print_config:
        raise_if_errors(config_errors(cfg))
        print_config(cfg, sources)
        return 0
    from megatron_rlhf.hybrid.memory import GIB
    from megatron_rlhf.trainer.plan import format_plan, plan_errors, plan_ppo, plan_supervised

    world_size, gpu_memory = cfg.plan.world_size, int(cfg.plan.gpu_memory_gib * GIB)
    if command == "ppo":
        plan = plan_ppo(cfg, world_size, gpu_memory)
    else:
        plan = plan_supervised(cfg, world_size, gpu_memory, score_head=command == "rm")
    text = json.dumps(plan.to_json(), indent=1) if cfg.plan.json else format_plan(plan)
    errors = plan_errors(plan)
    if errors:
        raise ConfigError(text + "\n\ndoes not fit:\n  " + "\n  ".join(errors))
    print(text)
    return 0
