"""One pass over the logits for the sampler's unfiltered cases: greedy, and temperature sampling
without top-k/top-p (GRPO's usual setting). Two Triton kernels.

A decode step samples one token per slot from (slots, V) logits, V ~ 150k. In plain torch that is a
float32 copy, a softmax, a tensor of exponentials, a division, an argmax and a log-sum-exp: six
passes over (slots, V) float32 and a row-per-block reduction that leaves most of the GPU idle at
a few hundred rows. Here each row is cut into chunks, and one program per (row, chunk) reads its
logits once and keeps, online, the running maximum and sum of exp(z - max) of z = logits / T (the
log-sum-exp's parts), and for greedy the first maximal column. A few small torch ops combine them.

Drawing inverts the CDF: one uniform u per row from the caller's generator, the chunk whose
cumulative mass first exceeds u times the total, then a second kernel scans that chunk alone (a
sixteenth of the row) for the first column whose running mass does. Every token is drawn with
probability softmax(z)_v up to float32 rounding of the partial sums, as ``torch.multinomial``;
per-element random numbers (a Gumbel-max race, as before) cost three times the memory pass in
Philox rounds and logarithms at 256 rows (``docs/benchmarks.md``, twelfth session). The log-prob is
z_token - logsumexp(z) over the whole vocabulary in float32, z = logits * (1 / T) as the trainer
scales them (``engine/logprobs.py``).
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
    0, else drawn from softmax(logits / T) over the whole vocabulary. No host synchronisation."""
    rows, vocab = logits.shape
    greedy = temperature == 0
    inv_temperature = 1.0 if greedy else 1.0 / temperature
    chunk = triton.cdiv(vocab, CHUNKS)
    chunks = triton.cdiv(vocab, chunk)
    stats = torch.empty(2, rows, chunks, dtype=torch.float32, device=logits.device)  # max, sum of exp(z - max)
    best_index = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    _chunk_stats_kernel[(rows, chunks)](logits, logits.stride(0), vocab, chunk, inv_temperature, stats, stats.stride(0),
                                        best_index, GREEDY=greedy, BLOCK=BLOCK)  # fmt: skip
    maxes, sums = stats
    top = maxes.amax(dim=1, keepdim=True)  # the row's max of z
    mass = sums * torch.exp(maxes - top)  # each chunk's sum of exp(z - top)
    log_sum_exp = top[:, 0] + torch.log(mass.sum(dim=1))
    if greedy:
        winner = maxes.argmax(dim=1, keepdim=True)  # the first (lowest-column) chunk on ties
        return best_index.gather(1, winner)[:, 0].long(), top[:, 0] - log_sum_exp
    cumulative = mass.cumsum(dim=1)
    uniform = torch.rand(rows, 1, device=logits.device, generator=generator)
    target = uniform * cumulative[:, -1:]
    # The first chunk whose cumulative mass exceeds the target, never one without mass (the target
    # can round up to the total).
    last_with_mass = chunks - 1 - (mass > 0).flip(1).int().argmax(dim=1, keepdim=True)
    chosen = torch.minimum((cumulative <= target).sum(dim=1, keepdim=True), last_with_mass)
    remainder = target - (cumulative.gather(1, chosen) - mass.gather(1, chosen))
    tokens = torch.empty(rows, dtype=torch.int32, device=logits.device)
    _pick_in_chunk_kernel[(rows,)](logits, logits.stride(0), vocab, chunk, inv_temperature, chosen, top, remainder,
                                   tokens, BLOCK=BLOCK)  # fmt: skip
    tokens = tokens.long()
    z = logits.gather(1, tokens[:, None])[:, 0].float() * inv_temperature
    return tokens, z - log_sum_exp


if triton is not None:

    @triton.jit
    def _chunk_stats_kernel(
        logits_ptr, row_stride, vocab, chunk, inv_temperature, stats_ptr, stats_stride, index_ptr,
        GREEDY: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        part = tl.program_id(1)
        chunks = tl.num_programs(1)
        start = part * chunk
        end = tl.minimum(start + chunk, vocab)
        running_max = -float("inf")
        running_sum = 0.0
        best_index = start
        for offset in range(start, end, BLOCK):
            columns = offset + tl.arange(0, BLOCK)
            z = tl.load(logits_ptr + row * row_stride + columns, mask=columns < end, other=-float("inf")).to(tl.float32)
            z = z * inv_temperature
            block_max = tl.max(z, 0)
            if GREEDY:
                if block_max > running_max:  # strict: an earlier block keeps a tie
                    best_index = offset + tl.argmax(z, 0, tie_break_left=True)
            new_max = tl.maximum(running_max, block_max)
            shift = tl.where(new_max == -float("inf"), 0.0, new_max)  # a chunk of -inf logits so far sums to 0, not NaN
            running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(z - shift), 0)
            running_max = new_max
        out = row * chunks + part
        tl.store(stats_ptr + out, running_max)
        tl.store(stats_ptr + stats_stride + out, running_sum)
        if GREEDY:
            tl.store(index_ptr + out, best_index)

    @triton.jit
    def _pick_in_chunk_kernel(
        logits_ptr, row_stride, vocab, chunk, inv_temperature, chosen_ptr, top_ptr, remainder_ptr, token_ptr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        # The first column of the row's chosen chunk at which the running sum of exp(z - top) exceeds
        # the remainder; the chunk's last column with mass if rounding leaves it unreached.
        row = tl.program_id(0)
        start = tl.load(chosen_ptr + row).to(tl.int32) * chunk
        end = tl.minimum(start + chunk, vocab)
        top = tl.load(top_ptr + row)
        remainder = tl.load(remainder_ptr + row)
        running = 0.0
        picked = vocab  # none yet
        last_with_mass = start
        for offset in range(start, end, BLOCK):
            columns = offset + tl.arange(0, BLOCK)
            inside = columns < end
            z = tl.load(logits_ptr + row * row_stride + columns, mask=inside, other=-float("inf")).to(tl.float32)
            p = tl.where(inside, tl.exp(z * inv_temperature - top), 0.0)
            crossed = (running + tl.cumsum(p, 0) > remainder) & (p > 0)
            picked = tl.minimum(picked, tl.min(tl.where(crossed, columns, vocab), 0))
            last_with_mass = tl.maximum(last_with_mass, tl.max(tl.where(p > 0, columns, start), 0))
            running += tl.sum(p, 0)
        tl.store(token_ptr + row, tl.where(picked < vocab, picked, last_with_mass))
