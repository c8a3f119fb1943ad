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
FlexAttention's, SDPA's and FlashInfer's; and the engine's token sampler against FlashInfer's.

FlashInfer is optional (``scripts/bench/flashinfer_carry.py`` makes a carry of it for a machine without a
network): where it does not import or its JIT build fails, its rows say why under ``*_unavailable``
and the rest is measured. Its kernels build on first use (nvcc and ninja, ``CUDA_HOME``; cached under
``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer``): the seconds of the first plan / call record that.
``--parts attention sampling`` measures only those rows.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import copy_bandwidth, cuda_ms_per_call, graph_seconds, write_report

from megatron_rlhf.checkpoint.sources import architecture_of
from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.models.attention import add_rms_norm, decode_score_bias, matmul_decode_attention
from megatron_rlhf.models.decode_attention import decode_attention
from megatron_rlhf.rollout.sampling import SamplingParams, apply_top_k_top_p, sample

Attend = Callable[[torch.Tensor], torch.Tensor]
PARTS = ("gemm", "norm", "attention", "sampling")
SAMPLING_FILTERS = {"unfiltered": (0, 1.0), "top_p_0.9": (0, 0.9), "top_k_50_top_p_0.9": (50, 0.9)}
"""(top_k, top_p) of each sampling row, at temperature 1."""


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


def cells(row: dict[str, Any]) -> str:
    return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())


def unavailable(error: Exception) -> str:
    """Why a FlashInfer variant cannot run, as ``"<type>: <message>"``: not installed, or its JIT
    build failed (ninja's output: its first line and the compiler's error lines, not the commands)."""
    lines = str(error).splitlines() or [""]
    errors = [line.strip() for line in lines[1:] if "error" in line.lower()]
    return f"{type(error).__name__}: " + " | ".join([lines[0], *errors[:5]])[:800]


def layers_us(call: Callable[[Any], object], per_layer: list[Any]) -> float:
    """Microseconds per layer of ``call`` over each layer's input, all layers replayed as one CUDA graph."""
    return graph_seconds(lambda: [call(item) for item in per_layer]) * 1e6 / len(per_layer)


def attention_variants(arch: Architecture, slots: int, max_len: int, bandwidth: float) -> dict[str, dict[str, Any]]:
    """Decode attention per layer over a cache slice of kv_len positions (half and all of
    ``max_len``; each slot's own length up to 64 below that; the floor reads only those): the
    engine's Triton kernel (what ``cached_decode_attention`` runs on a GPU) at several block sizes,
    warps and pipeline stages; its two matmuls around a fused softmax (what it runs on CPU);
    FlexAttention (compiled) and SDPA, each with a KV group's query heads as the query rows of one
    KV head (the mask a bias); FlashInfer's batch decode on CUDA cores and on tensor cores (its
    prefill kernel) over the same cache, each slot one page. Errors are against a float64 computation."""
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
        print(f"attention kv {kv_len}: {cells(row)}", flush=True)
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

    def flashinfer_decode(tensor_cores: bool) -> Attend:
        """FlashInfer's batch decode over the engine's cache as it is, no copy: each slot one page
        of ``kv_len`` positions in its HND layout (keys and values strided views of the last dim),
        planned once for each slot's length, with CUDA-graph buffers as the timing replays it."""
        import flashinfer

        pages = torch.arange(slots + 1, dtype=torch.int32, device="cuda")
        lengths = (positions[:, 0] + 1).int()  # slot i attends positions [0, positions[i]]
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.zeros(128 * 1024**2, dtype=torch.uint8, device="cuda"),
            kv_layout="HND",
            use_cuda_graph=True,
            use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=torch.empty_like(pages),
            paged_kv_indices_buffer=torch.empty_like(pages[:-1]),
            paged_kv_last_page_len_buffer=torch.empty_like(lengths),
        )
        heads = groups * q.shape[2]
        wrapper.plan(pages, pages[:-1], lengths, heads, groups, head_dim, kv_len, q_data_type=q.dtype, sm_scale=scale)
        queries = q.reshape(slots, heads, head_dim)
        return lambda cache: wrapper.run(queries, split(cache)).view(q.shape)

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
    for name, tensor_cores in (("flashinfer", False), ("flashinfer_tensor_cores", True)):
        start = time.perf_counter()
        try:
            variants[name] = flashinfer_decode(tensor_cores)
            row[f"{name}_plan_s"] = time.perf_counter() - start  # the first imports FlashInfer, builds its kernels
        except Exception as error:  # not installed, or its JIT build failed
            row[f"{name}_unavailable"] = unavailable(error)
    for name, attend in variants.items():
        try:
            row[f"{name}_max_error"] = (attend(caches[0]).double() - reference).abs().max().item()
            row[name] = layers_us(attend, caches)
        except Exception as failure:
            row[f"{name}_error"] = str(failure).splitlines()[0][:160]
    return row


def peaked_logits(rows: int, vocab: int, peaks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (rows, vocab) logits, every row the same: N(0, 1) with ``peaks`` tokens raised by 8 to
    12, which hold ~90% of the mass (an LM's few likely tokens over a long tail); and their indices."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    row = torch.randn(vocab, device="cuda", generator=generator)
    tokens = torch.randperm(vocab, device="cuda", generator=generator)[:peaks]
    row[tokens] += torch.linspace(8, 12, peaks, device="cuda")
    return row.expand(rows, vocab).contiguous(), tokens


def flashinfer_sampler(params: SamplingParams, generator: torch.Generator) -> Callable[[torch.Tensor], torch.Tensor]:
    """FlashInfer's draw as the engine takes it: top-k/top-p through ``rollout/sampling_flashinfer.py``
    (``filtered_sampler=flashinfer``: its kernels, the float32 softmax and log-prob around them);
    unfiltered, where the engine keeps its Triton kernel, FlashInfer's ``sampling_from_logits``
    (tokens only)."""
    if params.top_k or params.top_p < 1:
        return lambda logits: sample(logits, params, generator, "flashinfer")[0]
    from flashinfer import sampling

    return lambda logits: sampling.sampling_from_logits(logits, generator=generator)


def total_variation(categories: torch.Tensor, exact: torch.Tensor) -> float:
    """Total variation distance between the frequencies of ``categories`` (indices into ``exact``) and ``exact``."""
    frequencies = torch.bincount(categories, minlength=len(exact)).double() / len(categories)
    return 0.5 * (frequencies - exact).abs().sum().item()


def sampling_row(logits: torch.Tensor, top_k: int, top_p: float, peaks: torch.Tensor, draws: int) -> dict[str, Any]:
    """The engine's sampler and FlashInfer's on ``logits`` with one filter: µs per call and the total
    variation distance of ``draws`` calls' tokens (each of ``peaks`` one category, the rest one) from
    the exact filtered softmax, beside that of as many ``torch.multinomial`` draws (the sampling noise)."""
    category = torch.full(logits.shape[1:], len(peaks), dtype=torch.long, device="cuda")
    category[peaks] = torch.arange(len(peaks), device="cuda")
    probs = torch.softmax(apply_top_k_top_p(logits[:1].double(), top_k, top_p), dim=-1)[0]
    exact = torch.zeros(len(peaks) + 1, dtype=torch.float64, device="cuda").index_add_(0, category, probs)
    row: dict[str, Any] = {
        "multinomial_tvd": total_variation(torch.multinomial(exact, len(logits) * draws, replacement=True), exact)
    }
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    engine = torch.Generator(device="cuda").manual_seed(1)
    samplers: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "engine": lambda x: sample(x, params, engine, "triton")[0]
    }
    start = time.perf_counter()
    try:
        samplers["flashinfer"] = flashinfer_sampler(params, torch.Generator(device="cuda").manual_seed(2))
        samplers["flashinfer"](logits)
        row["flashinfer_first_call_s"] = time.perf_counter() - start  # the first builds its sampling kernels
    except Exception as error:  # not installed, or its JIT build failed
        samplers.pop("flashinfer", None)
        row["flashinfer_unavailable"] = unavailable(error)
    for name, draw in samplers.items():
        row[f"{name}_us"] = cuda_ms_per_call(functools.partial(draw, logits), calls=20) * 1e3
        tokens = torch.cat([draw(logits) for _ in range(draws)])
        row[f"{name}_tvd"] = total_variation(category[tokens.long()], exact)
    return row


def sampling_variants(rows: int, vocab: int, draws: int) -> dict[str, dict[str, Any]]:
    """The engine's Triton sampler (``rollout.sampling.sample`` with ``filtered_sampler=triton``: one
    pass unfiltered, rejection from the mass above a pivot with top-k / top-p; it returns each token's
    log-prob over the full vocabulary too) against FlashInfer's (``flashinfer_sampler``) at
    temperature 1, on bf16 and float32 (rows, vocab)
    ``peaked_logits``: µs per call, eager (the engine samples outside its CUDA graphs), and whether
    both draw from the same filtered softmax (``sampling_row``)."""
    logits, peaks = peaked_logits(rows, vocab, peaks=32)
    out: dict[str, dict[str, Any]] = {}
    for label, (top_k, top_p) in SAMPLING_FILTERS.items():
        for dtype in (torch.bfloat16, torch.float32):
            key = f"{label}_{str(dtype).removeprefix('torch.')}"
            out[key] = sampling_row(logits.to(dtype), top_k, top_p, peaks, draws)
            print(f"sampling {key}: {cells(out[key])}", flush=True)
    return out


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
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS, help="which rows to measure (default: all)")
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
    for name, (n, k) in (gemm_shapes(arch) if "gemm" in args.parts else {}).items():
        count = 1 if name == "head" else layers
        row = gemm_row(n, k, count, args.batch, bandwidth, args.autotune)
        results[name] = row
        figures = "  ".join(f"{key} {value:7.1f}" for key, value in row.items() if isinstance(value, float))
        print(f"{name:5s} ({n}x{k}) µs per layer: {figures}", flush=True)

    if "norm" in args.parts:
        hidden = torch.randn(args.batch, arch.hidden_size, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn_like(hidden)
        norm = torch.nn.RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps, device="cuda", dtype=torch.bfloat16)
        norms = list(range(2 * layers))  # two per layer
        eager = layers_us(lambda _: norm(hidden + residual), norms)
        fused = layers_us(lambda _: add_rms_norm(hidden, residual, norm.weight, norm.eps), norms)
        results["add_rmsnorm_us"] = {"eager": eager, "compiled": fused}
        print(f"add + RMSNorm µs each: eager {eager:.1f}, compiled {fused:.1f}", flush=True)
    if "attention" in args.parts:
        results["attention"] = attention_variants(arch, args.batch, args.max_len, bandwidth)
    if "sampling" in args.parts:
        results["sampling"] = sampling_variants(args.batch, arch.vocab_size, draws=100)
    write_report(results, args.out, show=False)


if __name__ == "__main__":
    main()
