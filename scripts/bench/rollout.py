"""Benchmark: native-engine generation vs HF transformers ``generate`` on the same weights.

    torchrun --nproc-per-node 1 scripts/bench/rollout.py --model builtin:llama-1.5b --out result.json
    torchrun --nproc-per-node 2 scripts/bench/rollout.py --model builtin:llama-1.5b --out reshard.json

With 2 ranks it measures only the hybrid engine's weight copy: TP2 training -> TP1 x DP2 generation
(time, and GPU memory with the copy allocated and after its release).

Fixed output length (EOS ignored), greedy, random prompts. For each batch size: prefill tokens/s
(max_new_tokens=1 run), decode tokens/s of both engines, and the HBM roofline of a decode step:
(weight bytes + KV bytes read per step) / measured copy bandwidth, averaged over the decode. Also
the train<->generate switch of a training state (hybrid/memory.py) against its floor (bytes moved
/ measured pinned host<->device bandwidth). With ``--top-p P`` (< 1), also the CUDA-graph decode rate
sampled at T=1 with top-p P on the same engine: what nucleus sampling costs beside greedy, with the
Triton kernel and, where FlashInfer is installed, with FlashInfer's (``rollout.engine.filtered_sampler``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import copy_bandwidth, device_name, host_bandwidth, wall_seconds, write_report

CUDA = torch.device("cuda")


def generate_seconds(engine: Any, prompts: torch.Tensor, params: Any) -> float:
    """Seconds of one ``engine.generate`` call, the prompts' conversion to lists included."""
    return wall_seconds(lambda: engine.generate(prompts.tolist(), params), CUDA)


def profile_decode(
    engine_for: Callable[[bool], Any], prompts: list[list[int]], steps: int, out: Path | None, top_p: float = 1.0
) -> dict[str, float]:
    """Where a decode step's time goes, greedy eager and with CUDA graphs (and with ``top_p`` < 1,
    nucleus sampling at T=1 with graphs too): GPU kernel time per step by kernel, and the share of
    wall time the GPU is busy (the rest is the host loop). Decode-only figures are differences of
    two profiled runs, ``steps + 1`` and 1 new tokens (the prefill)."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_rlhf.metrics.kernels import costliest, op_times, print_report
    from megatron_rlhf.rollout.sampling import SamplingParams

    def params(nucleus: float, new_tokens: int) -> SamplingParams:
        """Greedy, or sampled at T=1 within the ``nucleus`` (top-p < 1)."""
        temperature = 0.0 if nucleus == 1 else 1.0
        return SamplingParams(temperature=temperature, top_p=nucleus, max_new_tokens=new_tokens, ignore_eos=True)

    def kernel_times(engine: Any, new_tokens: int, nucleus: float) -> tuple[float, dict[str, tuple[float, int]]]:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = wall_seconds(lambda: engine.generate(prompts, params(nucleus, new_tokens)), CUDA)
        return wall, op_times(prof)  # device work only, not the ops launching it

    figures: dict[str, float] = {}
    lines = []
    runs = [("eager", False, 1.0), ("cuda_graphs", True, 1.0)]
    if top_p < 1:
        runs.append((f"cuda_graphs_top_p_{top_p}", True, top_p))
    for label, graphs, nucleus in runs:
        engine = engine_for(graphs)
        engine.generate(prompts, params(nucleus, steps + 1))  # warm-up: graphs and the sampler's kernels compiled
        wall_full, full = kernel_times(engine, steps + 1, nucleus)
        wall_prefill, prefill = kernel_times(engine, 1, nucleus)
        decode = {
            k: ((t - prefill.get(k, (0, 0))[0]) / steps, (n - prefill.get(k, (0, 0))[1]) / steps)
            for k, (t, n) in full.items()
        }
        busy_us = sum(t for t, _ in decode.values())
        figures[f"{label}_wall_ms_per_step"] = 1e3 * (wall_full - wall_prefill) / steps
        figures[f"{label}_gpu_busy_ms_per_step"] = busy_us / 1e3
        figures[f"{label}_kernels_per_step"] = sum(n for _, n in decode.values())
        engine.release()
        lines.append(
            f"== {label}, batch {len(prompts)}: per decode step, {figures[f'{label}_wall_ms_per_step']:.3f} ms "
            f"wall, {busy_us / 1e3:.3f} ms GPU busy, {figures[f'{label}_kernels_per_step']:.0f} kernels"
        )
        lines += costliest(decode, 30)
    print_report(lines, out)
    return figures


def measure_reshard(args: argparse.Namespace, env: Any) -> None:
    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role
    from megatron_rlhf.hybrid.reshard import WeightResharder

    arch = architecture_of(args.model)
    actor = build_role(
        "actor",
        ModelConfig(path=args.model, tp=env.world_size),
        arch,
        world_size=env.world_size,
        dtype=torch.bfloat16,
        device=env.device,
    )
    resharder = WeightResharder(actor, generation_tp=1)
    gib = 1024**3
    training_weights = torch.cuda.memory_allocated()
    times, with_copy = [], []
    for _ in range(3):  # the first refresh builds the copy plan; each allocates the copy, then it is released
        times.append(wall_seconds(resharder.refresh, env.device))
        with_copy.append(torch.cuda.memory_allocated())
        resharder.release()
    copy_bytes = resharder.destination_bytes()
    result = {
        "model": args.model,
        "train_layout": str(actor.groups.layout),
        "generation_layout": "TP1xPP1xDP" + str(env.world_size),
        "refresh_s": times,
        "destination_GB_per_rank": copy_bytes / 1e9,
        "effective_GBps_per_rank": copy_bytes / 1e9 / min(times[1:]),
        "allocated_GiB_training_weights": training_weights / gib,
        "allocated_GiB_with_copy": max(with_copy) / gib,
        "allocated_GiB_after_release": torch.cuda.memory_allocated() / gib,
    }
    write_report(result, args.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:llama-1.5b")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="below 1: also decode sampled at T=1 with this top-p (CUDA graphs)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile decode at the largest batch (torch.profiler; with --top-p, nucleus decode too)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role, local_dir
    from megatron_rlhf.hybrid.memory import TrainingMemory
    from megatron_rlhf.parallel.distributed import init_distributed
    from megatron_rlhf.rollout.native import NativeEngine
    from megatron_rlhf.rollout.native_config import NativeEngineConfig, flashinfer_installed
    from megatron_rlhf.rollout.sampling import SamplingParams
    from megatron_rlhf.training.objectives import sft_loss
    from megatron_rlhf.training.optim import OptimConfig, make_train_state
    from megatron_rlhf.training.train import train_step

    env = init_distributed("cuda")
    arch = architecture_of(args.model)
    if env.world_size > 1:
        return measure_reshard(args, env)
    role = build_role(
        "actor", ModelConfig(path=args.model), arch, world_size=1, dtype=torch.bfloat16, device=env.device
    )
    bandwidth = copy_bandwidth(env.device)
    weight_bytes = sum(
        p.numel() * p.element_size() for n, p in role.model.named_parameters() if "word_embeddings" not in n
    )
    kv_bytes_per_token = 2 * arch.num_layers * arch.num_query_groups * arch.head_dim * 2
    result: dict[str, object] = {
        "model": args.model,
        "device": device_name(env.device),
        "hbm_bandwidth_TBps": bandwidth / 1e12,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
    }
    hf = (
        None
        if args.skip_hf
        else AutoModelForCausalLM.from_pretrained(local_dir(args.model), dtype=torch.bfloat16).to(env.device).eval()
    )
    filtered_samplers = ["triton"] + (["flashinfer"] if flashinfer_installed() else [])
    g = torch.Generator().manual_seed(0)
    for batch in args.batch_sizes:
        prompts = torch.randint(0, arch.vocab_size, (batch, args.prompt_len), generator=g)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
        figures = {}
        for label, graphs in (("eager", False), ("cuda_graphs", True)):
            engine = NativeEngine(
                role,
                NativeEngineConfig(
                    max_batch_size=batch, max_seq_len=args.prompt_len + args.new_tokens, cuda_graphs=graphs
                ),
            )
            # Warm-up, a full run: it compiles for these shapes (eager too: a smaller warm-up left
            # the timed prefill compiling) and, with graphs, captures every KV-length bucket's graph
            # once; the engine keeps them (and its KV cache) for the timed calls, as a rollout
            # engine would.
            engine.generate(prompts.tolist(), greedy)
            if graphs:
                figures["graph_capture_s"] = engine.graph_capture_seconds
            prefill_s = generate_seconds(
                engine, prompts, SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
            )
            total_s = generate_seconds(engine, prompts, greedy)
            figures["prefill_tokens_per_s"] = batch * args.prompt_len / prefill_s
            figures[f"decode_tokens_per_s_{label}"] = batch * (args.new_tokens - 1) / (total_s - prefill_s)
            # What nucleus sampling costs a decode step, beside greedy's, with each filtered sampler
            # (rollout.engine.filtered_sampler) on the same engine and graphs.
            for sampler in filtered_samplers if graphs and args.top_p < 1 else ():
                engine.cfg = dataclasses.replace(engine.cfg, filtered_sampler=sampler)
                nucleus = SamplingParams(
                    temperature=1.0, top_p=args.top_p, max_new_tokens=args.new_tokens, ignore_eos=True
                )
                # untimed: the filtered kernel's first call compiles or loads it
                engine.generate(prompts.tolist(), dataclasses.replace(nucleus, max_new_tokens=2))
                nucleus_s = generate_seconds(engine, prompts, nucleus)
                figures[f"decode_tokens_per_s_top_p_{args.top_p}_{sampler}"] = (
                    batch * (args.new_tokens - 1) / (nucleus_s - prefill_s)
                )
            engine.release()  # its KV cache and graphs would otherwise count in the switch's memory below
        ours = figures["decode_tokens_per_s_cuda_graphs"]
        mean_context = args.prompt_len + args.new_tokens / 2
        step_bytes = weight_bytes + batch * mean_context * kv_bytes_per_token
        roofline = batch / (step_bytes / bandwidth)
        figures.update({"roofline_tokens_per_s": roofline, "fraction_of_roofline": ours / roofline})
        if hf is not None:
            with torch.no_grad():
                ids = prompts.to(env.device)
                hf.generate(ids[:4], max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
                generate = functools.partial(
                    hf.generate,
                    ids,
                    max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
                hf_s = wall_seconds(generate, env.device)
            figures["hf_generate_tokens_per_s"] = batch * args.new_tokens / hf_s
            figures["speedup_vs_hf"] = ours / figures["hf_generate_tokens_per_s"]
        result[f"batch{batch}"] = figures
        torch.cuda.empty_cache()
    if args.profile:
        batch = max(args.batch_sizes)
        prompts = torch.randint(0, arch.vocab_size, (batch, args.prompt_len), generator=g).tolist()

        def engine_for(graphs: bool) -> NativeEngine:
            return NativeEngine(
                role,
                NativeEngineConfig(
                    max_batch_size=batch, max_seq_len=args.prompt_len + args.new_tokens, cuda_graphs=graphs
                ),
            )

        result["profile"] = profile_decode(engine_for, prompts, 32, args.out, args.top_p)
    hf = None  # free its weights before the training state below
    state = make_train_state(role, OptimConfig(lr=1e-6))
    ids = torch.randint(0, arch.vocab_size, (8, 512), generator=g)
    train_step(
        state,
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)},
        sft_loss(role),
        max_tokens_per_micro_batch=4096,
    )
    memory = TrainingMemory(state)
    host_bw = host_bandwidth(env.device)
    for _ in range(2):  # the second round reuses the pinned buffers: the steady state
        start = time.perf_counter()
        moved = memory.to_generation()  # synchronizes the device before it returns
        release_s = time.perf_counter() - start
        allocated = torch.cuda.memory_allocated()
        restore_s = wall_seconds(memory.to_training, env.device)
    result["switch"] = {
        "bytes_moved_GB": moved / 1e9,
        "host_bandwidth_GBps": host_bw / 1e9,
        "train_to_generate_s": release_s,
        "generate_to_train_s": restore_s,
        "floor_s": moved / host_bw,
        "gpu_allocated_during_generation_GiB": allocated / 1024**3,
    }
    result["gpu_peak_GiB"] = torch.cuda.max_memory_allocated() / 1024**3
    write_report(result, args.out)


if __name__ == "__main__":
    main()
