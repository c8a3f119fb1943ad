"""Which examples each data-parallel rank trains on, step by step: a pure function of its arguments.

Every rank computes the same permutation of the epoch from (seed, epoch) alone, with no
communication, and takes its own contiguous slice of each global batch. Because nothing depends
on what ran before, a resumed run rebuilds the epoch and starts at step k: ``batches[k:]``.
The permutation comes from ``torch.randperm`` on a CPU generator: resume under the same torch
version to get the same order.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["epoch_batches", "num_steps"]


def _positive(name: str, value: int, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def num_steps(num_examples: int, global_batch_size: int, drop_last: bool) -> int:
    """Optimizer steps in one epoch."""
    _positive("num_examples", num_examples)
    _positive("global_batch_size", global_batch_size)
    full, rest = divmod(num_examples, global_batch_size)
    return full + (1 if rest and not drop_last else 0)


def _epoch_seed(seed: int, epoch: int) -> int:
    # Hashing keeps (seed, epoch) pairs apart: seed + epoch would make (1, 0) and (0, 1) the same.
    digest = hashlib.sha256(f"megatron-rlhf/{seed}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def epoch_batches(
    num_examples: int,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    epoch: int,
    drop_last: bool,
    *,
    shuffle: bool = True,
) -> list[list[int]]:
    """This rank's example indices for every step of ``epoch``: ``result[step]`` is its share.

    Each step's global batch is the next ``global_batch_size`` indices of the epoch's permutation;
    rank r takes slice [r * m, (r + 1) * m) of it, m = global_batch_size / dp_size. With
    ``drop_last`` the incomplete tail is dropped; without it the last global batch is short and
    split as evenly as possible (shares differ by at most one; a rank may get none and must still
    enter the step's collectives). Either way no index appears twice in an epoch.
    """
    _positive("global_batch_size", global_batch_size)
    _positive("dp_size", dp_size)
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank!r}")
    if global_batch_size % dp_size:
        raise ValueError(f"global_batch_size={global_batch_size} is not divisible by dp_size={dp_size}")
    _positive("epoch", epoch, minimum=0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    steps = num_steps(num_examples, global_batch_size, drop_last)
    if steps == 0:
        raise ValueError(
            f"num_examples={num_examples} < global_batch_size={global_batch_size} with drop_last=True gives no step"
        )
    if shuffle:
        generator = torch.Generator().manual_seed(_epoch_seed(seed, epoch))
        order = torch.randperm(num_examples, generator=generator)
    else:
        order = torch.arange(num_examples)
    per_rank = global_batch_size // dp_size
    out: list[list[int]] = []
    for step in range(steps):
        start = step * global_batch_size
        size = min(global_batch_size, num_examples - start)
        if size == global_batch_size:
            lo, hi = dp_rank * per_rank, (dp_rank + 1) * per_rank
        else:  # the short last batch: the first (size % dp_size) ranks take one extra
            base, extra = divmod(size, dp_size)
            lo = dp_rank * base + min(dp_rank, extra)
            hi = lo + base + (1 if dp_rank < extra else 0)
        out.append(order[start + lo : start + hi].tolist())
    return out
