"""``megatron-rlhf generate``: completions for a file of prompts (``rollout/offline.py``)."""

from __future__ import annotations

import argparse

from megatron_rlhf.config.flags import add_flags, from_flags
from megatron_rlhf.rollout.native_config import NativeEngineConfig
from megatron_rlhf.rollout.sampling import SamplingParams

HELP = "sample completions for a file of prompts with the native engine"
DESCRIPTION = (
    "Read prompts (.jsonl/.parquet rows with 'prompt' text or 'prompt_ids'), generate with the "
    "native engine (KV cache, continuous batching) and write JSONL rows with token_ids, text, per-token "
    "logprobs and finish_reason. Under torchrun the world is split into groups of --tp ranks."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF model dir, megatron-rlhf checkpoint, or builtin:NAME")
    parser.add_argument(
        "--input", required=True, help="prompts file (.jsonl or .parquet) or a built-in set (builtin:arithmetic-test)"
    )
    parser.add_argument("--output", required=True, help="output .jsonl")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the generation layout")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    # Sampling and engine flags come from the same dataclasses as ppo's rollout.sampling and
    # rollout.engine, so their names, defaults and help cannot drift apart.
    add_flags(parser.add_argument_group("sampling (ppo: rollout.sampling.*)"), SamplingParams)
    add_flags(parser.add_argument_group("engine (ppo: rollout.engine.*)"), NativeEngineConfig, skip=("eos_token_ids",))


def run(args: argparse.Namespace) -> int:
    from megatron_rlhf.rollout.offline import run_generate

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
