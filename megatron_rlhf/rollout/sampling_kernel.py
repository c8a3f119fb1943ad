"""One pass over the logits for the sampler's unfiltered cases: greedy, and temperature sampling
without top-k/top-p (GRPO's usual setting). A Triton kernel.

A decode step samples one token per slot from (slots, V) logits, V ~ 150k. In plain torch that is a
float32 copy, a softmax, a tensor of exponentials, a division, an argmax and a log-sum-exp: six
passes over (slots, V) float32 and a row-per-block reduction that leaves most of the GPU idle at
a few hundred rows. Here each row is cut into chunks, one program per (row, chunk) reads its
logits once and keeps, online: the running maximum and sum of exp(z - max) of z = logits / T (for
the log-sum-exp) and the best score with its token and z. A few small torch ops combine the chunks.

Drawing is the Gumbel-max form of the sampler's exponential race (``rollout/sampling.py``): the
token maximising z_v - log(E_v), E_v = -log(U_v) ~ Exp(1), is drawn with probability softmax(z)_v.
U comes from Philox in the kernel (``tl.rand``) keyed by one seed drawn from the caller's generator
plus the row, at offset = the token's column: reproducible for a generator state, and nothing of
size (slots, V) is written. Greedy scores z itself; ties go to the lowest index, as torch's argmax.
The log-prob is z_token - logsumexp(z) over the whole vocabulary in float32, z = logits * (1 / T)
as the trainer scales them (``engine/logprobs.py``).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch without its Triton: the sampler's torch path
    triton = None

CHUNKS = 16
"""Programs per row: enough (row, chunk) programs to fill the GPU at a few hundred rows."""
BLOCK = 2048
"""Columns per loop iteration of a program."""


def available(logits: torch.Tensor) -> bool:
    return triton is not None and logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1


def sample_unfiltered(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B,) int64, logprobs (B,) float32) for logits (B, V): greedy when ``temperature`` is
    0, else drawn from softmax(logits / T) over the whole vocabulary."""
    rows, vocab = logits.shape
    greedy = temperature == 0
    chunk = triton.cdiv(vocab, CHUNKS)
    chunks = triton.cdiv(vocab, chunk)
    partial = torch.empty(4, rows, chunks, dtype=torch.float32, device=logits.device)  # max, sum, best score, its z
    best_index = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    # One seed per call from the caller's generator (no host sync); greedy consumes none.
    seed = torch.zeros(1, dtype=torch.int64, device=logits.device)
    if not greedy:
        seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=logits.device, generator=generator)
    _sample_chunks_kernel[(rows, chunks)](
        logits, logits.stride(0), vocab, chunk, seed, 1.0 if greedy else 1.0 / temperature,
        partial, partial.stride(0), best_index, GREEDY=greedy, BLOCK=BLOCK,
    )  # fmt: skip
    maxes, sums, scores, best_z = partial
    top = maxes.amax(dim=1, keepdim=True)
    log_sum_exp = top[:, 0] + torch.log((sums * torch.exp(maxes - top)).sum(dim=1))
    winner = scores.argmax(dim=1, keepdim=True)  # the first (lowest-column) chunk on ties
    tokens = best_index.gather(1, winner)[:, 0].long()
    return tokens, best_z.gather(1, winner)[:, 0] - log_sum_exp


if triton is not None:

    @triton.jit
    def _sample_chunks_kernel(
        logits_ptr, row_stride, vocab, chunk, seed_ptr, inv_temperature, partial_ptr, partial_stride, index_ptr,
        GREEDY: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        part = tl.program_id(1)
        chunks = tl.num_programs(1)
        start = part * chunk
        end = tl.minimum(start + chunk, vocab)
        seed = tl.load(seed_ptr) + row
        running_max = -float("inf")
        running_sum = 0.0
        best_score = -float("inf")
        best_z = -float("inf")
        best_index = start
        for offset in range(start, end, BLOCK):
            columns = offset + tl.arange(0, BLOCK)
            inside = columns < end
            z = tl.load(logits_ptr + row * row_stride + columns, mask=inside, other=-float("inf")).to(tl.float32)
            z = z * inv_temperature
            new_max = tl.maximum(running_max, tl.max(z, 0))
            shift = tl.where(new_max == -float("inf"), 0.0, new_max)  # a chunk of -inf logits so far sums to 0, not NaN
            running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(z - shift), 0)
            running_max = new_max
            if GREEDY:
                score = z
            else:
                uniform = tl.rand(seed, columns)
                score = tl.where(inside, z - tl.log(-tl.log(uniform)), -float("inf"))
            block_best = tl.max(score, 0)
            block_index = tl.argmax(score, 0, tie_break_left=True)
            if block_best > best_score:  # strict: an earlier block keeps a tie
                best_score = block_best
                best_index = offset + block_index
                best_z = tl.max(tl.where(tl.arange(0, BLOCK) == block_index, z, -float("inf")), 0)
        out = row * chunks + part
        tl.store(partial_ptr + out, running_max)
        tl.store(partial_ptr + partial_stride + out, running_sum)
        tl.store(partial_ptr + 2 * partial_stride + out, best_score)
        tl.store(partial_ptr + 3 * partial_stride + out, best_z)
        tl.store(index_ptr + out, best_index)
