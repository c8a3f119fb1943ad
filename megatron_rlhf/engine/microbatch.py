"""Micro-batches formed by a token budget (dynamic batching), the same count on every DP rank.

Sequences keep the order they are given in (engine/schedule.py gives them longest first):
micro-batch boundaries only group neighbours, so a change of budget changes how work is split,
never which tokens are computed or how the loss is normalised.
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


def plan_micro_batches(
    lengths: list[int], max_tokens: int, dp_group: dist.ProcessGroup | None, device: torch.device
) -> list[list[int]]:
    """Token-budget micro-batches, with the count agreed (maximum) across the data-parallel group.

    Every rank of a pipeline holds the same data, so the plan is identical along TP and PP.
    """
    groups = split_by_token_budget(lengths, max_tokens)
    count = torch.tensor([len(groups)], dtype=torch.int64, device=device)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
    return equalise_count(groups, int(count.item()))
