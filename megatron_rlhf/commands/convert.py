"""``megatron-rlhf convert``: HF safetensors <-> megatron-rlhf checkpoints (``checkpoint/convert.py``)."""

from __future__ import annotations

import argparse

HELP = "convert checkpoints between HF safetensors and megatron format"
DESCRIPTION = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    directions = parser.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
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
    for direction, source in ((to_mcore, "HF_DIR"), (to_hf, "CKPT_DIR")):
        direction.add_argument("source", metavar=source)
        direction.add_argument("output", metavar="OUT_DIR")
        direction.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the layout (default 1)")
        direction.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the layout (default 1)")
        direction.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="default: auto")


def run(args: argparse.Namespace) -> int:
    from megatron_rlhf.checkpoint.convert import convert

    convert(args.direction, args.source, args.output, tp=args.tp, pp=args.pp, device=args.device)
    return 0
