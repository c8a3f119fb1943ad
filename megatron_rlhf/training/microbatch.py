"""Micro-batches formed by a token budget (dynamic batching), the same count on every DP rank.

Sequences keep the order they are given in (training/schedule.py gives them longest first):
micro-batch boundaries only group neighbours, so a change of budget changes how work is split,
never which tokens are computed or how the loss is normalised.

Packing (``pack_rows``) first puts several sequences into one row (a bin) of a micro-batch, so
that short sequences fill the room a long one leaves instead of padding; the bins are then cut by
the same budget.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def split_by_token_budget(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group consecutive sequence indices so that (count x longest) stays within ``max_tokens``.

    The cost of a micro-batch is its padded size: rows are padded to the longest one. A single
    sequence longer than the budget gets a micro-batch of its own.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch={max_tokens} must be >= 1")
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index, length in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, length) > max_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, length)
    if current:
        groups.append(current)
    return groups


def equalise_count(groups: list[list[int]], target: int) -> list[list[int]]:
    """Split the largest groups until there are ``target`` of them (order preserved)."""
    groups = [list(g) for g in groups]
    while len(groups) < target:
        largest = max(range(len(groups)), key=lambda i: len(groups[i]))
        group = groups[largest]
        if len(group) < 2:
            raise ValueError(f"cannot form {target} micro-batches from {sum(map(len, groups))} sequences")
        half = len(group) // 2
        groups[largest : largest + 1] = [group[:half], group[half:]]
    return groups


def agreed_count(count: int, dp_group: dist.ProcessGroup | None, device: torch.device) -> int:
    """The largest of the data-parallel ranks' micro-batch counts: every rank must run as many
    micro-batches, or the gradient all-reduce of the last one would wait forever.

    Every rank of a pipeline holds the same data, so the count is identical along TP and PP.
    """
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        return count  # (no device round trip: it would wait for the GPU's queued work)
    total = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.MAX, group=dp_group)
    return int(total.item())


def plan_micro_batches(
    lengths: list[int], max_tokens: int, dp_group: dist.ProcessGroup | None, device: torch.device
) -> list[list[int]]:
    """Token-budget micro-batches, with the count agreed (maximum) across the data-parallel group."""
    groups = split_by_token_budget(lengths, max_tokens)
    return equalise_count(groups, agreed_count(len(groups), dp_group, device))


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sequence indices in bins of at most ``capacity`` tokens: longest first, each into the first
    bin with room (a new bin when none has). A sequence is never split, so ``capacity`` must be at
    least the longest; ties keep their order."""
    if lengths and max(lengths) > capacity:
        raise ValueError(f"a sequence of {max(lengths)} tokens does not fit a bin of {capacity}")
    bins: list[list[int]] = []
    room: list[int] = []
    # Bins that may still take a sequence, in creation order: one with less room than the shortest
    # sequence never will, so the search skips it (all full at once when every sequence is as long
    # as a bin: a scan over every bin per sequence cost ms per pass at 256 sequences).
    open_bins: list[int] = []
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    shortest = lengths[order[-1]] if order else 0
    for index in order:
        target = next((b for b in open_bins if room[b] >= lengths[index]), None)
        if target is None:
            target = len(bins)
            bins.append([])
            room.append(capacity)
            open_bins.append(target)
        bins[target].append(index)
        room[target] -= lengths[index]
        if room[target] < shortest:
            open_bins.remove(target)
    return bins


def pack_rows(
    lengths: list[int], max_tokens: int, dp_group: dist.ProcessGroup | None, device: torch.device
) -> list[list[list[int]]]:
    """Micro-batches of bins of sequence indices: first-fit-decreasing into bins as long as the
    longest sequence, fullest bins first, then cut so that (bins x fullest bin) stays within
    ``max_tokens``; the count agreed across the data-parallel group as ``plan_micro_batches`` does.

    A rank whose sequences fill fewer bins than the agreed count splits its largest bins (fewer
    sequences share a row there) until every micro-batch has one.
    """
    bins = first_fit_decreasing(lengths, max(lengths, default=0))

    def fullest_first(bins: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        fills = [sum(lengths[i] for i in b) for b in bins]
        order = sorted(range(len(bins)), key=lambda b: -fills[b])
        return [bins[b] for b in order], [fills[b] for b in order]

    bins, fills = fullest_first(bins)
    count = agreed_count(len(split_by_token_budget(fills, max_tokens)), dp_group, device)
    bins, fills = fullest_first(equalise_count(bins, count))
    groups = equalise_count(split_by_token_budget(fills, max_tokens), count)
    return [[bins[b] for b in group] for group in groups]
