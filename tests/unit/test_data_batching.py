"""pack_batch shapes and padding; epoch_batches coverage, determinism and resume."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.data import PreferenceExample, PromptExample, SFTExample, epoch_batches, num_steps, pack_batch

PAD = 9


def sft(ids: list[int], prompt_len: int) -> SFTExample:
    return SFTExample(ids, [0] * prompt_len + [1] * (len(ids) - prompt_len))


# --------------------------------------------------------------------------- pack_batch


def test_pack_sft_right_pads():
    batch = pack_batch([sft([1, 2, 3], 1), sft([4, 5, 6, 7, 8], 3)], pad_id=PAD)
    assert set(batch) == {"input_ids", "loss_mask", "attention_mask", "lengths"}
    assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape == (2, 5)
    assert batch["input_ids"].tolist() == [[1, 2, 3, PAD, PAD], [4, 5, 6, 7, 8]]
    assert batch["loss_mask"].dtype == torch.bool
    assert batch["loss_mask"].int().tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 1, 1]]
    assert batch["attention_mask"].int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["lengths"].tolist() == [3, 5]


def test_pack_pad_to_multiple():
    batch = pack_batch([sft([1, 2, 3, 4, 5], 1)], pad_id=0, pad_to_multiple_of=4)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]]
    assert batch["attention_mask"].sum().item() == 5 and batch["loss_mask"].sum().item() == 4
    assert pack_batch([sft([1, 2, 3, 4], 1)], pad_id=0, pad_to_multiple_of=4)["input_ids"].shape == (1, 4)


def test_pack_preference_stacks_chosen_then_rejected():
    pairs = [
        PreferenceExample(chosen=sft([1, 2, 3], 1), rejected=sft([1, 4], 1)),
        PreferenceExample(chosen=sft([5, 6], 1), rejected=sft([5, 7, 7, 7], 1)),
    ]
    batch = pack_batch(pairs, pad_id=PAD)
    assert batch["input_ids"].shape == batch["loss_mask"].shape == batch["attention_mask"].shape == (4, 4)
    assert batch["input_ids"].tolist() == [[1, 2, 3, PAD], [5, 6, PAD, PAD], [1, 4, PAD, PAD], [5, 7, 7, 7]]
    assert batch["lengths"].tolist() == [3, 2, 2, 4]
    assert batch["pair_index"].tolist() == [0, 1, 0, 1]
    assert batch["is_chosen"].tolist() == [True, True, False, False]
    assert batch["loss_mask"][2].int().tolist() == [0, 1, 0, 0]
    # Row i and row B + i are the two sides of pair i.
    for i, pair in enumerate(pairs):
        rows = (batch["pair_index"] == i).nonzero().flatten().tolist()
        chosen_row = next(r for r in rows if batch["is_chosen"][r])
        rejected_row = next(r for r in rows if not batch["is_chosen"][r])
        assert batch["input_ids"][chosen_row, : len(pair.chosen)].tolist() == pair.chosen.input_ids.tolist()
        assert batch["input_ids"][rejected_row, : len(pair.rejected)].tolist() == pair.rejected.input_ids.tolist()


def test_pack_prompts():
    batch = pack_batch([PromptExample([1, 2]), PromptExample([3])], pad_id=0)
    assert set(batch) == {"input_ids", "attention_mask", "lengths"}
    assert batch["input_ids"].tolist() == [[1, 2], [3, 0]]


def test_pack_errors():
    with pytest.raises(ValueError, match="at least one example"):
        pack_batch([], pad_id=0)
    with pytest.raises(ValueError, match="pad_id must be a non-negative int, got -1"):
        pack_batch([sft([1], 0)], pad_id=-1)
    with pytest.raises(ValueError, match="pad_to_multiple_of must be a positive int, got 0"):
        pack_batch([sft([1], 0)], pad_id=0, pad_to_multiple_of=0)
    with pytest.raises(TypeError, match=r"mixed examples: \[0\] is SFTExample, \[1\] is PromptExample"):
        pack_batch([sft([1], 0), PromptExample([1])], pad_id=0)
    with pytest.raises(TypeError, match="got list"):
        pack_batch([[1, 2]], pad_id=0)


def test_pack_from_loaded_dataset(tmp_path):
    import json

    from megatron_rlhf.data import ByteTokenizer, load_sft_dataset

    f = tmp_path / "a.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": p, "response": r}) for p, r in [("ab", "c"), ("d", "efgh")]))
    tok = ByteTokenizer(260)
    ds, _ = load_sft_dataset(f, tok, max_length=16)
    batch = pack_batch([ds[0], ds[1]], tok.pad_id)
    assert batch["input_ids"].shape == (2, 6)
    assert batch["input_ids"][0].tolist() == [ord("a") + 3, ord("b") + 3, ord("c") + 3, 2, 0, 0]
    assert batch["loss_mask"].int().tolist() == [[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]]


# --------------------------------------------------------------------------- epoch_batches


def all_ranks(n, gbs, dp, seed, epoch, drop_last, **kw):
    return [epoch_batches(n, gbs, r, dp, seed, epoch, drop_last, **kw) for r in range(dp)]


@pytest.mark.parametrize("n,gbs,dp", [(64, 8, 4), (67, 8, 4), (10, 6, 3), (5, 8, 4), (7, 4, 1)])
def test_each_index_once_per_epoch(n, gbs, dp):
    ranks = all_ranks(n, gbs, dp, seed=3, epoch=0, drop_last=False)
    steps = num_steps(n, gbs, drop_last=False)
    assert all(len(r) == steps for r in ranks)
    seen = sorted(i for r in ranks for step in r for i in step)
    assert seen == list(range(n))
    for step in range(steps):
        sizes = [len(r[step]) for r in ranks]
        full = step < n // gbs
        assert sizes == [gbs // dp] * dp if full else max(sizes) - min(sizes) <= 1
        assert sum(sizes) == (gbs if full else n - step * gbs)


def test_drop_last_drops_only_the_tail():
    ranks = all_ranks(67, 8, 4, seed=0, epoch=0, drop_last=True)
    assert num_steps(67, 8, drop_last=True) == 8 == len(ranks[0])
    seen = [i for r in ranks for step in r for i in step]
    assert len(seen) == len(set(seen)) == 64
    assert all(len(step) == 2 for r in ranks for step in r)


def test_deterministic_per_seed_and_epoch():
    a = all_ranks(100, 10, 2, seed=7, epoch=3, drop_last=True)
    assert a == all_ranks(100, 10, 2, seed=7, epoch=3, drop_last=True)
    assert a != all_ranks(100, 10, 2, seed=7, epoch=4, drop_last=True)
    assert a != all_ranks(100, 10, 2, seed=8, epoch=3, drop_last=True)
    # (seed, epoch) pairs do not alias the way seed + epoch would.
    one_zero = all_ranks(100, 10, 2, seed=1, epoch=0, drop_last=True)
    assert one_zero != all_ranks(100, 10, 2, seed=0, epoch=1, drop_last=True)
    flat = [i for step in a[0] for i in step]
    assert flat != sorted(flat)  # actually shuffled


def test_global_batch_independent_of_dp_size():
    """The examples of step k do not depend on how many ranks share them (same run, new layout)."""
    by_dp = {dp: all_ranks(48, 12, dp, seed=5, epoch=1, drop_last=True) for dp in (1, 2, 3, 4)}
    for step in range(4):
        ref = by_dp[1][0][step]
        for ranks in by_dp.values():
            assert [i for r in ranks for i in r[step]] == ref


def test_resume_at_step_k_matches_uninterrupted_run():
    full = epoch_batches(50, 10, 1, 2, 11, 2, True)
    resumed = epoch_batches(50, 10, 1, 2, 11, 2, True)[3:]
    assert resumed == full[3:] and len(full) == 5


def test_no_shuffle_is_in_order():
    assert epoch_batches(6, 4, 1, 2, 0, 0, False, shuffle=False) == [[2, 3], [5]]
    assert epoch_batches(6, 4, 0, 2, 0, 0, False, shuffle=False) == [[0, 1], [4]]


def test_sampler_errors():
    with pytest.raises(ValueError, match="global_batch_size=10 is not divisible by dp_size=4"):
        epoch_batches(100, 10, 0, 4, 0, 0, True)
    with pytest.raises(ValueError, match=r"dp_rank must be in \[0, 4\), got 4"):
        epoch_batches(100, 8, 4, 4, 0, 0, True)
    with pytest.raises(ValueError, match="num_examples=5 < global_batch_size=8 with drop_last=True gives no step"):
        epoch_batches(5, 8, 0, 4, 0, 0, True)
    with pytest.raises(ValueError, match="num_examples must be an int >= 1, got 0"):
        epoch_batches(0, 8, 0, 4, 0, 0, False)
    with pytest.raises(ValueError, match="epoch must be an int >= 0, got -1"):
        epoch_batches(10, 2, 0, 1, 0, -1, False)
