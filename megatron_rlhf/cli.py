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
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_rlhf.config.flags import add_flags, from_flags
from megatron_rlhf.config.loader import (
    ConfigError,
    config_errors,
    load_config,
    load_config_with_sources,
    presets,
    raise_if_errors,
    to_yaml,
)
from megatron_rlhf.metrics.log import quiet_known_warnings
from megatron_rlhf.rollout.native_config import NativeEngineConfig
from megatron_rlhf.rollout.sampling import SamplingParams

DEFAULT_PRESET = "smoke"


TRAINER_PRESET_PREFIXES = ("ppo-", "sft-", "rm-", "pipeline-")
PLAN_TRAINERS = ("ppo", "sft", "rm")
DEFAULT_GPU_MEMORY_GIB = 80.0
"""``plan``'s device size unless ``--gpu-memory-gib`` says otherwise: an 80 GB A100/H100."""


def _add_config_args(
    parser: argparse.ArgumentParser,
    default: str | None = DEFAULT_PRESET,
    example: str = "actor.tp=2 seed=7",
    prefix: str | None = None,
) -> None:
    """``--config`` and overrides; the help lists the presets of this command only (those named
    ``prefix``...; without a prefix, the presets of no trainer)."""
    names = [n for n in presets() if (n.startswith(prefix) if prefix else not n.startswith(TRAINER_PRESET_PREFIXES))]
    shown = f"default: {default}" if default else "default: none, the library defaults"
    parser.add_argument(
        "--config",
        default=default,
        help=f"a preset name ({', '.join(names)}) or a YAML file to build on ({shown})",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=f"dotlist overrides, e.g. {example}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rlhf",
        description="Megatron-native RLHF. Runs as one process, or as an SPMD job under torchrun.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    smoke = commands.add_parser(
        "smoke",
        help="build the four models (actor, critic, reference, reward) in their layouts and run a forward pass",
        description="Validate the config, build actor, critic, reference and reward models in their own "
        "TP/PP layouts, load their weights and run a forward pass through each. With no arguments it "
        "uses built-in tiny random models: no download, GPU if present, else CPU mode.",
    )
    _add_config_args(smoke)

    outputs = (
        "Writes metrics.jsonl, TensorBoard events (tb/) and, with save_hf=true, an HF checkpoint (hf/) under "
        "output_dir; loggers=[console,jsonl,tensorboard,wandb] chooses where metrics go."
    )
    for name, help_text, description, example in (
        (
            "ppo",
            "RL from prompts: PPO (critic, GAE) or GRPO-style group baselines, with the hybrid engine",
            "Each step: generate responses with the hybrid engine, score them (reward model and/or rule functions), "
            "compute reference log-probs and values, advantages, then update the actor and critic. Without "
            "--config it builds on the library defaults (docs/defaults.md): name the model (actor.path), the prompts "
            "(data.train) and the reward (scoring.*). The demo, --config ppo-tiny: GRPO on built-in tiny models and "
            f"prompts (no download; GPU if present, else CPU). {outputs}",
            "actor.tp=2 rollout.tp=1 prompts_per_step=64",
        ),
        (
            "sft",
            "supervised fine-tuning of a causal LM on prompt/response rows",
            "Train a *ForCausalLM on prompt -> response rows (.jsonl/.parquet; columns prompt and response by "
            f"default) with next-token NLL on the response. {outputs} Example: megatron-rlhf sft "
            "data.train=[train.jsonl] data.validation=[val.jsonl] model.path=/models/Qwen2.5-0.5B",
            "data.train=[train.jsonl] model.tp=2 max_steps=100",
        ),
        (
            "rm",
            "reward-model training on preference pairs (Bradley-Terry)",
            "Train a *ForSequenceClassification (score head) on prompt/chosen/rejected rows with the Bradley-Terry "
            f"loss; validation reports preference accuracy. {outputs} Example: megatron-rlhf rm "
            "model.path=/models/rm-init data.train=[prefs.jsonl] data.validation=[prefs-val.jsonl]",
            "data.train=[prefs.jsonl] optim.lr=1e-5",
        ),
        (
            "pipeline",
            "a model made from scratch, then RL: SFT -> reward-model pairs -> RM -> GRPO and PPO -> held-out test",
            "Run the stages of the built-in arithmetic task in sequence (sft, pairs, rm, grpo, ppo, test), each a "
            "normal run of its command in output_dir/<stage>; the sections sft, rm, grpo, ppo hold those commands' "
            "configs. With no arguments: the tiny preset (two CPU cores, under 10 minutes; a GPU if present). "
            "Writes pipeline.json with each stage's time and the held-out accuracy of each model.",
            "stages=[grpo,test] grpo.max_steps=60",
        ),
    ):
        trainer = commands.add_parser(name, help=help_text, description=description)
        # The pipeline is the built-in task: its preset is the command. A trainer run is the user's
        # own: it builds on the library defaults unless --config names a preset (the demos: *-tiny).
        _add_config_args(
            trainer, default="pipeline-arith-tiny" if name == "pipeline" else None, example=example, prefix=f"{name}-"
        )
        trainer.add_argument(
            "--print-config",
            action="store_true",
            help="run every start-up check, then print the resolved configuration as YAML (the "
            "settings that differ from the library defaults first, as comments) and exit",
        )

    generate = commands.add_parser(
        "generate",
        help="sample completions for a file of prompts with the native engine",
        description="Read prompts (.jsonl/.parquet rows with 'prompt' text or 'prompt_ids'), generate with the "
        "native engine (KV cache, continuous batching) and write JSONL rows with token_ids, text, per-token "
        "logprobs and finish_reason. Under torchrun the world is split into groups of --tp ranks.",
    )
    generate.add_argument("--model", required=True, help="HF model dir, megatron-rlhf checkpoint, or builtin:NAME")
    generate.add_argument(
        "--input", required=True, help="prompts file (.jsonl or .parquet) or a built-in set (builtin:arithmetic-test)"
    )
    generate.add_argument("--output", required=True, help="output .jsonl")
    generate.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the generation layout")
    generate.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    generate.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    # Sampling and engine flags come from the same dataclasses as ppo's rollout.sampling and
    # rollout.engine, so their names, defaults and help cannot drift apart.
    add_flags(generate.add_argument_group("sampling (ppo: rollout.sampling.*)"), SamplingParams)
    add_flags(
        generate.add_argument_group("engine (ppo: rollout.engine.*)"), NativeEngineConfig, skip=("eos_token_ids",)
    )

    plan = commands.add_parser(
        "plan",
        help="each model's layout and the per-GPU memory of a ppo, sft or rm run, without a GPU",
        description="Check a run's config for a world size as the run would, then print each model's layout, the "
        "generation layout, and per-GPU memory (weights, gradients, optimizer state, activations, KV cache) with the "
        "peaks of the training and the generation phase, with and without hybrid.offload, and what "
        "hybrid.offload=auto would decide. Reads only config.json files: no weights, no GPU, no processes. Exits 2 "
        "naming the settings when the run would be refused or its peak exceeds --gpu-memory-gib.",
    )
    _add_config_args(plan, default=None, example="actor.path=/models/Qwen2.5-7B actor.tp=2", prefix="")
    plan.add_argument(
        "--trainer",
        choices=PLAN_TRAINERS,
        default=None,
        help="the command the config is for (default: from the preset's name, else ppo)",
    )
    plan.add_argument("--world-size", type=int, default=1, help="GPUs of the run (default 1)")
    plan.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=DEFAULT_GPU_MEMORY_GIB,
        help=f"memory of one GPU in GiB (default {DEFAULT_GPU_MEMORY_GIB:g}; an H200 offers about 139.8)",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")

    show = commands.add_parser("config", help="print the resolved configuration (preset + overrides) as YAML")
    _add_config_args(show)

    convert = commands.add_parser("convert", help="convert checkpoints between HF safetensors and megatron format")
    directions = convert.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    to_mcore = directions.add_parser(
        "hf-to-mcore",
        help="HF safetensors -> megatron-rlhf checkpoint (dist_checkpointing)",
        description="Read an HF model directory straight into a TP/PP layout and save it as a megatron-rlhf "
        "checkpoint. Under torchrun the world size must be a multiple of tp*pp.",
    )
    to_hf = directions.add_parser(
        "mcore-to-hf",
        help="megatron-rlhf checkpoint -> HF safetensors + config.json",
        description="Load a megatron-rlhf checkpoint (saved in any layout) and write an HF model directory "
        "that transformers' from_pretrained can load.",
    )
    for sub, src in ((to_mcore, "HF_DIR"), (to_hf, "CKPT_DIR")):
        sub.add_argument("source", metavar=src)
        sub.add_argument("output", metavar="OUT_DIR")
        sub.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the layout (default 1)")
        sub.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the layout (default 1)")
        sub.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="default: auto")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_known_warnings()
    try:
        if args.command == "config":
            from megatron_rlhf.smoke import SmokeConfig

            print(_checked_yaml(load_config(args.config, args.overrides, schema=SmokeConfig)), end="")
            return 0
        if args.command == "smoke":
            from megatron_rlhf.parallel.distributed import init_distributed
            from megatron_rlhf.smoke import SmokeConfig, run_smoke

            cfg = load_config(args.config, args.overrides, schema=SmokeConfig)

            run_smoke(cfg, init_distributed(cfg.device, cfg.dist_timeout_s))
            return 0
        if args.command in TRAINERS:
            return _run_trainer(args.command, args.config, args.overrides, args.print_config)
        if args.command == "plan":
            return _plan(args)
        if args.command == "generate":
            from megatron_rlhf.rollout.generate_cmd import run_generate

            run_generate(
                model=args.model,
                input_path=args.input,
                output_path=args.output,
                tp=args.tp,
                device=args.device,
                dtype=args.dtype,
                params=from_flags(args, SamplingParams),
                engine_cfg=from_flags(args, NativeEngineConfig, eos_token_ids=()),
            )
            return 0
        if args.command == "convert":
            from megatron_rlhf.checkpoint.convert import convert

            convert(args.direction, args.source, args.output, tp=args.tp, pp=args.pp, device=args.device)
            return 0
    except (ConfigError, FileNotFoundError, ValueError) as err:
        # Every rank finds the same configuration error: only the first says so. Other errors may
        # be rank-specific (a file missing on one node) and are reported by each rank that hits them.
        if not isinstance(err, ConfigError) or os.environ.get("RANK", "0") == "0":
            print(f"megatron-rlhf: error: {err}", file=sys.stderr)
        return 2
    raise AssertionError(f"unhandled command {args.command}")


@dataclasses.dataclass(frozen=True)
class Trainer:
    """A trainer command: its config schema, its start-up checks and its run."""

    schema: type
    check: Callable[[Any, int], object]
    """Every check a run makes before it builds anything (``ConfigError``), given the world size."""
    run: Callable[..., object]


def _trainer(command: str) -> Trainer:
    if command == "ppo":
        from megatron_rlhf.trainer.ppo import run_ppo
        from megatron_rlhf.trainer.ppo_config import PPOConfig, check_ppo_config

        return Trainer(PPOConfig, check_ppo_config, run_ppo)
    if command in ("sft", "rm"):
        from megatron_rlhf.trainer.rm import RMConfig, run_rm
        from megatron_rlhf.trainer.sft import SFTConfig, run_sft
        from megatron_rlhf.trainer.supervised import check_config

        score_head = command == "rm"
        return Trainer(
            RMConfig if score_head else SFTConfig,
            lambda cfg, world_size: check_config(cfg, world_size, score_head=score_head),
            run_rm if score_head else run_sft,
        )
    from megatron_rlhf.trainer.pipeline import PipelineConfig, check_pipeline_config, run_pipeline

    return Trainer(PipelineConfig, lambda cfg, _world_size: check_pipeline_config(cfg), run_pipeline)


TRAINERS = ("ppo", "sft", "rm", "pipeline")


def _run_trainer(command: str, preset: str | None, overrides: list[str], print_config: bool) -> int:
    trainer = _trainer(command)
    cfg, sources = load_config_with_sources(preset, overrides, schema=trainer.schema)
    # The run's own checks, before torch.distributed starts or anything is built: a run and
    # --print-config accept and refuse the same configs. torchrun names the world size.
    trainer.check(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    if print_config:
        print(_commented(sources.report()) + to_yaml(cfg), end="")
        return 0
    if os.environ.get("RANK", "0") == "0":
        print(sources.report(), flush=True)
    import torch

    from megatron_rlhf.parallel.distributed import init_distributed
    from megatron_rlhf.trainer.stop import RunStopped

    try:
        env = init_distributed(cfg.device, cfg.dist_timeout_s)
        threads = cfg.host_thread_count(env.device)
        if threads is not None:
            torch.set_num_threads(threads)
        trainer.run(cfg, env)
    except RunStopped as stop:  # a signal asked for it (after its checkpoint), or training diverged
        if stop.code and os.environ.get("RANK", "0") == "0":
            print(f"megatron-rlhf: {stop}", file=sys.stderr)
        return stop.code
    return 0


def _commented(text: str) -> str:
    return "".join(f"# {line}\n" for line in text.splitlines())


def _plan(args: argparse.Namespace) -> int:
    """``plan``: the config of ``--trainer`` (or the one its preset's name says), planned."""
    from megatron_rlhf.trainer.plan import run_plan

    named = Path(args.config).name if args.config else ""
    trainer = args.trainer or next((t for t in PLAN_TRAINERS if named.startswith(f"{t}-")), "ppo")
    cfg = load_config(args.config, args.overrides, schema=_trainer(trainer).schema)
    print(run_plan(trainer, cfg, args.world_size, args.gpu_memory_gib, as_json=args.json))
    return 0


def _checked_yaml(cfg: object) -> str:
    """The resolved config as YAML, once every field passes its own check (checks that need the
    models or the world size run when the command starts)."""
    raise_if_errors(config_errors(cfg))
    return to_yaml(cfg)
