"""Benchmark: the kernels of one decode step at batch 256, each against its HBM floor.

    python3 scripts/bench/decode_kernels.py --model builtin:llama-1.5b --out kernels.json

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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import copy_bandwidth, graph_seconds, write_report

from megatron_rlhf.checkpoint.sources import architecture_of
from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.models.attention import add_rms_norm, decode_score_bias, matmul_decode_attention
from megatron_rlhf.models.decode_attention import decode_attention

Attend = Callable[[torch.Tensor], torch.Tensor]


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


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise e4m3 quantisation: (fp8 tensor, float32 (rows, 1) scale)."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return (x / scale).to(torch.float8_e4m3fn), scale


def layers_us(call: Callable[[Any], object], per_layer: list[Any]) -> float:
    """Microseconds per layer of ``call`` over each layer's input, all layers replayed as one CUDA graph."""
    return graph_seconds(lambda: [call(item) for item in per_layer]) * 1e6 / len(per_layer)


def attention_variants(arch: Architecture, slots: int, max_len: int, bandwidth: float) -> dict[str, dict[str, Any]]:
    """Decode attention per layer over a cache slice of kv_len positions (half and all of
    ``max_len``; each slot's own length up to 64 below that; the floor reads only those): the
    engine's Triton kernel (what ``cached_decode_attention`` runs on a GPU) at several block sizes,
    warps and pipeline stages; its two matmuls around a fused softmax (what it runs on CPU);
    FlexAttention (compiled) and SDPA, each with a KV group's query heads as the query rows of one
    KV head (the mask a bias). Errors are against a float64 computation."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled_flex = torch.compile(flex_attention)
    groups, heads, head_dim = arch.num_query_groups, arch.num_attention_heads, arch.head_dim
    caches = [
        torch.randn(slots, groups, max_len, 2 * head_dim, device="cuda", dtype=torch.bfloat16)
        for _ in range(arch.num_layers)
    ]
    query = torch.randn(1, slots, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q = query[0].reshape(slots, groups, heads // groups, head_dim)
    out: dict[str, dict[str, Any]] = {}
    for kv_len in (max_len // 2, max_len):
        row = attention_row(q, caches, kv_len, bandwidth, compiled_flex)
        out[f"kv_{kv_len}"] = row
        print(
            f"attention kv {kv_len}: "
            + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
            flush=True,
        )
    return out


def attention_row(
    q: torch.Tensor, caches: list[torch.Tensor], kv_len: int, bandwidth: float, compiled_flex: Callable[..., Any]
) -> dict[str, Any]:
    """Each decode-attention variant over the first ``kv_len`` cache positions: µs per layer and max error."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    slots, groups, _, head_dim = q.shape
    scale = head_dim**-0.5
    positions = torch.randint(kv_len - 64, kv_len, (slots, 1), device="cuda")  # each slot's own length
    bias = decode_score_bias(positions, kv_len, None)
    floor = groups * int(positions.sum() + slots) * 2 * head_dim * 2 / bandwidth  # the keys and values attended
    row: dict[str, Any] = {"floor_us": floor * 1e6}

    def split(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cache[:, :, :kv_len, :head_dim], cache[:, :, :kv_len, head_dim:]

    reference = matmul_decode_attention(q.double(), *(t.double() for t in split(caches[0])), bias.double(), scale)
    sdpa_bias = bias[:, None, None, :].to(torch.bfloat16)  # (slots, 1, 1, kv_len)

    def flex(cache: torch.Tensor) -> torch.Tensor:
        return compiled_flex(q, *split(cache), score_mod=lambda score, s, g, r, k: score + bias[s, k], scale=scale)

    def triton(block: int, warps: int, stages: int) -> Attend:
        def attend(cache: torch.Tensor) -> torch.Tensor:
            return decode_attention(
                q, cache, positions, kv_len, None, scale, block_positions=block, num_warps=warps, num_stages=stages
            )

        return attend

    def sdpa(backend: SDPBackend) -> Attend:
        def attend(cache: torch.Tensor) -> torch.Tensor:
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, *split(cache), attn_mask=sdpa_bias, scale=scale
                )

        return attend

    variants: dict[str, Attend] = {
        "bmm_softmax_bmm": lambda cache: matmul_decode_attention(q, *split(cache), bias, scale),
        "flex": flex,
    }
    for block in (32, 64, 128):
        for warps in (4, 8):
            for stages in (1, 2, 3):
                variants[f"triton_b{block}_w{warps}_s{stages}"] = triton(block, warps, stages)
    for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):  # flash: no kernel for a mask
        variants[f"sdpa_{backend.name.lower()}"] = sdpa(backend)
    for name, attend in variants.items():
        try:
            row[f"{name}_max_error"] = (attend(caches[0]).double() - reference).abs().max().item()
            row[name] = layers_us(attend, caches)
        except RuntimeError as failure:
            row[f"{name}_error"] = str(failure).splitlines()[0][:160]
    return row


def scaled_mm(x: torch.Tensor, x_scale: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """An FP8 GEMM with row-wise scales of a quantized activation and a quantized weight (``quantize_rows``)."""
    w, w_scale = weight
    return torch._scaled_mm(x, w.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=torch.bfloat16)


def gemm_row(n: int, k: int, count: int, batch: int, bandwidth: float, autotune: bool) -> dict[str, Any]:
    """µs per layer of a ``batch`` x ``k`` activation times ``count`` distinct ``n`` x ``k`` weights:
    cuBLAS, cuBLASLt, FP8 with row-wise scales (with and without quantizing the activation) and,
    with ``autotune``, torch.compile's max-autotune GEMM."""
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
    x = torch.randn(batch, k, device="cuda", dtype=torch.bfloat16)
    row: dict[str, Any] = {"floor_us": n * k * 2 / bandwidth * 1e6}
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        row[library] = layers_us(lambda w: torch.nn.functional.linear(x, w), weights)
    torch.backends.cuda.preferred_blas_library("cublas")
    fp8 = [quantize_rows(w) for w in weights]
    try:

        def quantize_then_multiply() -> list[torch.Tensor]:
            xq, xs = quantize_rows(x)  # once per step, for every layer's GEMM
            return [scaled_mm(xq, xs, weight) for weight in fp8]

        row["fp8_rowwise"] = graph_seconds(quantize_then_multiply) * 1e6 / count
        xq, xs = quantize_rows(x)
        row["fp8_gemm_only"] = layers_us(lambda weight: scaled_mm(xq, xs, weight), fp8)
    except RuntimeError as error:  # not every build has row-wise scaled_mm
        row["fp8_error"] = str(error)[:200]
    if autotune:
        start = time.perf_counter()
        tuned = torch.compile(torch.nn.functional.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
        tuned(x, weights[0])
        row["autotune_compile_s"] = time.perf_counter() - start
        row["triton_autotuned"] = layers_us(lambda w: tuned(x, w), weights)
    return row


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
    if not torch.cuda.is_available():
        raise SystemExit("scripts/bench/decode_kernels.py needs a GPU")
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    results: dict[str, Any] = {"bandwidth_tbps": bandwidth / 1e12}
    arch = architecture_of(args.model)
    layers = arch.num_layers
    for name, (n, k) in ({} if args.attention_only else gemm_shapes(arch)).items():
        count = 1 if name == "head" else layers
        row = gemm_row(n, k, count, args.batch, bandwidth, args.autotune)
        results[name] = row
        cells = "  ".join(f"{key} {value:7.1f}" for key, value in row.items() if isinstance(value, float))
        print(f"{name:5s} ({n}x{k}) µs per layer: {cells}", flush=True)

    if not args.attention_only:
        hidden = torch.randn(args.batch, arch.hidden_size, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn_like(hidden)
        norm = torch.nn.RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps, device="cuda", dtype=torch.bfloat16)
        norms = list(range(2 * layers))  # two per layer
        eager = layers_us(lambda _: norm(hidden + residual), norms)
        fused = layers_us(lambda _: add_rms_norm(hidden, residual, norm.weight, norm.eps), norms)
        results["add_rmsnorm_us"] = {"eager": eager, "compiled": fused}
        print(f"add + RMSNorm µs each: eager {eager:.1f}, compiled {fused:.1f}", flush=True)
    results["attention"] = attention_variants(arch, args.batch, args.max_len, bandwidth)
    write_report(results, args.out, show=False)


if __name__ == "__main__":
    main()
