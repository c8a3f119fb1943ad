"""One pass over the logits for the sampler's unfiltered cases: greedy, and temperature sampling
without top-k/top-p (GRPO's usual setting). Two Triton kernels.

A decode step samples one token per slot from (slots, V) logits, V ~ 150k. In plain torch that is a
float32 copy, a softmax, a tensor of exponentials, a division, an argmax and a log-sum-exp: six
passes over (slots, V) float32 and a row-per-block reduction that leaves most of the GPU idle at
a few hundred rows. Here each row is cut into chunks, and one program per (row, chunk) reads its
logits once and keeps, online, the running maximum and sum of exp(z - max) of z = logits / T (the
log-sum-exp's parts), and for greedy the first maximal column. A second kernel, one program per
row, combines them.

Drawing inverts the CDF: one uniform u per row from the caller's generator, the chunk whose
cumulative mass first exceeds u times the total, then the second kernel scans that chunk alone (a
sixteenth of the row) for the first column whose running mass does. Every token is drawn with
probability softmax(z)_v up to float32 rounding of the partial sums, as ``torch.multinomial``;
per-element random numbers (a Gumbel-max race) cost a Philox draw and two logarithms per logit, far
more than the memory pass (``docs/benchmarks.md``, "Kernels"). The log-prob is
z_token - logsumexp(z) over the whole vocabulary in float32, z = logits * (1 / T) as the trainer
scales them (``training/logprobs.py``).

Top-k / top-p (``sample_filtered``) draw without sorting the row: a full sort of (slots, V) took 4.6
ms a step at 256 slots against 0.12 ms for the unfiltered draw (docs/benchmarks.md, "Kernels"). One
program per row draws a candidate from the kept mass above a pivot (inverse CDF, as above) and keeps
it if the probability of the tokens ranked above it is < top_p, i.e. if it lies in the nucleus;
otherwise no token at or below the candidate can lie there, so the candidate's value becomes the
pivot and the draw repeats over what is left. Conditioned on acceptance, a draw from the mass above
the pivot is a draw from the nucleus, so tokens follow the renormalised filtered softmax exactly
(up to float32 rounding of the sums), as FlashInfer's rejection samplers do. Each round costs two
passes over the row, and the mass left after a rejection is the one the test just summed.
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
FILTERED_WARPS = 8
"""Warps of a filtered draw's program: one program walks its whole row several times."""
FILTERED_ROUNDS = 64
"""Draws a filtered row may take before it falls back to its first maximal column (which is always
kept). Each rejection leaves at most the mass it tested, and that mass is at least top_p: a real row
is accepted within a few rounds; the bound is for rows of NaN or all -inf logits, which would
otherwise never accept a candidate and hold the GPU for good."""


def available(logits: torch.Tensor) -> bool:
    return triton is not None and logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1


def sample_unfiltered(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B,) int64, logprobs (B,) float32) for logits (B, V): greedy when ``temperature`` is
    0, else drawn from softmax(logits / T) over the whole vocabulary. No host synchronisation:
    three launches (the chunk statistics, the uniforms, the pick), where combining the statistics in
    torch takes about 25 small kernels per decode step."""
    rows, vocab = logits.shape
    greedy = temperature == 0
    inv_temperature = 1.0 if greedy else 1.0 / temperature
    chunk = triton.cdiv(vocab, CHUNKS)
    chunks = triton.cdiv(vocab, chunk)
    stats = torch.empty(2, rows, chunks, dtype=torch.float32, device=logits.device)  # max, sum of exp(z - max)
    best_index = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    _chunk_stats_kernel[(rows, chunks)](
        logits,
        logits.stride(0),
        vocab,
        chunk,
        inv_temperature,
        stats,
        stats.stride(0),
        best_index,
        GREEDY=greedy,
        BLOCK=BLOCK,
    )
    uniform = (
        logits.new_empty(0, dtype=torch.float32)
        if greedy
        else torch.rand(rows, device=logits.device, generator=generator)
    )
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _pick_kernel[(rows,)](
        logits,
        logits.stride(0),
        vocab,
        chunk,
        chunks,
        inv_temperature,
        stats,
        stats.stride(0),
        best_index,
        uniform,
        tokens,
        logprobs,
        GREEDY=greedy,
        CHUNKS=CHUNKS,
        BLOCK=BLOCK,
    )
    return tokens, logprobs


def sample_filtered(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B,) int64, logprobs (B,) float32) drawn from softmax(logits / T) filtered as
    ``sampling.apply_top_k_top_p`` filters (top-k keeps every z >= the k-th largest; top-p the
    nucleus, ties with its last token kept; ``top_k`` 0 and ``top_p`` 1 are off), T > 0. The
    log-prob is over the whole vocabulary, before filtering. No host synchronisation: the seed of
    the in-kernel random numbers is drawn from ``generator`` on the device."""
    rows, vocab = logits.shape
    inv_temperature = 1.0 / temperature
    if 0 < top_k < vocab:  # the k-th largest z: torch's top-k of k values, no full sort
        z = logits.float() * inv_temperature  # as the kernel scales, for identical rounding
        lowest_kept = torch.topk(z, top_k, dim=-1, sorted=False).values.amin(dim=-1)
    else:
        lowest_kept = torch.full((rows,), -float("inf"), device=logits.device)
    seed = torch.randint(0, 2**31 - 1, (1,), device=logits.device, generator=generator)
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _filtered_kernel[(rows,)](
        logits,
        logits.stride(0),
        vocab,
        inv_temperature,
        lowest_kept,
        top_p,
        seed,
        tokens,
        logprobs,
        BLOCK=BLOCK,
        ROUNDS=FILTERED_ROUNDS,
        num_warps=FILTERED_WARPS,
    )
    return tokens, logprobs


if triton is not None:

    @triton.jit
    def _filtered_kernel(
        logits_ptr: tl.tensor,
        row_stride: tl.tensor,
        vocab: tl.tensor,
        inv_temperature: tl.tensor,
        lowest_kept_ptr: tl.tensor,
        top_p: tl.tensor,
        seed_ptr: tl.tensor,
        token_ptr: tl.tensor,
        logprob_ptr: tl.tensor,
        BLOCK: tl.constexpr,
        ROUNDS: tl.constexpr,
    ) -> None:
        # Pass 1: the row's maximum `top` and sum of exp(z - top) over the whole vocabulary (the
        # log-prob's) and over top-k's kept tokens (z >= lowest). Then rounds: the candidate is the
        # first column at which the running mass of the allowed tokens (z >= lowest, or z > pivot
        # after a rejection) exceeds u times their mass (the last allowed column if rounding leaves
        # it unreached); the mass strictly above it decides. After FILTERED_ROUNDS rejections the
        # row's first maximal column is taken.
        row = tl.program_id(0)
        base = logits_ptr + row * row_stride
        lowest = tl.load(lowest_kept_ptr + row)
        seed = tl.load(seed_ptr)
        top = -float("inf")
        total = 0.0
        kept = 0.0
        best = 0
        for offset in range(0, vocab, BLOCK):
            columns = offset + tl.arange(0, BLOCK)
            z = tl.load(base + columns, mask=columns < vocab, other=-float("inf")).to(tl.float32) * inv_temperature
            block_max = tl.max(z, 0)
            if block_max > top:  # strict: an earlier block keeps a tie
                best = offset + tl.argmax(z, 0, tie_break_left=True)
            new_top = tl.maximum(top, block_max)
            shift = tl.where(new_top == -float("inf"), 0.0, new_top)  # -inf logits so far sum to 0, not NaN
            rescale = tl.exp(top - shift)
            e = tl.exp(z - shift)
            total = total * rescale + tl.sum(e, 0)
            kept = kept * rescale + tl.sum(tl.where(z >= lowest, e, 0.0), 0)
            top = new_top
        pivot = lowest
        inclusive = 1  # allowed: z >= pivot; after a rejection z > pivot
        mass = kept
        token = tl.full((), -1, tl.int32)
        attempt = 0
        while (token < 0) & (attempt < ROUNDS):
            target = tl.rand(seed, attempt * tl.num_programs(0) + row) * mass
            running = 0.0
            picked = vocab
            last = 0
            for offset in range(0, vocab, BLOCK):
                columns = offset + tl.arange(0, BLOCK)
                z = tl.load(base + columns, mask=columns < vocab, other=-float("inf")).to(tl.float32) * inv_temperature
                allowed = (z > pivot) | ((inclusive == 1) & (z == pivot))
                p = tl.where(allowed, tl.exp(z - top), 0.0)
                crossed = (running + tl.cumsum(p, 0) > target) & (p > 0)
                picked = tl.minimum(picked, tl.min(tl.where(crossed, columns, vocab), 0))
                last = tl.maximum(last, tl.max(tl.where(p > 0, columns, 0), 0))
                running += tl.sum(p, 0)
            candidate = tl.where(picked < vocab, picked, last)
            z_candidate = tl.load(base + candidate).to(tl.float32) * inv_temperature
            above = 0.0
            for offset in range(0, vocab, BLOCK):
                columns = offset + tl.arange(0, BLOCK)
                z = tl.load(base + columns, mask=columns < vocab, other=-float("inf")).to(tl.float32) * inv_temperature
                above += tl.sum(tl.where(z > z_candidate, tl.exp(z - top), 0.0), 0)
            if above < top_p * kept:
                token = candidate
            else:
                pivot = z_candidate
                inclusive = 0
                mass = above
            attempt += 1
        token = tl.where(token < 0, best, token)
        z_token = tl.load(base + token).to(tl.float32) * inv_temperature
        tl.store(token_ptr + row, token.to(tl.int64))
        tl.store(logprob_ptr + row, z_token - top - tl.log(total))

    @triton.jit
    def _chunk_stats_kernel(
        logits_ptr: tl.tensor,
        row_stride: tl.tensor,
        vocab: tl.tensor,
        chunk: tl.tensor,
        inv_temperature: tl.tensor,
        stats_ptr: tl.tensor,
        stats_stride: tl.tensor,
        index_ptr: tl.tensor,
        GREEDY: tl.constexpr,
        BLOCK: tl.constexpr,
    ) -> None:
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
            if GREEDY and block_max > running_max:  # strict: an earlier block keeps a tie
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
    def _pick_kernel(
        logits_ptr: tl.tensor,
        row_stride: tl.tensor,
        vocab: tl.tensor,
        chunk: tl.tensor,
        chunks: tl.tensor,
        inv_temperature: tl.tensor,
        stats_ptr: tl.tensor,
        stats_stride: tl.tensor,
        index_ptr: tl.tensor,
        uniform_ptr: tl.tensor,
        token_ptr: tl.tensor,
        logprob_ptr: tl.tensor,
        GREEDY: tl.constexpr,
        CHUNKS: tl.constexpr,
        BLOCK: tl.constexpr,
    ) -> None:
        # The row's log-sum-exp from its chunks' statistics; greedy: the first maximal column of the
        # first chunk holding the maximum. Else the chunk whose cumulative mass first exceeds
        # u * total (never one without mass: the target can round up to the total), then the first
        # column of it at which the running sum of exp(z - top) exceeds what is left of the target
        # (the chunk's last column with mass if rounding leaves it unreached).
        row = tl.program_id(0)
        parts = tl.arange(0, CHUNKS)
        real = parts < chunks
        maxes = tl.load(stats_ptr + row * chunks + parts, mask=real, other=-float("inf"))
        sums = tl.load(stats_ptr + stats_stride + row * chunks + parts, mask=real, other=0.0)
        top = tl.max(maxes, 0)
        mass = tl.where(real, sums * tl.exp(maxes - top), 0.0)  # each chunk's sum of exp(z - top)
        total = tl.sum(mass, 0)
        log_sum_exp = top + tl.log(total)
        if GREEDY:
            winner = tl.argmax(maxes, 0, tie_break_left=True)
            token = tl.load(index_ptr + row * chunks + winner)
            tl.store(token_ptr + row, token.to(tl.int64))
            tl.store(logprob_ptr + row, top - log_sum_exp)
        else:
            cumulative = tl.cumsum(mass, 0)
            target = tl.load(uniform_ptr + row) * total
            last_with_mass = tl.max(tl.where(mass > 0, parts, -1), 0)
            last_with_mass = tl.where(last_with_mass < 0, chunks - 1, last_with_mass)
            chosen = tl.minimum(tl.sum((real & (cumulative <= target)).to(tl.int32), 0), last_with_mass)
            remainder = target - tl.sum(tl.where(parts == chosen, cumulative - mass, 0.0), 0)
            start = chosen * chunk
            end = tl.minimum(start + chunk, vocab)
            running = 0.0
            picked = vocab  # none yet
            last_column = start
            for offset in range(start, end, BLOCK):
                columns = offset + tl.arange(0, BLOCK)
                inside = columns < end
                z = tl.load(logits_ptr + row * row_stride + columns, mask=inside, other=-float("inf")).to(tl.float32)
                p = tl.where(inside, tl.exp(z * inv_temperature - top), 0.0)
                crossed = (running + tl.cumsum(p, 0) > remainder) & (p > 0)
                picked = tl.minimum(picked, tl.min(tl.where(crossed, columns, vocab), 0))
                last_column = tl.maximum(last_column, tl.max(tl.where(p > 0, columns, start), 0))
                running += tl.sum(p, 0)
            token = tl.where(picked < vocab, picked, last_column)
            z_token = tl.load(logits_ptr + row * row_stride + token).to(tl.float32) * inv_temperature
            tl.store(token_ptr + row, token.to(tl.int64))
            tl.store(logprob_ptr + row, z_token - log_sum_exp)
