"""Exact per-token log-probs and entropy from vocab-parallel (tensor-parallel sharded) logits.

Shape legend: B = batch (sequences), S = sequence positions, Vp = padded vocabulary (a multiple of
megatron's padding step, >= the real vocab_size), tp = tensor-parallel size, Vl = Vp / tp.
  logits_shard (B, S, Vl) any float dtype: this TP rank's contiguous slice of the vocabulary,
      global columns [tp_rank * Vl, (tp_rank + 1) * Vl) (megatron's VocabUtility partition)
  targets (B, S) int64: global token ids in [0, vocab_size)
  -> logprobs (B, S) float32 (float64 for float64 logits): log softmax(logits / T)[target]
  -> entropy (B, S) same dtype, or None: H = -sum_v p_v log p_v of softmax(logits / T)

Why it is done this way:
* The temperature divides the logits *before* the softmax, exactly as the sampler does
  (``softmax(logits / T)``). The PPO/GRPO ratio pi_new / pi_old and the KL to the reference compare
  trainer log-probs with sampler log-probs; computing them at T=1 while sampling at T != 1 would
  make the ratio wrong on the very first step.
* Vocabulary padding (global index >= vocab_size) is masked to -inf: those rows of the LM head are
  never trained and may hold any value, and must never receive probability (nor gradient).
* Everything runs in float32 (float64 stays float64) whatever the input dtype: bf16 logits are
  upcast, since log-probs feed exp(logp - logp_old) where bf16 rounding alone moves the ratio by
  ~1e-2. The softmax is stabilised with the global max over TP (all_reduce MAX); the sum of
  exponentials, the target logit (picked on the rank that owns it, 0 elsewhere) and the entropy's
  sum p * z travel together in one all_reduce SUM. Nothing is gathered over the vocabulary.
* The backward pass is explicit (a ``torch.autograd.Function``): a plain ``dist.all_reduce`` is not
  autograd-aware. With z = masked logits / T, p = softmax(z) and t the target,
      d logp_t / d logits_j = (1[j == t] - p_j) / T
      d H / d logits_j      = -p_j (z_j - sum_k p_k z_k) / T
  Both need only per-token statistics (max, log-sum-exp, sum p z) that every rank already holds
  after the forward, so the backward needs no collective: each rank gets the exact gradient of its
  own shard. To keep memory low, the backward recomputes p from the saved input logits instead of
  saving a float32 (B, S, Vl) tensor. A caller whose logits serve this call alone
  (``overwrite_logits``) lets the GPU kernel write the gradient over them: at a 1.5B model's
  micro-batch of 16k tokens that tensor is about 3 GB, alive at the update's peak (the start of
  the backward, every layer's activations still held).
* Speed: on a GPU one Triton kernel reads the logits once for every statistic, with a running
  maximum (``logprobs_kernel.py``), and another writes the gradient. Elsewhere (CPU, float64) each
  pass over the vocabulary (max; the three sums; the gradient) is plain torch, fused by
  ``torch.compile`` where it can be.
* No host synchronisation (no ``.item()``, no data-dependent Python branching). Targets outside
  [0, vocab_size) are not checked (that would need a sync): a padding target yields -inf, a
  negative one an arbitrary finite value; callers mask such positions out.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_rlhf.fusion import gpu_fused
from megatron_rlhf.training import logprobs_kernel

__all__ = ["token_logprobs_and_entropy"]


def _tp_size_rank(tp_group: ProcessGroup | None) -> tuple[int, int]:
    if tp_group is None:
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


# The torch passes over the vocabulary (where ``logprobs_kernel`` does not run) are written as plain
# elementwise + reduction code so that on a GPU ``torch.compile`` fuses each into one kernel that
# never materialises a float32 (B, S, Vl) tensor; on CPU (tests, CI) they run eagerly.


def _scaled(logits_shard: Tensor, dtype: torch.dtype, inv_temperature: float, n_real: int) -> Tensor:
    """z = logits / T in ``dtype``, -inf on padding columns (local index >= n_real)."""
    z = logits_shard.to(dtype) * inv_temperature
    column = torch.arange(z.shape[-1], device=z.device)
    return torch.where(column < n_real, z, float("-inf"))


@gpu_fused
def _shard_max(logits_shard: Tensor, dtype: torch.dtype, inv_temperature: float, n_real: int) -> Tensor:
    return _scaled(logits_shard, dtype, inv_temperature, n_real).amax(dim=-1)


@gpu_fused
def _shard_stats(
    logits_shard: Tensor, local_target: Tensor, z_max: Tensor, dtype: torch.dtype, inv_temperature: float, n_real: int
) -> Tensor:
    """(3, B, S): sum_v e^(z_v - max), the target's z - max (0 if not on this shard), and
    sum_v e^(z_v - max) (z_v - max)."""
    z = _scaled(logits_shard, dtype, inv_temperature, n_real) - z_max.unsqueeze(-1)
    exp_z = z.exp()  # padding -> 0
    column = torch.arange(z.shape[-1], device=z.device)
    picked = torch.where(column == local_target.unsqueeze(-1), z, 0.0).sum(dim=-1)
    weighted = torch.where(exp_z > 0, exp_z * z, 0.0).sum(dim=-1)  # -inf * 0 would be nan
    return torch.stack([exp_z.sum(dim=-1), picked, weighted])


@gpu_fused
def _shard_grad(
    logits_shard: Tensor,
    local_target: Tensor,
    z_max: Tensor,
    log_sum_exp: Tensor,
    mean_z: Tensor,
    grad_logprobs: Tensor,
    grad_entropy: Tensor,
    dtype: torch.dtype,
    inv_temperature: float,
    n_real: int,
) -> Tensor:
    """d(sum g_logp * logp + g_H * H) / d logits for this shard, in the logits' dtype."""
    z = _scaled(logits_shard, dtype, inv_temperature, n_real) - z_max.unsqueeze(-1)
    probs = (z - log_sum_exp.unsqueeze(-1)).exp()  # padding -> 0
    centred = torch.where(probs > 0, z, 0.0) - mean_z.unsqueeze(-1)
    grad_z = -probs * (grad_logprobs.unsqueeze(-1) + grad_entropy.unsqueeze(-1) * centred)
    column = torch.arange(z.shape[-1], device=z.device)
    grad_z = grad_z + torch.where(column == local_target.unsqueeze(-1), grad_logprobs.unsqueeze(-1), 0.0)
    return (grad_z * inv_temperature).to(logits_shard.dtype)


@gpu_fused
def _relative_to_max(local_stats: Tensor, local_target: Tensor, z_max: Tensor) -> Tensor:
    """``_shard_stats`` from ``logprobs_kernel.shard_stats``'s one pass (relative to the shard's own
    max m): the sums moved to the max over TP, e^(z - M) = e^(m - M) e^(z - m) and
    e^(z - M) (z - M) = e^(m - M) e^(z - m) ((z - m) + (m - M))."""
    local_max, local_sum, local_weighted, target_z = local_stats
    rescale = (local_max - z_max).exp()  # 0 on a shard of padding only (m = -inf)
    moved = torch.where(local_sum > 0, local_weighted + (local_max - z_max) * local_sum, 0.0)
    picked = torch.where(local_target >= 0, target_z - z_max, 0.0)
    return torch.stack([local_sum * rescale, picked, moved * rescale])


class _VocabParallelLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits_shard: Tensor,
        targets: Tensor,
        tp_group: ProcessGroup | None,
        vocab_size: int,
        temperature: float,
        compute_entropy: bool,
        overwrite_logits: bool,
    ) -> tuple[Tensor, Tensor | None]:
        tp_size, tp_rank = _tp_size_rank(tp_group)
        local_vocab = logits_shard.shape[-1]
        vocab_start = tp_rank * local_vocab
        n_real = min(max(vocab_size - vocab_start, 0), local_vocab)  # real columns on this rank
        dtype = torch.promote_types(logits_shard.dtype, torch.float32)
        # Target columns owned by another rank map to -1, which matches no local column.
        local_target = targets - vocab_start
        local_target = torch.where((local_target >= 0) & (local_target < local_vocab), local_target, -1)

        single_pass = logprobs_kernel.available(logits_shard)
        if single_pass:
            local_stats = logprobs_kernel.shard_stats(logits_shard, local_target, 1.0 / temperature, n_real)
            z_max = local_stats[0].clone()
        else:
            z_max = _shard_max(logits_shard, dtype, 1.0 / temperature, n_real)
        if tp_size > 1:  # -inf on a rank whose shard is all padding
            dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=tp_group)
        if single_pass:
            stats = _relative_to_max(local_stats, local_target, z_max)
        else:
            stats = _shard_stats(logits_shard, local_target, z_max, dtype, 1.0 / temperature, n_real)
        if tp_size > 1:  # the three per-token sums travel together
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=tp_group)
        log_sum_exp = stats[0].log()  # logsumexp(z) - max
        logprobs = stats[1] - log_sum_exp
        mean_z = stats[2] / stats[0]  # sum_v p_v (z_v - max)
        entropy = log_sum_exp - mean_z if compute_entropy else None

        ctx.save_for_backward(logits_shard, local_target, z_max, log_sum_exp, mean_z)
        ctx.settings = (dtype, 1.0 / temperature, n_real, single_pass, overwrite_logits and single_pass)
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, None, None, None, None, None, None]:
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        logits_shard, local_target, z_max, log_sum_exp, mean_z = ctx.saved_tensors
        dtype, inv_temperature, n_real, single_pass, in_place = ctx.settings
        zeros = torch.zeros_like(log_sum_exp)
        grad_logprobs = zeros if grad_logprobs is None else grad_logprobs.to(dtype)
        grad_entropy = zeros if grad_entropy is None else grad_entropy.to(dtype)
        if single_pass:
            grad_logits = logprobs_kernel.shard_grad(
                logits_shard,
                local_target,
                z_max,
                log_sum_exp,
                mean_z,
                grad_logprobs,
                grad_entropy,
                inv_temperature,
                n_real,
                in_place=in_place,
            )
            if in_place:  # anything else that saved these logits now fails loudly instead of reading gradients
                torch.autograd.graph.increment_version(logits_shard)
        else:
            grad_logits = _shard_grad(
                logits_shard,
                local_target,
                z_max,
                log_sum_exp,
                mean_z,
                grad_logprobs,
                grad_entropy,
                dtype,
                inv_temperature,
                n_real,
            )
        return grad_logits, None, None, None, None, None, None


def token_logprobs_and_entropy(
    logits_shard: Tensor,
    targets: Tensor,
    *,
    tp_group: ProcessGroup | None,
    vocab_size: int,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    overwrite_logits: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log softmax(logits / T)[targets] and the entropy of softmax(logits / T), per token.

    ``logits_shard`` (B, S, Vp/tp) is this rank's vocabulary shard (the whole padded vocabulary when
    ``tp_group`` is None or of size 1, in which case no collective is issued); ``targets`` (B, S)
    holds global token ids. Columns with a global index >= ``vocab_size`` are padding and get no
    probability. Returns (logprobs (B, S), entropy (B, S) or None if not ``compute_entropy``), in
    float32 (float64 for float64 logits), differentiable w.r.t. ``logits_shard`` on every TP rank.
    Collective: every rank of ``tp_group`` must call it with the same targets and arguments.
    ``overwrite_logits``: the backward may write the gradient over ``logits_shard`` (on a GPU; the
    torch passes elsewhere allocate it), for logits that nothing else reads after it; autograd
    then refuses any other backward that saved them. A leaf is never overwritten.
    """
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature={temperature!r} must be a finite number > 0 (logits are divided by it)")
    if not logits_shard.is_floating_point() or logits_shard.dim() < 1:
        raise ValueError(f"logits_shard must be a floating-point tensor (..., V); got {logits_shard.dtype}")
    if targets.shape != logits_shard.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal logits_shard shape without the vocab dim "
            f"{tuple(logits_shard.shape[:-1])}"
        )
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be integer token ids (int64); got {targets.dtype}")
    tp_size, _ = _tp_size_rank(tp_group)
    padded_vocab = logits_shard.shape[-1] * tp_size
    if not 0 < vocab_size <= padded_vocab:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {padded_vocab}] (shard width x tp size)")
    return _VocabParallelLogprobsEntropy.apply(
        logits_shard,
        targets.long(),
        tp_group,
        int(vocab_size),
        float(temperature),
        bool(compute_entropy),
        overwrite_logits and not _of_a_leaf(logits_shard),
    )


def _of_a_leaf(tensor: Tensor) -> bool:
    """A leaf, or a view of one (whose data the caller owns)."""
    base = tensor._base if tensor._base is not None else tensor
    return base.grad_fn is None
