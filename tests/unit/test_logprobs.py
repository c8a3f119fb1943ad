"""Per-token log-probs / entropy (single process, tp_group=None) vs an independent float64 reference."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.training.logprobs import token_logprobs_and_entropy

VOCAB, PADDED = 97, 128  # 31 padding columns
B, S = 3, 5


def make_inputs(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(B, S, PADDED, generator=gen, dtype=torch.float64)
    # Padding rows hold large values: any leak into the softmax would dominate it.
    logits[..., VOCAB:] = 50.0 + 20.0 * torch.randn(B, S, PADDED - VOCAB, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (B, S), generator=gen)
    return logits.to(dtype), targets


def reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64, over the real vocabulary only: what a sampler's softmax(logits / T) assigns."""
    log_p = torch.log_softmax(logits[..., :VOCAB].double() / temperature, dim=-1)
    logprobs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    probs = log_p.exp()
    entropy = -(probs * probs.log()).sum(-1)
    return logprobs, entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float64, 1e-12)])
def test_matches_float64_reference(temperature: float, dtype: torch.dtype, tol: float) -> None:
    logits, targets = make_inputs(dtype=dtype)
    before = logits.clone()
    logprobs, entropy = token_logprobs_and_entropy(
        logits, targets, tp_group=None, vocab_size=VOCAB, temperature=temperature
    )
    ref_logprobs, ref_entropy = reference(logits, targets, temperature)
    assert logprobs.shape == entropy.shape == (B, S)
    assert logprobs.dtype == entropy.dtype == dtype
    assert (logprobs - ref_logprobs).abs().max() < tol
    assert (entropy - ref_entropy).abs().max() < tol
    assert torch.equal(logits, before)  # the input is not modified in place


def test_temperature_changes_the_distribution() -> None:
    logits, targets = make_inputs()
    hot, _ = token_logprobs_and_entropy(logits, targets, tp_group=None, vocab_size=VOCAB, temperature=0.7)
    cold, _ = token_logprobs_and_entropy(logits, targets, tp_group=None, vocab_size=VOCAB, temperature=1.0)
    assert (hot - cold).abs().max() > 1e-2
    # Sanity of the reference itself: the probabilities over the real vocabulary sum to 1.
    all_targets = torch.arange(VOCAB).expand(B, S, VOCAB)
    log_p = torch.stack(
        [
            token_logprobs_and_entropy(logits, all_targets[..., v], tp_group=None, vocab_size=VOCAB, temperature=0.7)[0]
            for v in range(VOCAB)
        ],
        dim=-1,
    )
    assert (log_p.exp().sum(-1) - 1).abs().max() < 1e-5


def test_bf16_input_is_upcast() -> None:
    logits, targets = make_inputs()
    logits = logits.bfloat16()
    logprobs, entropy = token_logprobs_and_entropy(logits, targets, tp_group=None, vocab_size=VOCAB, temperature=0.7)
    assert logprobs.dtype == entropy.dtype == torch.float32
    ref_logprobs, ref_entropy = reference(logits, targets, 0.7)  # same bf16 values, in float64
    assert (logprobs - ref_logprobs).abs().max() < 2e-5
    assert (entropy - ref_entropy).abs().max() < 2e-5
    logits.requires_grad_(True)
    logprobs, entropy = token_logprobs_and_entropy(logits, targets, tp_group=None, vocab_size=VOCAB)
    (logprobs.sum() + entropy.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 3e-6), (torch.float64, 1e-13)])
def test_gradients_match_autograd_of_reference(temperature: float, dtype: torch.dtype, tol: float) -> None:
    logits, targets = make_inputs(seed=1)
    gen = torch.Generator().manual_seed(2)
    w_logp, w_ent = (
        torch.randn(B, S, generator=gen, dtype=torch.float64),
        torch.randn(B, S, generator=gen, dtype=torch.float64),
    )

    ref_in = logits.double().requires_grad_(True)  # the same (float32-representable) values
    ref_logprobs, ref_entropy = reference(ref_in, targets, temperature)
    (w_logp * ref_logprobs + w_ent * ref_entropy).sum().backward()

    ours_in = logits.to(dtype).requires_grad_(True)
    logprobs, entropy = token_logprobs_and_entropy(
        ours_in, targets, tp_group=None, vocab_size=VOCAB, temperature=temperature
    )
    (w_logp.to(dtype) * logprobs + w_ent.to(dtype) * entropy).sum().backward()
    assert ours_in.grad.dtype == dtype
    assert (ours_in.grad.double() - ref_in.grad).abs().max() < tol
    assert torch.equal(ours_in.grad[..., VOCAB:], torch.zeros_like(ours_in.grad[..., VOCAB:]))

    # Each output alone (the other's gradient is None in autograd).
    for pick in (0, 1):
        ref_in.grad = None
        ours_in.grad = None
        ref_out = reference(ref_in, targets, temperature)[pick]
        (w_logp * ref_out).sum().backward()
        out = token_logprobs_and_entropy(ours_in, targets, tp_group=None, vocab_size=VOCAB, temperature=temperature)[
            pick
        ]
        (w_logp.to(dtype) * out).sum().backward()
        assert (ours_in.grad.double() - ref_in.grad).abs().max() < tol


def test_gradcheck_float64() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (2, 3), generator=gen)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs_and_entropy(x, targets, tp_group=None, vocab_size=13, temperature=0.7)

    assert torch.autograd.gradcheck(fn, (logits,))


def test_without_entropy() -> None:
    logits, targets = make_inputs()
    logits.requires_grad_(True)
    logprobs, entropy = token_logprobs_and_entropy(
        logits, targets, tp_group=None, vocab_size=VOCAB, compute_entropy=False
    )
    assert entropy is None
    ref_logprobs, _ = reference(logits, targets, 1.0)
    assert (logprobs - ref_logprobs).abs().max() < 2e-5
    logprobs.sum().backward()
    ref_in = logits.detach().clone().requires_grad_(True)
    reference(ref_in, targets, 1.0)[0].sum().backward()
    assert (logits.grad.double() - ref_in.grad).abs().max() < 3e-6


@pytest.mark.parametrize("temperature", [0.0, -0.5, float("nan"), float("inf")])
def test_invalid_temperature(temperature: float) -> None:
    logits, targets = make_inputs()
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(logits, targets, tp_group=None, vocab_size=VOCAB, temperature=temperature)


def test_invalid_shapes_and_vocab_size() -> None:
    logits, targets = make_inputs()
    with pytest.raises(ValueError, match="targets shape"):
        token_logprobs_and_entropy(logits, targets[:, :-1], tp_group=None, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="vocab_size"):
        token_logprobs_and_entropy(logits, targets, tp_group=None, vocab_size=PADDED + 1)


def _one_shard_stats(z: torch.Tensor, local_target: torch.Tensor) -> torch.Tensor:
    """What ``logprobs_kernel.shard_stats`` returns for one shard's scaled logits z (-inf on padding),
    written directly in float64: the shard's max m, sum e^(z - m), sum e^(z - m) (z - m), target z."""
    m = z.amax(-1)
    shifted = z - m.unsqueeze(-1)
    e = shifted.exp()
    weighted = torch.where(e > 0, e * shifted, 0.0).sum(-1)
    target_z = z.gather(-1, local_target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return torch.stack([m, e.sum(-1), weighted, target_z])


def test_single_pass_shard_stats_moved_to_the_max_over_shards_equal_the_two_pass_sums() -> None:
    """The GPU kernel's per-shard statistics (relative to each shard's own max), moved to the max
    over TP ranks by ``_relative_to_max``, equal ``_shard_stats`` computed from that max: per shard,
    and summed over shards (what the all-reduce adds). Two shards; the second holds the padding."""
    from megatron_rlhf.training.logprobs import _relative_to_max, _scaled, _shard_stats

    logits, targets = make_inputs(seed=3, dtype=torch.float64)
    half = PADDED // 2
    shards = [(logits[..., :half], half), (logits[..., half:], VOCAB - half)]
    z_max = logits[..., :VOCAB].amax(-1)
    summed_single, summed_two_pass = 0.0, 0.0
    for index, (shard, n_real) in enumerate(shards):
        local_target = targets - index * half
        local_target = torch.where((local_target >= 0) & (local_target < half), local_target, -1)
        z = _scaled(shard, torch.float64, 1.0, n_real)
        single = _relative_to_max(_one_shard_stats(z, local_target), local_target, z_max)
        two_pass = _shard_stats(shard, local_target, z_max, torch.float64, 1.0, n_real)
        torch.testing.assert_close(single, two_pass, rtol=1e-12, atol=1e-12)
        summed_single, summed_two_pass = summed_single + single, summed_two_pass + two_pass
    torch.testing.assert_close(summed_single, summed_two_pass, rtol=1e-12, atol=1e-12)


def test_single_pass_shard_of_padding_only_adds_nothing() -> None:
    """A shard whose columns are all padding (its max is -inf) contributes 0 to every sum, not NaN."""
    from megatron_rlhf.training.logprobs import _relative_to_max

    stats = torch.tensor([[float("-inf")], [0.0], [0.0], [float("-inf")]], dtype=torch.float64)
    moved = _relative_to_max(stats, torch.tensor([-1]), torch.tensor([2.5], dtype=torch.float64))
    assert moved.tolist() == [[0.0], [0.0], [0.0]]
