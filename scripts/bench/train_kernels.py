"""Benchmark: the training step's kernels against the libraries that compete with them, at the 1.5B
GRPO step's micro-batch shapes (``--model``'s hidden size, padded vocabulary and attention heads).

    python scripts/bench/train_kernels.py [--parts logprobs liger attention] [--scored-tokens 10900]
        [--sequences 43 --seq-len 384] [--out kernels.json]

Parts (default all):

* ``logprobs``: the log-prob and entropy kernels over the vocabulary (``training/logprobs_kernel.py``)
  against the compiled torch passes they replace (``training/logprobs.py``), forward and backward
  over bf16 logits: time per call (``--repeat`` calls back to back, best of three), the bytes each
  must move at least (read each input once, write each output once), and that over the time as a
  fraction of the copy rate measured in the same run.
* ``liger``: per-token log-probs from the final hidden states, backward to the hidden states and
  the LM head weight. Ours is the LM head GEMM (bf16 logits) then ``token_logprobs_and_entropy``,
  which also computes the entropy and its gradient. Liger-Kernel's fused linear cross-entropy
  (``reduction='none'``: per-token -log-prob only, no entropy) never holds all the logits: it
  walks the tokens in chunks, recomputing them in its backward. Liger's chunked GRPO loss
  (reference-free: ``beta=0``, on-policy ratio; the log-probs by chunks of its own) is the
  closest thing to our whole loss; it computes its gradients in the forward, so its backward only
  scales them. Per row: ms forward and backward, peak memory of one forward + backward above its
  inputs, and the max abs error of the per-token log-probs against float64 on ``--check-tokens``
  tokens. Rows of a missing ``liger_kernel`` say why they are unavailable.
* ``attention``: causal training attention (forward and backward) over ``--sequences`` sequences of
  ``--seq-len`` tokens, as one packed row (each sequence attending only to itself) and as a batch
  of rows: our ``SDPAttention`` (flash attention's variable-length kernel for the packed row, told
  the longest sequence's length as the training schedule tells it; SDPA for the batch), against
  ``varlen_attn`` called directly, SDPA with each
  backend forced (K/V heads repeated for a backend without grouped-query attention), and
  FlexAttention compiled with a (document-)causal block mask. Per row: ms, TFLOP/s (a sequence of
  s tokens counts 2 s^2 heads head_dim FLOPs forward, 2.5x that backward) and its fraction of the
  matmul peak measured in the same run, peak memory, and the max abs error of the output against
  float64. A variant that raises records the error.
* ``new_shapes``: what a micro-batch shape costs the first time it is seen, as in a run whose
  response lengths vary from step to step (each micro-batch's rows and width follow its
  sequences). Causal attention forward + backward of the batch-of-rows layout, SDPA with torch's
  choice of backend (what ``SDPAttention`` runs), cuDNN forced and flash forced, each on its own
  ``--new-shapes`` (rows, width) shapes, drawn as a token budget of ``--sequences`` x
  ``--seq-len`` cuts them: the first call's ms, the same shape's steady ms, and the difference.
* ``epilogue``: the MLP's first GEMM and its SwiGLU (``--sequences`` x ``--seq-len`` tokens, the
  hidden size into twice the FFN size), forward: cuBLAS then our SwiGLU kernel, against one Triton
  GEMM that applies SwiGLU to its two accumulators before it stores (the output never written at
  twice the width and read back), and each GEMM alone. Per row: ms, TFLOP/s against the matmul
  peak measured in the same run, and the max abs error against float32 products of the same bf16
  inputs. This is the fusion the step's floor assumes (elementwise work costs nothing): it pays
  only where the Triton GEMM loses to cuBLAS by less than the SwiGLU pass costs.

GPU only.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from common import KernelReport, cuda_ms_per_call, forward_backward_ms, matmul_peak, wall_seconds, write_report

from megatron_rlhf.checkpoint.sources import architecture_of
from megatron_rlhf.models.architecture import Architecture, padded_vocab_size
from megatron_rlhf.models.swiglu import swiglu_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # the epilogue part's Triton GEMM is then unavailable
    triton = None

PARTS = ("logprobs", "liger", "attention", "new_shapes", "epilogue")
LIGER_CE = "liger fused linear cross-entropy, reduction='none'"
LIGER_GRPO = "liger chunked GRPO loss, reference-free"
WEIGHT_STD = 0.02
"""The LM head's weights are drawn N(0, WEIGHT_STD) (the built-in models' init): logits of std
about 0.8 over unit hidden states."""

Row = dict[str, Any]
LogprobFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(hidden (n, h), LM head weight (V, h), targets (n,)) -> per-token figures."""
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(q, k, v) -> attention output, each in its variant's layout."""
Maker = Callable[[], Attend]
Layout = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]


# -------------------------------------------------------------------------------------------------
# Shared measurements


def failure(error: Exception) -> Row:
    """A failed variant's row: the exception's type and first line (torch's dispatcher lists follow)."""
    first_line = next(iter(str(error).splitlines()), "")
    return {"error": f"{type(error).__name__}: {first_line}"}


def show(name: str, row: Row) -> None:
    cells = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
    print(f"  {name:<62} {cells}", flush=True)


def peak_mib(step: Callable[[], object]) -> float:
    """MiB allocated at the peak of one call of ``step`` above what was allocated before it: the
    memory it needs beyond its inputs (and the caching allocator's reserve does not count)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def timed(fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], calls: int) -> Row:
    """ms of ``fn``'s forward and of its backward (gradients to every input, from a kept graph),
    and the peak memory of one forward + backward."""
    leaves = [x.detach().requires_grad_() for x in inputs]

    def step() -> None:
        out = fn(*leaves)
        torch.autograd.grad(out, leaves, torch.ones_like(out))

    step()  # compiles (and autotunes) what is compiled, outside the peak and the timings
    peak = peak_mib(step)
    forward, backward = forward_backward_ms(fn, *inputs, calls=calls)
    return {"forward_ms": forward, "backward_ms": backward, "peak_MiB": peak}


def max_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return (value.double() - reference).abs().max().item()


# -------------------------------------------------------------------------------------------------
# Log-probs


def logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(2, ...) float32: ``token_logprobs_and_entropy`` of the whole (unsharded) vocabulary, stacked
    so that one upstream gradient drives both."""
    from megatron_rlhf.training.logprobs import token_logprobs_and_entropy

    logprobs, entropy = token_logprobs_and_entropy(logits, targets, tp_group=None, vocab_size=logits.shape[-1])
    assert entropy is not None  # compute_entropy defaults to True
    return torch.stack([logprobs, entropy])


def kernel_vs_compiled(report: KernelReport, scored_tokens: int, vocab: int, calls: int) -> None:
    """Our Triton log-prob + entropy kernels against the compiled torch passes, over bf16 logits."""
    from megatron_rlhf.training import logprobs_kernel

    logits = torch.randn(1, scored_tokens, vocab, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(0, vocab, (1, scored_tokens), device="cuda")
    size = logits.numel() * logits.element_size()
    print("log-probs and entropy: forward reads the logits; backward reads them and writes their gradient")
    kernel_available = logprobs_kernel.available
    for name, available in (("ours", kernel_available), ("torch compiled", lambda _tensor: False)):
        logprobs_kernel.available = available  # the switch token_logprobs_and_entropy reads at each call
        forward, backward = forward_backward_ms(lambda x: logprobs_and_entropy(x, targets), logits, calls=calls)
        report.add(f"log-probs forward, {name}", forward, size)
        report.add(f"log-probs backward, {name}", backward, 2 * size)
    logprobs_kernel.available = kernel_available


def reference_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(2, n) float64 log-probs and entropies of the n rows of ``hidden`` (n, h)."""
    logp = (hidden.double() @ weight.double().t()).log_softmax(dim=-1)
    return torch.stack([logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(dim=-1)])


def padded_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` (n, ...) split into ``rows`` rows of ceil(n / rows), the last one zero-padded."""
    width = -(-x.shape[0] // rows)
    return torch.cat([x, x.new_zeros(rows * width - x.shape[0], *x.shape[1:])]).view(rows, width, *x.shape[1:])


def liger_variants(sequences: int) -> dict[str, tuple[LogprobFn, LogprobFn, str]]:
    """Liger-Kernel's rows of ``from_hidden`` (ImportError without ``liger_kernel``): its fused
    linear cross-entropy, and its chunked GRPO loss over the tokens as ``sequences`` sequences."""
    from liger_kernel.chunked_loss.fused_linear_ppo import LigerFusedLinearPPOBase
    from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOLoss
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    cross_entropy = LigerFusedLinearCrossEntropyLoss(reduction="none")
    grpo = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False)  # token-mean ("dapo"), on-policy ratio
    advantages = torch.randn(sequences, device="cuda")

    def logprobs(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return -cross_entropy(w, h, t)

    def grpo_loss(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        # (sequences, length, h): the tokens as the micro-batch's sequences, the last one padded
        # (masked out of the loss, still computed)
        mask = padded_rows(torch.ones_like(t), sequences)
        return grpo(padded_rows(h, sequences), w, padded_rows(t, sequences), mask, advantages)[0]

    def grpo_logprobs(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return LigerFusedLinearPPOBase.chunk_forward(h[None], w, t[None])[0]

    return {
        LIGER_CE: (logprobs, logprobs, "log-probs only, no entropy"),
        LIGER_GRPO: (
            grpo_loss,
            grpo_logprobs,
            f"the whole loss over {sequences} padded sequences, its gradients computed in its forward; "
            "the error is of its chunk_forward's log-probs; no entropy",
        ),
    }


def from_hidden(
    hidden_size: int, vocab: int, scored_tokens: int, sequences: int, check_tokens: int, calls: int
) -> dict[str, Row]:
    """Per-token log-probs of ``scored_tokens`` bf16 hidden states through a ``vocab`` x
    ``hidden_size`` LM head, backward to both: ours and Liger-Kernel's, each row printed as measured."""
    hidden = torch.randn(scored_tokens, hidden_size, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(vocab, hidden_size, device="cuda") * WEIGHT_STD).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (scored_tokens,), device="cuda")
    check = slice(0, check_tokens)
    reference = reference_logprobs(hidden[check], weight, targets[check])

    def ours(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return logprobs_and_entropy(F.linear(h[None], w), t[None])[:, 0]

    # name -> (what is timed, what gives the checked log-probs (and entropies), a note)
    variants = {
        "ours: LM head GEMM + log-prob/entropy kernel": (ours, ours, "also computes the entropy and its gradient")
    }
    unavailable: dict[str, Row] = {}
    try:
        variants |= liger_variants(sequences)
    except ImportError as error:
        unavailable = {name: {"unavailable": f"liger_kernel: {error}"} for name in (LIGER_CE, LIGER_GRPO)}
    rows: dict[str, Row] = {}
    for name, (timed_fn, checked_fn, note) in variants.items():
        try:
            row = timed(partial(timed_fn, t=targets), (hidden, weight), calls)
            with torch.no_grad():
                checked = checked_fn(hidden[check], weight, targets[check])
            # (n,) log-probs, or (2, n) log-probs and entropies: against the reference's first rows
            errors = zip(
                ("logprob_max_abs_err", "entropy_max_abs_err"), checked.view(-1, check_tokens), reference, strict=False
            )
            row |= {key: max_error(value, ref) for key, value, ref in errors} | {"note": note}
        except Exception as error:  # one row fails, not the run
            row = failure(error)
        rows[name] = row
        show(name, row)
    for name, row in unavailable.items():
        rows[name] = row
        show(name, row)
    return rows


# -------------------------------------------------------------------------------------------------
# Attention

LAYOUTS: dict[str, Layout] = {
    "sbhd": (lambda x: x.transpose(0, 1), lambda out: out.transpose(0, 1)),
    "packed sbhd": (lambda x: x.flatten(0, 1)[:, None], lambda out: out),
    "bhsd": (lambda x: x.transpose(1, 2), lambda out: out.transpose(1, 2)),
    "packed bhsd": (lambda x: x.flatten(0, 1)[None].transpose(1, 2), lambda out: out.transpose(1, 2)),
    "thd": (lambda x: x.flatten(0, 1), lambda out: out),
}
"""How a variant takes (n, s, heads, d) inputs of n sequences of s tokens (made contiguous so), and
how its output comes back to an order whose reshape to (n, s, heads, d) is the same output.
"packed": the n sequences one after the other in one row; "thd": tokens, heads, d."""


def attention_flops(sequences: int, seq_len: int, heads: int, head_dim: int) -> float:
    """Forward FLOPs of causal attention over ``sequences`` sequences of ``seq_len`` tokens: per
    sequence and head, QK^T and PV over the s^2 / 2 pairs it attends, 2 FLOPs per multiply-add."""
    return sequences * 4 * seq_len**2 / 2 * heads * head_dim


def sdp_attention(arch: Architecture) -> torch.nn.Module:
    """Our core attention module (``SDPAttention``) of ``arch``, as the model builds it (causal, no dropout)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rlhf.models.attention import SDPAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        attention_dropout=0.0,
    )
    return SDPAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def causal_block_mask(document: torch.Tensor) -> Any:
    """FlexAttention's block mask of causal attention within documents: token i attends the tokens
    j <= i with ``document[j] == document[i]``."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

    return create_block_mask(mask_mod, None, None, document.numel(), document.numel(), device=document.device)


def attention_variants(arch: Architecture, sequences: int, seq_len: int) -> dict[str, dict[str, tuple[str, Maker]]]:
    """Per shape (the packed row, the batch of rows), each variant's input layout and a maker of
    its call ``(q, k, v) -> out`` (built inside the variant's ``try``: a block mask may fail too)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    from megatron_rlhf.models.attention import _flash_varlen_usable

    tokens = sequences * seq_len
    scale = arch.head_dim**-0.5
    module = sdp_attention(arch)
    cu_seqlens = torch.arange(0, tokens + 1, seq_len, dtype=torch.int32, device="cuda")
    # The schedule's packed rows are never wider than the longest sequence (microbatch.pack_rows), so
    # that is the kernel's max length: given this row's whole width instead, its backward took 0.84 ms
    # against 0.47 (2026-12-04), blocks with nothing to do.
    packed = PackedSeqParams(
        qkv_format="sbhd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=seq_len,
        max_seqlen_kv=seq_len,
    )
    compiled_flex = torch.compile(flex_attention)
    # what SDPAttention runs on the packed row: flash attention's variable-length kernel where usable
    probe = torch.empty(1, 1, 1, arch.head_dim, device="cuda", dtype=torch.bfloat16)
    ours_packed = "varlen_attn" if _flash_varlen_usable(probe, 0.0) else "SDPA, packed mask"

    def ours(params: Any) -> Attend:
        return lambda q, k, v: module(q, k, v, None, packed_seq_params=params)

    def varlen() -> Attend:
        from torch.nn.attention.varlen import varlen_attn

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, seq_len, seq_len, scale=scale, window_size=(-1, 0))
            return cast(torch.Tensor, out)  # a tuple only when return_aux asks for more

        return attend

    def sdpa(backend: SDPBackend, repeat_kv: bool) -> Attend:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if repeat_kv:  # a backend without grouped-query attention: one K/V head per query head
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=not repeat_kv)

        return attend

    def flex(document: torch.Tensor) -> Attend:
        block_mask = causal_block_mask(document)
        return lambda q, k, v: cast(
            torch.Tensor, compiled_flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
        )

    batch: dict[str, tuple[str, Maker]] = {
        "ours: SDPAttention (SDPA, torch's backend choice)": ("sbhd", partial(ours, None))
    }
    for backend, repeat_kv in (
        (SDPBackend.FLASH_ATTENTION, False),
        (SDPBackend.CUDNN_ATTENTION, False),
        (SDPBackend.CUDNN_ATTENTION, True),
        (SDPBackend.EFFICIENT_ATTENTION, False),
        (SDPBackend.EFFICIENT_ATTENTION, True),
    ):
        batch[f"sdpa {backend.name}" + (", K/V repeated" if repeat_kv else "")] = (
            "bhsd",
            partial(sdpa, backend, repeat_kv),
        )
    batch["flex_attention compiled, causal block mask"] = (
        "bhsd",
        partial(flex, torch.zeros(seq_len, dtype=torch.int32, device="cuda")),
    )
    document = torch.arange(tokens, device="cuda") // seq_len
    return {
        f"packed row ({sequences} sequences x {seq_len} tokens in one row)": {
            f"ours: SDPAttention ({ours_packed})": ("packed sbhd", partial(ours, packed)),
            "varlen_attn called directly": ("thd", varlen),
            "flex_attention compiled, document-causal block mask": ("packed bhsd", partial(flex, document)),
        },
        f"batch of rows ({sequences}, {seq_len})": batch,
    }


def attention(arch: Architecture, sequences: int, seq_len: int, peak: float, calls: int) -> dict[str, dict[str, Row]]:
    """Each variant of ``attention_variants`` forward and backward on the same bf16 q, k, v, each row
    printed as measured."""
    import torch._functorch.config as functorch_config
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # Compiled FlexAttention donates its saved buffers to its backward, which then refuses the
    # repeated backward passes of one graph that the timing runs (retain_graph).
    functorch_config.donated_buffer = False
    shape = (sequences, seq_len)
    q = torch.randn(*shape, arch.num_attention_heads, arch.head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (
        torch.randn(*shape, arch.num_query_groups, arch.head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)
    )
    wide = [t.double().transpose(1, 2) for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        reference = F.scaled_dot_product_attention(
            wide[0], wide[1], wide[2], is_causal=True, scale=arch.head_dim**-0.5, enable_gqa=True
        ).transpose(1, 2)
    flops = attention_flops(sequences, seq_len, arch.num_attention_heads, arch.head_dim)
    result: dict[str, dict[str, Row]] = {}
    for shape_name, variants in attention_variants(arch, sequences, seq_len).items():
        print(f"attention, {shape_name}: {flops / 1e9:.4g} GFLOP forward, 2.5x that backward")
        rows = result[shape_name] = {}
        for name, (layout, make) in variants.items():
            to_layout, back = LAYOUTS[layout]
            inputs = tuple(to_layout(t).contiguous() for t in (q, k, v))
            try:
                fn = make()
                row = timed(fn, inputs, calls)
                with torch.no_grad():
                    out = back(fn(*inputs)).reshape(reference.shape)
                for step, step_flops in (("forward", flops), ("backward", 2.5 * flops)):
                    tflops = step_flops / row[f"{step}_ms"] / 1e9
                    row |= {f"{step}_TFLOPs": tflops, f"{step}_of_matmul_peak": tflops * 1e12 / peak}
                row["max_abs_err"] = max_error(out, reference)
            except Exception as error:  # one variant fails, not the run
                row = failure(error)
            rows[name] = row
            show(name, row)
    return result


def _qkv_leaves(arch: Architecture, rows: int, width: int) -> list[torch.Tensor]:
    """Random bf16 q, k, v (rows, heads or KV groups, width, head_dim) that take gradients."""
    heads = (arch.num_attention_heads, arch.num_query_groups, arch.num_query_groups)
    return [
        torch.randn(rows, count, width, arch.head_dim, device="cuda", dtype=torch.bfloat16).requires_grad_()
        for count in heads
    ]


def _attention_step(backend: Any, leaves: list[torch.Tensor]) -> None:
    """Causal GQA attention forward and backward on ``leaves`` (q, k, v), on ``backend`` (None: torch's choice)."""
    from torch.nn.attention import sdpa_kernel

    with contextlib.ExitStack() as stack:
        if backend is not None:
            stack.enter_context(sdpa_kernel(backend))
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        torch.autograd.grad(out, leaves, torch.ones_like(out))


def new_shape_cost(arch: Architecture, budget: int, longest: int, count: int) -> dict[str, Row]:
    """Per backend, the mean ms of the first forward + backward on each of ``count`` shapes it has not
    seen, the mean steady ms of those shapes, and their difference (a plan built, a kernel loaded)."""
    from torch.nn.attention import SDPBackend

    generator = torch.Generator().manual_seed(0)
    backends: dict[str, SDPBackend | None] = {
        "SDPA, torch's choice (SDPAttention)": None,
        "sdpa CUDNN_ATTENTION": SDPBackend.CUDNN_ATTENTION,
        "sdpa FLASH_ATTENTION": SDPBackend.FLASH_ATTENTION,
    }
    seen: set[tuple[int, int]] = {(1, longest)}
    result: dict[str, Row] = {}
    for name, backend in backends.items():
        # the backend's one-time set-up (its library's handle, its first kernels) on a shape of its own
        _attention_step(backend, _qkv_leaves(arch, 1, longest))
        firsts, steadies = [], []
        while len(firsts) < count:
            width = int(torch.randint(longest // 3, longest + 1, (1,), generator=generator))
            rows = int(torch.randint(1, budget // width + 1, (1,), generator=generator))
            if (rows, width) in seen:  # every backend gets shapes no backend has run
                continue
            seen.add((rows, width))
            step = partial(_attention_step, backend, _qkv_leaves(arch, rows, width))
            firsts.append(wall_seconds(step, torch.device("cuda")) * 1e3)
            steadies.append(min(wall_seconds(step, torch.device("cuda")) for _ in range(3)) * 1e3)
        first, steady = statistics.mean(firsts), statistics.mean(steadies)
        result[name] = {
            "shapes": count,
            "first_call_ms": first,
            "steady_ms": steady,
            "first_call_excess_ms": first - steady,
        }
        show(name, result[name])
    return result


def _gemm_configs() -> list[Any]:
    return [
        triton.Config({"BM": bm, "BN": bn, "BK": 64, "GROUP_M": 8}, num_stages=stages, num_warps=warps)
        for bm, bn, stages, warps in (
            (128, 256, 3, 8),
            (128, 128, 4, 8),
            (128, 128, 3, 4),
            (256, 128, 3, 8),
            (64, 256, 4, 4),
            (64, 128, 4, 4),
        )
    ]


if triton is not None:

    @triton.autotune(configs=_gemm_configs(), key=["M", "N", "K", "SWIGLU"])
    @triton.jit
    def _gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, SWIGLU: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
        """out (M, N) = x (M, K) @ w[:N]^T; with SWIGLU, silu(x @ w[:N]^T) * (x @ w[N:2N]^T) from two
        accumulators of the same tile. Row-major, N % BN == K % BK == 0."""
        pid = tl.program_id(0)
        blocks_m, blocks_n = tl.cdiv(M, BM), N // BN
        per_group = GROUP_M * blocks_n  # tiles of GROUP_M block-rows, walked column by column (L2 reuse)
        first_m = (pid // per_group) * GROUP_M
        group_m = min(blocks_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_m
        pid_n = (pid % per_group) // group_m
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        depth = tl.arange(0, BK)
        x_tile = x_ptr + rows[:, None] * K + depth[None, :]
        gate_tile = w_ptr + cols[None, :] * K + depth[:, None]  # (BK, BN): w's rows, transposed
        up_tile = gate_tile + N * K
        gate = tl.zeros((BM, BN), dtype=tl.float32)
        up = tl.zeros((BM, BN), dtype=tl.float32)
        for _ in range(tl.cdiv(K, BK)):
            a = tl.load(x_tile, mask=rows[:, None] < M, other=0.0)
            gate = tl.dot(a, tl.load(gate_tile), gate)
            if SWIGLU:
                up = tl.dot(a, tl.load(up_tile), up)
                up_tile += BK
            x_tile += BK
            gate_tile += BK
        result = gate * tl.sigmoid(gate) * up if SWIGLU else gate
        tl.store(
            out_ptr + rows[:, None] * N + cols[None, :], result.to(out_ptr.dtype.element_ty), mask=rows[:, None] < M
        )


def triton_gemm(x: torch.Tensor, weight: torch.Tensor, *, swiglu: bool) -> torch.Tensor:
    """``x @ weight.T`` (bf16), or with ``swiglu`` SwiGLU of it in the same kernel (half the width)."""
    M, K = x.shape
    N = weight.shape[0] // 2 if swiglu else weight.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)

    def grid(meta: dict[str, int]) -> tuple[int]:
        return (triton.cdiv(M, meta["BM"]) * (N // meta["BN"]),)

    _gemm_kernel[grid](x, weight, out, M, N, K, SWIGLU=swiglu)
    return out


def epilogue(arch: Architecture, tokens: int, peak: float, calls: int) -> dict[str, Row]:
    """The MLP's first GEMM with and without SwiGLU, cuBLAS (+ our SwiGLU kernel) against Triton."""
    from megatron_rlhf.models.swiglu import SwiGLU

    hidden, ffn = arch.hidden_size, arch.ffn_hidden_size
    if hidden % 64 or ffn % 256:
        raise SystemExit(f"--parts epilogue needs hidden % 64 == 0 and ffn % 256 == 0, not {hidden}, {ffn}")
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(2 * ffn, hidden, device="cuda", dtype=torch.bfloat16) * WEIGHT_STD
    products = x.float() @ weight.float().t()
    references = {"gemm": products, "swiglu": swiglu_reference(products)}
    variants: dict[str, tuple[str, Callable[[], torch.Tensor]]] = {
        "cuBLAS GEMM (torch.mm)": ("gemm", lambda: x @ weight.t()),
        "cuBLAS GEMM, then our SwiGLU kernel": ("swiglu", lambda: SwiGLU.apply(x @ weight.t())),
        "Triton GEMM": ("gemm", partial(triton_gemm, x, weight, swiglu=False)),
        "Triton GEMM, SwiGLU applied before the store": ("swiglu", partial(triton_gemm, x, weight, swiglu=True)),
    }
    flops = 2 * tokens * hidden * 2 * ffn
    print(f"MLP fc1 + SwiGLU, {tokens} x {hidden} into {2 * ffn}: {flops / 1e12:.4g} TFLOP")
    result: dict[str, Row] = {}
    for name, (kind, fn) in variants.items():
        try:
            out = fn()  # Triton's autotuning happens here
            ms = cuda_ms_per_call(fn, calls=calls)
            tflops = flops / ms / 1e9
            row: Row = {"ms": ms, "TFLOPs": tflops, "of_matmul_peak": tflops * 1e12 / peak}
            row["max_abs_err"] = (out.float() - references[kind]).abs().max().item()
        except Exception as error:  # one variant fails, not the run
            row = failure(error)
        result[name] = row
        show(name, row)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--model", default="builtin:llama-1.5b", help="hidden size, vocabulary and heads of this model")
    parser.add_argument(
        "--scored-tokens", type=int, default=10900, help="response tokens per micro-batch (LM head rows)"
    )
    parser.add_argument("--sequences", type=int, default=43, help="sequences per micro-batch")
    parser.add_argument("--seq-len", type=int, default=384, help="tokens per sequence (attention)")
    parser.add_argument("--check-tokens", type=int, default=1024, help="tokens whose log-probs are checked")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--new-shapes", type=int, default=12, help="unseen shapes per backend (new_shapes)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("scripts/bench/train_kernels.py needs a GPU")

    arch = architecture_of(args.model)
    vocab = padded_vocab_size(arch.vocab_size, 1)
    torch.manual_seed(0)
    report = KernelReport(
        {
            "scored_tokens": args.scored_tokens,
            "vocab": vocab,
            "hidden": arch.hidden_size,
            "sequences": args.sequences,
            "seq_len": args.seq_len,
            "heads": arch.num_attention_heads,
            "kv_groups": arch.num_query_groups,
            "head_dim": arch.head_dim,
        }
    )
    if "logprobs" in args.parts:
        kernel_vs_compiled(report, args.scored_tokens, vocab, args.repeat)
    if "liger" in args.parts:
        print(f"log-probs from hidden states ({args.scored_tokens} x {arch.hidden_size}, LM head {vocab} rows), bf16:")
        report.result["logprobs_from_hidden"] = from_hidden(
            arch.hidden_size, vocab, args.scored_tokens, args.sequences, args.check_tokens, args.repeat
        )
    if "attention" in args.parts:
        peak = matmul_peak(torch.device("cuda"))
        report.result["matmul_peak_TFLOPs"] = peak / 1e12
        print(f"matmul peak {peak / 1e12:.1f} TFLOP/s")
        report.result["attention"] = attention(arch, args.sequences, args.seq_len, peak, args.repeat)
    if "new_shapes" in args.parts:
        print(f"attention on shapes not seen before ({args.new_shapes} per backend), forward + backward:")
        report.result["new_shapes"] = new_shape_cost(arch, args.sequences * args.seq_len, args.seq_len, args.new_shapes)
    if "epilogue" in args.parts:
        peak = report.result.get("matmul_peak_TFLOPs", 0) * 1e12 or matmul_peak(torch.device("cuda"))
        report.result["matmul_peak_TFLOPs"] = peak / 1e12
        report.result["epilogue"] = epilogue(arch, args.sequences * args.seq_len, peak, args.repeat)
    write_report(report.result, args.out, show=False)


if __name__ == "__main__":
    main()
