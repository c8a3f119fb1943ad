"""Token-budget micro-batching: order kept, budget respected, counts equalised across DP ranks."""

from __future__ import annotations

import pytest

from megatron_rlhf.training.microbatch import equalise_count, split_by_token_budget


def test_split_keeps_order_and_budget() -> None:
    lengths = [5, 9, 3, 3, 12, 4, 4, 4]
    groups = split_by_token_budget(lengths, max_tokens=16)
    assert [i for g in groups for i in g] == list(range(len(lengths)))
    for group in groups:
        padded = len(group) * max(lengths[i] for i in group)
        assert padded <= 16 or len(group) == 1
    # Hand-derived: [5,9]->18>16 so [0],[1]; [3,3]... 9+3: 2*9=18>16 -> new group at index 2.
    assert groups == [[0], [1], [2, 3], [4], [5, 6, 7]]


def test_sequence_longer_than_budget_gets_its_own_micro_batch() -> None:
    assert split_by_token_budget([40, 2, 2], max_tokens=8) == [[0], [1, 2]]


def test_equalise_splits_the_largest_groups() -> None:
    assert equalise_count([[0, 1, 2, 3], [4]], 3) == [[0, 1], [2, 3], [4]]
    assert equalise_count([[0], [1]], 2) == [[0], [1]]


def test_equalise_refuses_impossible_counts() -> None:
    with pytest.raises(ValueError, match="cannot form 3 micro-batches from 2 sequences"):
        equalise_count([[0], [1]], 3)


def test_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=0"):
        split_by_token_budget([1, 2], 0)
