"""Benchmark: the kernels of one decode step at batch 256, each against its HBM floor.

    python3 scripts/bench_decode_kernels.py --model builtin:llama-1.5b --out kernels.json

A decode step of the model runs its layers, each with four weight GEMMs of a skinny activation
(256 rows), plus the LM head. At this batch they are bound by reading the weights, so each variant
is timed over one distinct weight tensor per layer (more than the L2 cache holds), replayed as one
CUDA graph (no launch overhead, as in the engine), and reported in µs per layer and against the
copy bandwidth measured in the same run. Variants: cuBLAS, cuBLASLt
(``torch.backends.cuda.preferred_blas_library``), and FP8 e4m3 weights with row-wise scales
(``torch._scaled_mm``; the activation quantisation is timed as part of it). Also the residual add
+ RMSNorm between GEMMs: torch's RMSNorm after an eager add vs the engine's ``add_rms_norm``, and
decode attention: the engine's kernels (a Triton kernel on GPU, two matmuls on CPU) against
FlexAttention's and SDPA's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from megatron_rlhf.checkpoint.sources import architecture_of
from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.models.attention import add_rms_norm, decode_score_bias, matmul_decode_attention
from megatron_rlhf.models.decode_attention import decode_attention
from megatron_rlhf.models.roofline import copy_bandwidth


def gemm_shapes(arch: Architecture) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each weight GEMM of a decode step, unsharded."""
    h, attention = arch.hidden_size, arch.num_attention_heads * arch.head_dim
    return {
        "qkv": (attention + 2 * arch.num_query_groups * arch.head_dim, h),
        "proj": (h, attention),
        "fc1": (2 * arch.ffn_hidden_size, h),  # gate and up, as megatron fuses them
        "fc2": (h, arch.ffn_hidden_size),
        "head": (arch.vocab_size, h),
    }


def graph_time(fn, reps: int = 20) -> float:
    """Seconds per call of ``fn`` (which runs all layers), captured once and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise e4m3 quantisation: (fp8 tensor, float32 (rows, 1) scale)."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return (x / scale).to(torch.float8_e4m3fn), scale


def attention_variants(arch: Architecture, slots: int, max_len: int, bandwidth: float) -> dict[str, dict[str, float]]:
    """Decode attention per layer over a cache slice of kv_len positions (half and all of
    ``max_len``; each slot's own length up to 64 below that; the floor reads only those): the
    engine's Triton kernel (what ``cached_decode_attention`` runs on a GPU) at several block sizes,
    warps and pipeline stages; its two matmuls around a fused softmax (what it runs on CPU);
    FlexAttention (compiled) and SDPA, each with a KV group's query heads as the query rows of one
    KV head (the mask a bias). Errors are against a float64 computation."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    compiled_flex = torch.compile(flex_attention)

    groups, heads, head_dim, layers = arch.num_query_groups, arch.num_attention_heads, arch.head_dim, arch.num_layers
    scale = head_dim**-0.5
    out: dict[str, dict[str, float]] = {}
    caches = [
        torch.randn(slots, groups, max_len, 2 * head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(layers)
    ]
    query = torch.randn(1, slots, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q = query[0].reshape(slots, groups, heads // groups, head_dim)
    for kv_len in (max_len // 2, max_len):
        positions = torch.randint(kv_len - 64, kv_len, (slots, 1), device="cuda")  # each slot's own length
        bias = decode_score_bias(positions, kv_len, None)
        floor = groups * int(positions.sum() + slots) * 2 * head_dim * 2 / bandwidth  # the keys and values attended
        row = {"floor_us": floor * 1e6}

        def split(cache):
            return cache[:, :, :kv_len, :head_dim], cache[:, :, :kv_len, head_dim:]

        reference = matmul_decode_attention(q.double(), *(t.double() for t in split(caches[0])), bias.double(), scale)
        sdpa_bias = bias[:, None, None, :].to(torch.bfloat16)  # (slots, 1, 1, kv_len)

        def flex(cache):
            return compiled_flex(q, *split(cache), score_mod=lambda score, s, g, r, k: score + bias[s, k], scale=scale)

        variants = {
            "bmm_softmax_bmm": lambda cache: matmul_decode_attention(q, *split(cache), bias, scale),
            "flex": flex,
        }
        for block in (32, 64, 128):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    variants[f"triton_b{block}_w{warps}_s{stages}"] = lambda cache, b=block, w=warps, st=stages: (
                        decode_attention(
                            q, cache, positions, kv_len, None, scale, block_positions=b, num_warps=w, num_stages=st
                        )
                    )
        for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):  # flash: no kernel for a mask

            def sdpa(cache, backend=backend):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, *split(cache), attn_mask=sdpa_bias, scale=scale
                    )

            variants[f"sdpa_{backend.name.lower()}"] = sdpa
        for name, attend in variants.items():
            try:
                row[f"{name}_max_error"] = (attend(caches[0]).double() - reference).abs().max().item()
                row[name] = graph_time(lambda: [attend(c) for c in caches]) * 1e6 / layers
            except RuntimeError as failure:
                row[f"{name}_error"] = str(failure).splitlines()[0][:160]
        out[f"kv_{kv_len}"] = row
        print(
            f"attention kv {kv_len}: "
            + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
            flush=True,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:llama-1.5b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=384, help="cache positions (prompt + new tokens)")
    parser.add_argument(
        "--autotune", action="store_true", help="also torch.compile max-autotune GEMMs (slow to compile)"
    )
    parser.add_argument("--attention-only", action="store_true", help="only the decode attention variants")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    results: dict[str, dict] = {"bandwidth_tbps": bandwidth / 1e12}
    arch = architecture_of(args.model)
    layers = arch.num_layers
    for name, (n, k) in ({} if args.attention_only else gemm_shapes(arch)).items():
        count = 1 if name == "head" else layers
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(count)]
        x = torch.randn(args.batch, k, device=device, dtype=torch.bfloat16)
        floor = count * n * k * 2 / bandwidth
        row: dict[str, float] = {"floor_us": floor * 1e6 / count}
        for library in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(library)
            seconds = graph_time(lambda: [torch.nn.functional.linear(x, w) for w in weights])
            row[library] = seconds * 1e6 / count
        torch.backends.cuda.preferred_blas_library("cublas")
        fp8 = [quantize_rows(w) for w in weights]
        try:

            def fp8_step():
                xq, xs = quantize_rows(x)
                return [
                    torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16) for wq, ws in fp8
                ]

            row["fp8_rowwise"] = graph_time(fp8_step) * 1e6 / count
            xq, xs = quantize_rows(x)
            row["fp8_gemm_only"] = (
                graph_time(
                    lambda: [
                        torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)
                        for wq, ws in fp8
                    ]
                )
                * 1e6
                / count
            )
        except RuntimeError as error:  # not every build has row-wise scaled_mm
            row["fp8_error"] = str(error)[:200]
        if args.autotune:
            start = time.perf_counter()
            tuned = torch.compile(torch.nn.functional.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
            tuned(x, weights[0])
            row["autotune_compile_s"] = time.perf_counter() - start
            row["triton_autotuned"] = graph_time(lambda: [tuned(x, w) for w in weights]) * 1e6 / count
        results[name] = row
        cells = "  ".join(f"{key} {value:7.1f}" for key, value in row.items() if isinstance(value, float))
        print(f"{name:5s} ({n}x{k}) µs per layer: {cells}", flush=True)

    if not args.attention_only:
        hidden = torch.randn(args.batch, arch.hidden_size, device=device, dtype=torch.bfloat16)
        residual = torch.randn_like(hidden)
        norm = torch.nn.RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps, device=device, dtype=torch.bfloat16)
        eager = graph_time(lambda: [norm(hidden + residual) for _ in range(2 * layers)]) * 1e6 / (2 * layers)
        fused = (
            graph_time(lambda: [add_rms_norm(hidden, residual, norm.weight, norm.eps) for _ in range(2 * layers)])
            * 1e6
            / (2 * layers)
        )
        results["add_rmsnorm_us"] = {"eager": eager, "compiled": fused}
        print(f"add + RMSNorm µs each: eager {eager:.1f}, compiled {fused:.1f}", flush=True)
    results["attention"] = attention_variants(arch, args.batch, args.max_len, bandwidth)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
