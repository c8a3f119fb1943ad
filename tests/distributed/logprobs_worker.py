"""torchrun worker (2 ranks, gloo): vocab-parallel log-probs / entropy at TP2 vs TP1 and float64.

Every rank builds the same seeded full logits (B, S, Vp) and keeps its vocabulary shard. For each
case (temperature, vocab_size, dtype):
* logprobs, entropy and the gradient of sum(w1 * logp + w2 * H) w.r.t. the shard (shards gathered
  over TP) equal the TP=1 computation on the full logits to 1e-6 in float32 (bf16 inputs included),
  as |a - b| <= 1e-6 + 1e-6 |b|: log-probs reach |logp| > 8, where one float32 ulp is 9.5e-7 and
  the TP split of the sum of exponentials alone may move the result by an ulp;
* in float64 they equal an independent float64 reference (log_softmax + autograd) to 1e-10.
Rank 0 writes the max diffs to OUT/results.json. Any mismatch raises.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.launch import WorkerSession, worker_session

B, S, PADDED = 3, 7, 128
# (temperature, vocab_size, dtype); vocab_size=60 leaves rank 1 with padding only.
CASES = (
    (1.0, 97, torch.float32),
    (0.7, 97, torch.float32),
    (0.7, 60, torch.float32),
    (0.7, 97, torch.bfloat16),
    (1.0, 97, torch.float64),
    (0.7, 97, torch.float64),
    (0.7, 60, torch.float64),
)
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-6, torch.float64: 1e-10}  # absolute
RTOL = {torch.float32: 1e-6, torch.bfloat16: 1e-6, torch.float64: 0.0}


def make_inputs(vocab_size: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1234 + vocab_size)
    logits = 3.0 * torch.randn(B, S, PADDED, generator=gen, dtype=torch.float64)
    logits[..., vocab_size:] = 50.0 + 20.0 * torch.randn(B, S, PADDED - vocab_size, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, vocab_size, (B, S), generator=gen)
    targets[0, 0] = vocab_size - 1  # last real token (on the last rank holding real columns)
    targets[0, 1] = 0
    weights = torch.randn(2, B, S, generator=gen, dtype=torch.float64)
    return logits.to(dtype), targets, weights


def run(logits: torch.Tensor, targets, weights, tp_group, vocab_size: int, temperature: float):
    """Outputs and d(sum(w1 * logp + w2 * H))/d logits for the given logits (a shard or the whole)."""
    x = logits.detach().clone().requires_grad_(True)
    from megatron_rlhf.training.logprobs import token_logprobs_and_entropy

    logprobs, entropy = token_logprobs_and_entropy(
        x, targets, tp_group=tp_group, vocab_size=vocab_size, temperature=temperature
    )
    (weights[0].to(logprobs.dtype) * logprobs + weights[1].to(logprobs.dtype) * entropy).sum().backward()
    return logprobs.detach(), entropy.detach(), x.grad


def reference64(logits: torch.Tensor, targets, weights, vocab_size: int, temperature: float):
    x = logits.detach().double().requires_grad_(True)
    log_p = torch.log_softmax(x[..., :vocab_size] / temperature, dim=-1)
    logprobs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    (weights[0] * logprobs + weights[1] * entropy).sum().backward()
    return logprobs.detach(), entropy.detach(), x.grad


def max_diffs(a: torch.Tensor, b: torch.Tensor, rtol: float) -> torch.Tensor:
    """(max |a - b|, max (|a - b| - rtol |b|)) over all ranks."""
    diff = (a.double() - b.double()).abs()
    out = torch.stack([diff.max(), (diff - rtol * b.double().abs()).max()])
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


def main(session: WorkerSession) -> None:
    from megatron_rlhf.parallel.layout import Layout, parallel_groups

    env, results = session.env, session.results
    tp_group = parallel_groups(Layout.for_world(2, 1, env.world_size)).pg_collection.tp
    tp_size, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    local = PADDED // tp_size
    failures: list[str] = []

    for temperature, vocab_size, dtype in CASES:
        tag = f"T{temperature}/V{vocab_size}/{str(dtype).removeprefix('torch.')}"
        full, targets, weights = make_inputs(vocab_size, dtype)
        shard = full[..., tp_rank * local : (tp_rank + 1) * local]
        tp_logp, tp_ent, tp_grad_shard = run(shard, targets, weights, tp_group, vocab_size, temperature)
        gathered = [torch.empty_like(tp_grad_shard) for _ in range(tp_size)]
        dist.all_gather(gathered, tp_grad_shard.contiguous(), group=tp_group)
        tp_grad = torch.cat(gathered, dim=-1)

        checks = {}
        one_logp, one_ent, one_grad = run(full, targets, weights, None, vocab_size, temperature)
        checks["vs_tp1"] = (one_logp, one_ent, one_grad)
        if dtype == torch.float64:
            checks["vs_float64_ref"] = reference64(full, targets, weights, vocab_size, temperature)
        for name, (ref_logp, ref_ent, ref_grad) in checks.items():
            for quantity, ours, ref in (
                ("logprobs", tp_logp, ref_logp),
                ("entropy", tp_ent, ref_ent),
                ("grad", tp_grad, ref_grad),
            ):
                key = f"{tag}/{name}/{quantity}"
                abs_diff, excess = max_diffs(ours, ref, RTOL[dtype]).tolist()
                results[key] = abs_diff
                if not excess <= TOL[dtype]:
                    failures.append(f"{key}: max abs diff {abs_diff:.3e} > {TOL[dtype]:.0e} + {RTOL[dtype]:.0e} |ref|")
        padding_grad = tp_grad[..., vocab_size:]
        if padding_grad.numel() and padding_grad.abs().max() != 0:
            failures.append(f"{tag}: non-zero gradient on padding columns")
        if tp_logp.dtype != (torch.float64 if dtype == torch.float64 else torch.float32):
            failures.append(f"{tag}: output dtype {tp_logp.dtype}")
        if tp_grad_shard.dtype != dtype:
            failures.append(f"{tag}: grad dtype {tp_grad_shard.dtype}")

    if failures:
        raise AssertionError(f"rank {env.rank}: " + "; ".join(failures))


if __name__ == "__main__":
    with worker_session() as session:
        main(session)
