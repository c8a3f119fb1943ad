"""Benchmark: load a model from HF safetensors into a TP layout; time and GPU memory.

    torchrun --nproc-per-node N scripts/bench/load.py --model builtin:llama-1.5b --tp N --out result.json

The built-in model is materialised first (random bf16 weights, written once, not timed). Timed:
model build (allocation), weight import (each rank reads only its shards), and one forward pass.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import clock, compute_dtype, device_name, write_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:llama-1.5b")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from megatron_rlhf.checkpoint.sources import architecture_of, load_weights
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.builtin import builtin_checkpoint, is_builtin
    from megatron_rlhf.models.roles import RoleModel
    from megatron_rlhf.parallel.distributed import init_distributed
    from megatron_rlhf.parallel.layout import Layout, parallel_groups
    from megatron_rlhf.training.train import forward_outputs

    env = init_distributed(args.device)
    arch = architecture_of(args.model)
    t = time.perf_counter()
    path = str(builtin_checkpoint(args.model)) if is_builtin(args.model) else args.model
    materialise_s = time.perf_counter() - t
    groups = parallel_groups(Layout.for_world(args.tp, args.pp, env.world_size))
    dtype = compute_dtype(env.device)
    on_gpu = env.device.type == "cuda"

    def sync() -> float:
        return clock(env.device, barrier=True)

    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    t0 = sync()
    model = build_model(arch, groups, dtype=dtype, device=env.device)
    t1 = sync()
    load_weights(model, arch, groups, path)
    t2 = sync()
    ids = torch.randint(0, arch.vocab_size, (args.batch, args.seq_len))
    forward_outputs(RoleModel("bench", arch, groups, model, Path(path)), ids, micro_batch_size=args.batch)
    t3 = sync()
    local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    total_params = torch.tensor(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    result = {
        "model": args.model,
        "layout": str(groups.layout),
        "device": device_name(env.device),
        "dtype": str(dtype).removeprefix("torch."),
        "params_per_rank_M": total_params.item() / 1e6,
        "materialise_s": materialise_s,
        "build_s": t1 - t0,
        "load_s": t2 - t1,
        "load_GBps_per_rank": local_bytes / 1e9 / (t2 - t1),
        "forward_s": t3 - t2,
        "forward_tokens": args.batch * args.seq_len,
    }
    if on_gpu:
        result["gpu_allocated_GiB"] = torch.cuda.memory_allocated() / 1024**3
        result["gpu_peak_GiB"] = torch.cuda.max_memory_allocated() / 1024**3
        result["weights_GiB_per_rank"] = local_bytes / 1024**3
    write_report(result, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
