"""``megatron-rlhf plan``: a ppo, sft or rm run's layouts and per-GPU memory, without a GPU
(``trainer/plan.py``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_rlhf.commands import ppo, rm, sft
from megatron_rlhf.commands.config_args import add_config_args
from megatron_rlhf.config.loader import ConfigError, load_config

PLANNED = {"ppo": ppo, "sft": sft, "rm": rm}
DEFAULT_GPU_MEMORY_GIB = 80.0
"""The device size unless ``--gpu-memory-gib`` says otherwise: an 80 GB A100/H100."""

HELP = "each model's layout and the per-GPU memory of a ppo, sft or rm run, without a GPU"
DESCRIPTION = (
    "Check a run's config for a world size as the run would, then print each model's layout, the "
    "generation layout, and per-GPU memory (weights, gradients, optimizer state, activations, KV cache) with the "
    "peaks of the training and the generation phase, with and without hybrid.offload, and what "
    "hybrid.offload=auto would decide. Reads only config.json files: no weights, no GPU, no processes. Exits 2 "
    "naming the settings when the run would be refused or its peak exceeds --gpu-memory-gib."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(
        parser, default=None, example="actor.path=/models/Qwen2.5-7B actor.tp=2", prefix=("ppo-", "sft-", "rm-")
    )
    parser.add_argument(
        "--trainer",
        choices=tuple(PLANNED),
        default=None,
        help="the command the config is for (default: from the preset's name, else ppo)",
    )
    parser.add_argument("--world-size", type=int, default=1, help="GPUs of the run (default 1)")
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=DEFAULT_GPU_MEMORY_GIB,
        help=f"memory of one GPU in GiB (default {DEFAULT_GPU_MEMORY_GIB:g}; an H200 offers about 139.8)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    """Print the plan of ``--trainer``'s config (or of the command its preset's name says); a
    ``ConfigError`` when the run would be refused or would not fit, with the plan."""
    from megatron_rlhf.hybrid.memory import GIB
    from megatron_rlhf.trainer.plan import format_plan, plan_errors, plan_ppo, plan_supervised

    named = Path(args.config).name if args.config else ""
    command = args.trainer or next((name for name in PLANNED if named.startswith(f"{name}-")), "ppo")
    cfg = load_config(args.config, args.overrides, schema=PLANNED[command].trainer().schema)
    if args.world_size < 1:
        raise ConfigError(f"--world-size={args.world_size} must be >= 1")
    gpu_memory = int(args.gpu_memory_gib * GIB)
    if command == "ppo":
        plan = plan_ppo(cfg, args.world_size, gpu_memory)
    else:
        plan = plan_supervised(cfg, args.world_size, gpu_memory, score_head=command == "rm")
    text = json.dumps(plan.to_json(), indent=1) if args.json else format_plan(plan)
    errors = plan_errors(plan)
    if errors:
        raise ConfigError(text + "\n\ndoes not fit:\n  " + "\n  ".join(errors))
    print(text)
    return 0
