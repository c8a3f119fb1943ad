"""The ``megatron-rlhf`` command line. Run it plainly for one process, or under torchrun.

    megatron-rlhf smoke [--config PRESET|FILE.yaml] [key=value ...]
    megatron-rlhf config [--config PRESET|FILE.yaml] [key=value ...]
    megatron-rlhf convert hf-to-mcore HF_DIR OUT_DIR --tp N --pp M
    megatron-rlhf convert mcore-to-hf CKPT_DIR OUT_DIR [--tp N --pp M]
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_rlhf.config.loader import ConfigError, load_config, presets, to_yaml

DEFAULT_PRESET = "smoke"


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=DEFAULT_PRESET,
        help=f"a preset name ({', '.join(presets())}) or a YAML file (default: {DEFAULT_PRESET})",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotlist overrides, e.g. actor.tp=2 seed=7")


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
    try:
        if args.command == "config":
            print(to_yaml(load_config(args.config, args.overrides)), end="")
            return 0
        if args.command == "smoke":
            cfg = load_config(args.config, args.overrides)
            from megatron_rlhf.parallel.distributed import init_distributed
            from megatron_rlhf.smoke import run_smoke

            run_smoke(cfg, init_distributed(cfg.device))
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
