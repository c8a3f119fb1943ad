"""Packed micro-batches: the plan (first-fit-decreasing bins, budget, DP count), the packed layout,
and forward passes and training steps that equal the unpacked ones."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role
from megatron_rlhf.models.attention import packed_rows_mask
from megatron_rlhf.parallel.layout import Layout, parallel_groups
from megatron_rlhf.training import microbatch
from megatron_rlhf.training.microbatch import first_fit_decreasing, pack_rows
from megatron_rlhf.training.objectives import (
    PPOLossConfig,
    UpdateLogprobs,
    critic_loss,
    logprobs_output,
    ppo_actor_loss,
    sft_loss,
    token_values_output,
    values_output,
)
from megatron_rlhf.training.optim import OptimConfig, make_train_state
from megatron_rlhf.training.schedule import logits_only_at, micro_batches, rows_of
from megatron_rlhf.training.train import forward_pass, train_step

CPU = torch.device("cpu")


def skewed_lengths(count: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(2, 40) for _ in range(count)]


def ffd_by_hand(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit-decreasing written the textbook way: bins as token lists, scanned from the start."""
    bins: list[list[int]] = []
    for index, length in sorted(enumerate(lengths), key=lambda pair: (-pair[1], pair[0])):
        for contents in bins:
            if sum(lengths[i] for i in contents) + length <= capacity:
                contents.append(index)
                break
        else:
            bins.append([index])
    return bins


def test_first_fit_decreasing_by_hand() -> None:
    # 9 -> A; 7 -> B; 5 -> B (12); 3 -> A (12); 3 -> C; 2 -> C (5); 1 -> C (6).
    assert first_fit_decreasing([3, 9, 2, 5, 7, 3, 1], 12) == [[1, 0], [4, 3], [5, 2, 6]]
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing([13], 12)


@pytest.mark.parametrize(
    "lengths",
    [skewed_lengths(300, 7), [40] * 50, [40] * 20 + [1] * 30 + [39] * 10, [5, 5, 30, 35, 40]],
    ids=["skewed", "all-full", "closing-bins", "small"],
)
def test_first_fit_decreasing_equals_the_textbook_scan(lengths: list[int]) -> None:
    """The search that skips bins too full for the shortest sequence places every sequence where
    the textbook scan over all bins does."""
    assert first_fit_decreasing(lengths, 40) == ffd_by_hand(lengths, 40)


@pytest.mark.parametrize("seed", range(5))
def test_pack_rows_places_every_row_once_within_capacity_and_budget(seed: int) -> None:
    lengths = skewed_lengths(50, seed)
    budget = 160
    plan = pack_rows(lengths, budget, None, CPU)
    bins = [rows for micro_batch in plan for rows in micro_batch]
    assert sorted(row for rows in bins for row in rows) == list(range(len(lengths)))
    capacity = max(lengths)
    assert all(sum(lengths[r] for r in rows) <= capacity for rows in bins)
    for micro_batch in plan:
        fullest = max(sum(lengths[r] for r in rows) for rows in micro_batch)
        assert len(micro_batch) * fullest <= budget
    # The bins are the hand-written FFD's, fullest first.
    fills = [sum(lengths[r] for r in rows) for rows in bins]
    assert fills == sorted(fills, reverse=True)
    assert sorted(map(sorted, bins)) == sorted(map(sorted, ffd_by_hand(lengths, capacity)))
    assert sum(lengths) / (sum(len(mb) * max(sum(lengths[r] for r in rows) for rows in mb) for mb in plan)) > 0.85


def test_a_rank_with_few_bins_splits_them_to_the_agreed_count(monkeypatch) -> None:
    """Another DP rank needs 4 micro-batches; this rank's rows fill 2 bins: the largest are split."""
    monkeypatch.setattr(microbatch, "agreed_count", lambda count, group, device: 4)
    lengths = [20, 5, 5, 5, 5, 10]  # FFD with capacity 20: [20], [10, 5, 5], [5, 5]
    plan = pack_rows(lengths, 1000, None, CPU)
    assert len(plan) == 4
    assert sorted(r for mb in plan for rows in mb for r in rows) == list(range(6))
    with pytest.raises(ValueError, match="cannot form 4 micro-batches"):
        pack_rows([7, 7, 7], 1000, None, CPU)


def batch_of(lengths: list[int], vocab: int = 500, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded rows; the last half of each row is its response; per-token PPO inputs."""
    g = torch.Generator().manual_seed(seed)
    shape = (len(lengths), max(lengths) + 3)  # wider than the longest row, as a rollout's batch may be
    positions = torch.arange(shape[1])
    length = torch.tensor(lengths)[:, None]
    mask = (positions < length).long()
    response = ((positions >= (length + 1) // 2) & (positions < length)).float()
    return {
        "input_ids": torch.randint(3, vocab, shape, generator=g) * mask,
        "attention_mask": mask,
        "response_mask": response,
        "loss_mask": response,
        "old_logprobs": (-3.0 + 0.1 * torch.randn(shape, generator=g)) * response,
        "ref_logprobs": (-3.0 + 0.1 * torch.randn(shape, generator=g)) * response,
        "advantages": torch.randn(shape, generator=g) * response,
        "old_values": torch.randn(shape, generator=g) * response,
        "returns": torch.randn(shape, generator=g) * response,
        "row_index": torch.arange(len(lengths)),
    }


def test_packed_layout_holds_each_sequence_once_with_its_own_mask(world_of_one) -> None:
    lengths = [30, 4, 12, 30, 9, 17, 3]
    batch = batch_of(lengths)
    pieces, rows = micro_batches(batch, 10_000, parallel_groups(Layout(1, 1, 1)), CPU)
    assert len(pieces) == 1 and sorted(rows.tolist()) == list(range(len(lengths)))
    piece = pieces[0]
    assert piece["input_ids"].shape[0] < len(lengths)  # rows were packed
    assert int(piece["attention_mask"].sum()) == sum(lengths)
    for i, row in enumerate(rows.tolist()):
        n = lengths[row]
        for key in ("input_ids", "advantages", "response_mask"):
            unpacked = rows_of(piece, piece[key])[i]
            assert torch.equal(unpacked[:n], batch[key][row, :n]) and not unpacked[n:].any()
        assert piece["row_index"][i] == row
    # The mask by hand: query t attends key u iff both lie in one sequence (or the row's tail
    # padding after its last one) and u <= t.
    mask = packed_rows_mask(piece["cu_seqlens"], *piece["input_ids"].shape)
    for b in range(piece["input_ids"].shape[0]):
        owner = []
        for i in (piece["segment_bin"] == b).nonzero().flatten().tolist():
            owner += [i] * lengths[rows[i]]
        owner += [owner[-1]] * (piece["input_ids"].shape[1] - len(owner))
        for t in range(len(owner)):
            allowed = [owner[u] == owner[t] and u <= t for u in range(len(owner))]
            assert (~mask[b, 0, t]).tolist() == allowed
            assert piece["position_ids"][b, t] == sum(1 for u in range(t) if owner[u] == owner[t])
    assert torch.equal(piece["segment_start"], (piece["position_ids"] == 0) & piece["attention_mask"].bool())


def build(path: str):
    return build_role(
        "actor", ModelConfig(path=path), architecture_of(path), world_size=1, dtype=torch.float32, device=CPU
    )


LENGTHS = [37, 5, 16, 9, 40, 3, 22, 11, 28, 7]


def gradients(state) -> torch.Tensor:
    """A train state's gradient buffers, flat."""
    return torch.cat([buffer.grad_data for buffer in state.ddp_model.buffers])


@pytest.mark.parametrize("budget", [80, 10_000])
def test_packed_forward_pass_equals_unpacked(world_of_one, budget: int) -> None:
    """Log-probs (policy), token-aligned values (critic) and raw scores (reward model), float32."""
    batch = batch_of(LENGTHS)
    actor, critic = build("builtin:tiny-llama"), build("builtin:tiny-llama-rm")
    pieces, _ = micro_batches(batch, budget, actor.groups, CPU)
    assert any("cu_seqlens" in p for p in pieces)
    outputs = (
        (actor, logprobs_output(actor, temperature=0.7)),
        (critic, token_values_output()),
        (critic, values_output()),
    )
    for role, fn in outputs:
        packed = forward_pass(role, batch, fn, max_tokens_per_micro_batch=budget)
        unpacked = forward_pass(role, batch, fn, max_tokens_per_micro_batch=budget, pack_sequences=False)
        assert packed.shape == unpacked.shape == batch["input_ids"].shape
        torch.testing.assert_close(packed, unpacked, rtol=1e-5, atol=1e-5)
        assert unpacked.abs().sum() > 0


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("role_name", ["actor", "critic"])
def test_packed_train_step_equals_unpacked(world_of_one, agg_mode: str, role_name: str) -> None:
    """Loss, gradient norm, metrics and the updated weights; budget 80 gives several micro-batches."""
    batch = batch_of(LENGTHS)
    cfg = PPOLossConfig(agg_mode=agg_mode, entropy_coef=0.01, kl_loss_coef=0.05)
    results = []
    for pack in (True, False):
        role = build("builtin:tiny-llama" if role_name == "actor" else "builtin:tiny-llama-rm")
        # A large adam_eps makes the step a smooth function of the gradient: Adam's first step is
        # otherwise about lr x sign(gradient), which turns the rounding of ~0 gradients into lr.
        state = make_train_state(role, OptimConfig(lr=1e-2, clip_grad=100.0, adam_eps=1e-3))
        loss_fn = ppo_actor_loss(role, cfg, temperature=0.7) if role_name == "actor" else critic_loss(cfg)
        metrics = train_step(state, batch, loss_fn, max_tokens_per_micro_batch=80, pack_sequences=pack)
        grads = gradients(state)
        results.append((metrics, grads, torch.cat([p.detach().flatten() for p in role.model.parameters()])))
    (packed, packed_grads, packed_weights), (unpacked, unpacked_grads, unpacked_weights) = results
    assert packed["update_skipped"] == 0.0
    # Micro-batch means of metrics (e.g. clip fractions) differ with the split; loss and gradients do not.
    for name in ("loss", "grad_norm"):
        assert packed[name] == pytest.approx(unpacked[name], rel=1e-5, abs=1e-6), name
    assert packed_grads.abs().sum() > 0
    torch.testing.assert_close(packed_grads, unpacked_grads, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(packed_weights, unpacked_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pack", [True, False])
def test_lm_head_on_the_masked_tokens_only_equals_the_full_pass(world_of_one, pack: bool) -> None:
    """``logits_mask``: the log-probs of the masked tokens equal those of a pass with every position's
    logits (float32); every other position is 0."""
    batch = batch_of(LENGTHS)
    actor = build("builtin:tiny-llama")
    fn = logprobs_output(actor, temperature=0.7)
    full = forward_pass(actor, batch, fn, max_tokens_per_micro_batch=80, pack_sequences=pack)
    masked = {**batch, "logits_mask": batch["response_mask"]}
    pieces, _ = micro_batches(masked, 80, actor.groups, CPU, pack=pack)
    assert sum(len(p["logit_index"]) for p in pieces) == int(batch["response_mask"].sum())
    selected = forward_pass(actor, masked, fn, max_tokens_per_micro_batch=80, pack_sequences=pack)
    response = batch["response_mask"].bool()
    torch.testing.assert_close(selected[response], full[response], rtol=1e-5, atol=1e-6)
    assert not selected[~response].any() and full[~response].any()


@pytest.mark.parametrize("on_policy", [False, True])
def test_lm_head_on_the_masked_tokens_only_trains_as_the_full_pass(world_of_one, on_policy: bool) -> None:
    """A PPO step (entropy bonus and KL loss on) with ``logits_mask`` on the response: the same loss,
    gradient norm and gradients as with every position's logits; on-policy, the recorded log-probs
    agree on the response."""
    cfg = PPOLossConfig(entropy_coef=0.01, kl_loss_coef=0.05)
    results = []
    for logits_mask in (False, True):
        batch = batch_of(LENGTHS)
        if logits_mask:
            batch["logits_mask"] = batch["response_mask"]
        role = build("builtin:tiny-llama")
        state = make_train_state(role, OptimConfig(lr=1e-2, clip_grad=100.0, adam_eps=1e-3))
        recorded = UpdateLogprobs(role, *batch["input_ids"].shape) if on_policy else None
        if on_policy:
            del batch["old_logprobs"]
        metrics = train_step(
            state, batch, ppo_actor_loss(role, cfg, temperature=0.7, on_policy=recorded), max_tokens_per_micro_batch=80
        )
        grads = gradients(state)
        results.append((metrics, grads, recorded.all_rows() if on_policy else None))
    (full, full_grads, full_recorded), (selected, selected_grads, selected_recorded) = results
    for name in ("loss", "grad_norm", "actor/entropy", "actor/kl_loss"):
        assert selected[name] == pytest.approx(full[name], rel=1e-5, abs=1e-6), name
    assert full_grads.abs().sum() > 0
    torch.testing.assert_close(selected_grads, full_grads, rtol=1e-4, atol=1e-7)
    if on_policy:
        response = batch_of(LENGTHS)["response_mask"].bool()
        torch.testing.assert_close(selected_recorded[response], full_recorded[response], rtol=1e-5, atol=1e-6)


def test_sft_step_with_the_lm_head_on_its_targets_equals_the_full_pass(world_of_one) -> None:
    """SFT as the trainer runs it (``logits_mask`` = ``loss_mask``): the NLL, gradient norm and
    gradients of a step with every position's logits."""
    results = []
    for selected in (False, True):
        batch = batch_of(LENGTHS)
        role = build("builtin:tiny-llama")
        state = make_train_state(role, OptimConfig(lr=1e-2, clip_grad=100.0))
        metrics = train_step(
            state,
            logits_only_at(batch, "loss_mask") if selected else batch,
            sft_loss(role),
            max_tokens_per_micro_batch=80,
        )
        results.append((metrics, gradients(state)))
    (full, full_grads), (selected, selected_grads) = results
    for name in ("loss", "grad_norm"):
        assert selected[name] == pytest.approx(full[name], rel=1e-5, abs=1e-6), name
    assert full_grads.abs().sum() > 0
    torch.testing.assert_close(selected_grads, full_grads, rtol=1e-4, atol=1e-7)


def test_lm_head_with_nothing_masked_trains_to_zero_gradients(world_of_one) -> None:
    """Pieces without a masked token still run forward and backward (loss 0, gradients 0)."""
    batch = batch_of(LENGTHS)
    batch["response_mask"] = torch.zeros_like(batch["response_mask"])
    batch["logits_mask"] = batch["response_mask"]
    role = build("builtin:tiny-llama")
    state = make_train_state(role, OptimConfig(lr=1e-2))
    metrics = train_step(
        state, batch, ppo_actor_loss(role, PPOLossConfig(), temperature=1.0), max_tokens_per_micro_batch=80
    )
    assert metrics["loss"] == 0.0
    assert not gradients(state).any()
