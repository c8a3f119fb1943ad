"""Benchmark: the two ways a LoRA actor's generation weights can be made in its own layout (zero copy).

    torchrun --nproc-per-node 1 scripts/bench/lora_merge.py --model builtin:llama-1.5b --rank 32 --out r.json

The engine reads megatron's weights directly, so it needs ``W + alpha / rank * B @ A`` in the
linears' weights. Two ways, each timed here on the same model (median of ``--repeats``):

* ``in_place`` (what ``hybrid/reshard.py`` does): keep a copy of each adapted weight, merge in place
  (``merge_adapters(keep_base=True)``), and after generating copy the kept weights back
  (``unmerge_adapters``). The weights keep their addresses, so the engine's CUDA graphs stay valid
  from one rollout to the next; the kept copy exists only while generating.
* ``into_copy``: write ``W + delta`` into new tensors (``merged_weight``) and generate from those; the
  base is never touched. The copy is as large as the kept one, but it sits at new addresses every
  rollout, so the decode graphs would be captured again each rollout (the trainer reports what one
  capture costs as ``timing_s/gen/cuda_graph_capture``), unless the copy stayed allocated through
  training.

Reported: seconds for each, the bytes of the adapted weights, and each against the time to read and
write those bytes at the copy rate measured in the same run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import RunningReport, copy_bandwidth, median, wall_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:llama-1.5b")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role
    from megatron_rlhf.models.lora import adapted_weights, adapters, merge_adapters, merged_weight, unmerge_adapters
    from megatron_rlhf.models.lora_config import LoraConfig
    from megatron_rlhf.parallel.distributed import init_distributed

    env = init_distributed(args.device)
    arch = architecture_of(args.model)
    dtype = torch.bfloat16 if env.device.type == "cuda" else torch.float32
    model_cfg = ModelConfig(path=args.model, lora=LoraConfig(rank=args.rank))
    role = build_role("actor", model_cfg, arch, world_size=1, dtype=dtype, device=env.device)
    with torch.no_grad():  # B starts at zero; a random B makes the merge do real work
        draws = torch.Generator().manual_seed(0)
        for adapter in adapters(role.model):
            for b in adapter.lora_B.values():
                b.copy_(torch.empty(b.shape).normal_(0.0, 0.01, generator=draws))
    weights = [w for w, _ in adapted_weights(role.model)]
    adapted_bytes = sum(w.numel() * w.element_size() for w in weights)
    bandwidth = copy_bandwidth(env.device)
    once_s = 2 * adapted_bytes / bandwidth
    report = RunningReport(
        args.out,
        model=args.model,
        rank=args.rank,
        device=str(env.device),
        adapted_linears=len(weights),
        adapted_gb=adapted_bytes / 1e9,
        copy_GBps=bandwidth / 1e9,
        read_write_once_s=once_s,
    )

    def in_place() -> None:
        unmerge_adapters(role.model, merge_adapters(role.model, keep_base=True))

    def into_copy() -> None:
        copies = [merged_weight(w, a) for w, a in adapted_weights(role.model)]
        del copies

    for name, fn in (("in_place", in_place), ("into_copy", into_copy)):
        fn()  # warm-up: allocator, kernels
        seconds = median([wall_seconds(fn, env.device) for _ in range(args.repeats)])
        report.add(**{f"{name}_s": seconds, f"{name}_vs_read_write_once": seconds / once_s})


if __name__ == "__main__":
    main()
