"""The log-prob and entropy passes over a vocabulary shard as two Triton kernels (GPU, half or
single precision logits): one pass forward, one backward.

The compiled torch passes (``training/logprobs.py``) read the logits twice forward (the max,
then the sums) and a backward whose every element recomputes its column from a flat index, well
below the memory rate at a GRPO step's micro-batch (``docs/benchmarks.md``, "Kernels"). Here:

* forward, one program per token streams its row once, keeping flash attention's running maximum
  m and, relative to it, sum e^(z - m) and sum e^(z - m) (z - m), rescaled as m grows; the target's
  z is one load. The caller turns these shard statistics into ``logprobs.py``'s (relative to the
  maximum over TP ranks), so both paths hand the same numbers to the same all-reduce and backward;
* backward, one program per (token, block of columns) writes the gradient of its block, into a new
  tensor or over the logits themselves (``in_place``).

z = logits * (1 / T) in float32, -inf on padding columns (index >= ``n_real``), as ``_scaled``.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch without its Triton: the compiled torch passes
    triton = None

STATS_BLOCK, GRAD_BLOCK, NUM_WARPS = 8192, 2048, 4
"""Columns per loop iteration forward and per program backward, and warps per program: the fastest
of a sweep at a 1.5B GRPO step's micro-batch (``docs/benchmarks.md``, "Kernels")."""


def available(logits_shard: torch.Tensor) -> bool:
    return (
        triton is not None
        and logits_shard.is_cuda
        and logits_shard.dim() == 3
        and logits_shard.stride(-1) == 1
        and logits_shard.dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


def shard_stats(
    logits_shard: torch.Tensor, local_target: torch.Tensor, inv_temperature: float, n_real: int
) -> torch.Tensor:
    """(4, B, S) float32 of this shard alone: its max m of z, sum e^(z - m), sum e^(z - m) (z - m)
    over the columns with mass, and the target's z (meaningless where ``local_target`` is -1, not on
    this shard)."""
    batch, seq, vocab = logits_shard.shape
    out = torch.empty(4, batch, seq, dtype=torch.float32, device=logits_shard.device)
    target = local_target.contiguous()
    _stats_kernel[(batch * seq,)](
        logits_shard,
        logits_shard.stride(0),
        logits_shard.stride(1),
        seq,
        vocab,
        n_real,
        inv_temperature,
        target,
        out,
        out.stride(0),
        BLOCK=STATS_BLOCK,
        num_warps=NUM_WARPS,
    )
    return out


def shard_grad(
    logits_shard: torch.Tensor,
    local_target: torch.Tensor,
    z_max: torch.Tensor,
    log_sum_exp: torch.Tensor,
    mean_z: torch.Tensor,
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor,
    inv_temperature: float,
    n_real: int,
    *,
    in_place: bool = False,
) -> torch.Tensor:
    """``logprobs._shard_grad``: d(sum g_logp * logp + g_H * H) / d logits, in the logits' dtype;
    contiguous, or with ``in_place`` written over ``logits_shard`` itself (each program reads its
    block of a row before it writes the block's gradient there, so no value is read after it is
    overwritten). The per-token arguments are (B, S) float32, relative to the maximum ``z_max``."""
    batch, seq, vocab = logits_shard.shape
    grad = (
        logits_shard
        if in_place
        else torch.empty(batch, seq, vocab, dtype=logits_shard.dtype, device=logits_shard.device)
    )
    per_token = [t.contiguous() for t in (local_target, z_max, log_sum_exp, mean_z, grad_logprobs, grad_entropy)]
    _grad_kernel[(batch * seq, triton.cdiv(vocab, GRAD_BLOCK))](
        logits_shard,
        logits_shard.stride(0),
        logits_shard.stride(1),
        seq,
        vocab,
        n_real,
        inv_temperature,
        *per_token,
        grad,
        grad.stride(0),
        grad.stride(1),
        BLOCK=GRAD_BLOCK,
        num_warps=NUM_WARPS,
    )
    return grad


if triton is not None:

    @triton.jit
    def _scaled_block(
        row_ptr: tl.tensor, columns: tl.tensor, vocab: tl.tensor, n_real: tl.tensor, inv_temperature: tl.tensor
    ) -> tl.tensor:
        z = tl.load(row_ptr + columns, mask=columns < vocab, other=0.0).to(tl.float32) * inv_temperature
        return tl.where(columns < n_real, z, float("-inf"))

    @triton.jit
    def _stats_kernel(
        logits_ptr: tl.tensor,
        stride_b: tl.tensor,
        stride_s: tl.tensor,
        seq: tl.tensor,
        vocab: tl.tensor,
        n_real: tl.tensor,
        inv_temperature: tl.tensor,
        target_ptr: tl.tensor,
        out_ptr: tl.tensor,
        out_stride: tl.tensor,
        BLOCK: tl.constexpr,
    ) -> None:
        token = tl.program_id(0)
        row_ptr = logits_ptr + (token // seq).to(tl.int64) * stride_b + (token % seq).to(tl.int64) * stride_s
        running_max = -float("inf")
        running_sum = 0.0
        running_weighted = 0.0  # sum e^(z - max) (z - max), over the columns with mass
        for offset in range(0, vocab, BLOCK):
            z = _scaled_block(row_ptr, offset + tl.arange(0, BLOCK), vocab, n_real, inv_temperature)
            new_max = tl.maximum(running_max, tl.max(z, 0))
            shift = tl.where(new_max == -float("inf"), 0.0, new_max)  # nothing with mass yet: keep sums at 0, not NaN
            # The old sums moved from running_max to shift:
            # e^(z - shift) (z - shift) = r e^(z - m) ((z - m) + (m - shift)).
            rescale = tl.exp(running_max - shift)
            moved = tl.where(running_sum > 0, running_weighted + (running_max - shift) * running_sum, 0.0)
            exp_z = tl.exp(z - shift)
            running_sum = running_sum * rescale + tl.sum(exp_z, 0)
            running_weighted = moved * rescale + tl.sum(tl.where(exp_z > 0, exp_z * (z - shift), 0.0), 0)
            running_max = new_max
        target = tl.maximum(tl.load(target_ptr + token), 0)  # -1 (not on this shard): the caller ignores the value
        picked = tl.load(row_ptr + target).to(tl.float32) * inv_temperature
        tl.store(out_ptr + token, running_max)
        tl.store(out_ptr + out_stride + token, running_sum)
        tl.store(out_ptr + 2 * out_stride + token, running_weighted)
        tl.store(out_ptr + 3 * out_stride + token, tl.where(target < n_real, picked, -float("inf")))

    @triton.jit
    def _grad_kernel(
        logits_ptr: tl.tensor,
        stride_b: tl.tensor,
        stride_s: tl.tensor,
        seq: tl.tensor,
        vocab: tl.tensor,
        n_real: tl.tensor,
        inv_temperature: tl.tensor,
        target_ptr: tl.tensor,
        max_ptr: tl.tensor,
        lse_ptr: tl.tensor,
        mean_ptr: tl.tensor,
        grad_logprobs_ptr: tl.tensor,
        grad_entropy_ptr: tl.tensor,
        grad_ptr: tl.tensor,
        grad_stride_b: tl.tensor,
        grad_stride_s: tl.tensor,
        BLOCK: tl.constexpr,
    ) -> None:
        token = tl.program_id(0)
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        row_ptr = logits_ptr + (token // seq).to(tl.int64) * stride_b + (token % seq).to(tl.int64) * stride_s
        z = _scaled_block(row_ptr, columns, vocab, n_real, inv_temperature) - tl.load(max_ptr + token)
        probs = tl.exp(z - tl.load(lse_ptr + token))  # padding -> 0
        centred = tl.where(probs > 0, z, 0.0) - tl.load(mean_ptr + token)
        grad_logprob = tl.load(grad_logprobs_ptr + token)
        grad_z = -probs * (grad_logprob + tl.load(grad_entropy_ptr + token) * centred)
        grad_z += tl.where(columns == tl.load(target_ptr + token), grad_logprob, 0.0)
        out_row = grad_ptr + (token // seq).to(tl.int64) * grad_stride_b + (token % seq).to(tl.int64) * grad_stride_s
        tl.store(out_row + columns, (grad_z * inv_temperature).to(grad_ptr.dtype.element_ty), mask=columns < vocab)
