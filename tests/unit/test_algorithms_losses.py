"""Loss aggregation, PPO policy / value losses and masked utilities."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest
import torch

from megatron_rlhf.algorithms import (
    AGG_MODES,
    aggregate_loss,
    entropy_bonus,
    explained_variance,
    kl_loss,
    masked_mean,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
    value_loss,
)

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


# ----------------------------------------------------------------- aggregation


def test_aggregate_hand_computed():
    loss = t([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    expect = {"token-mean": (29.0, 6.0), "seq-mean-token-sum": (29.0, 2.0), "seq-mean-token-mean": (8.0, 2.0)}
    for mode, (num, den) in expect.items():
        n, d = aggregate_loss(loss, mask, mode)
        assert (n.item(), d.item()) == (num, den), mode


def test_seq_mean_token_sum_norm_hand_computed():
    # Dr. GRPO: mean over sequences of (token sum / L) with a constant L, here L = 5 (not T = 4)
    loss = t([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    n, d = aggregate_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=5)
    assert (n.item(), d.item()) == (29.0, 10.0)
    assert (n / d).item() == pytest.approx(((1 + 2) / 5 + (5 + 6 + 7 + 8) / 5) / 2, rel=1e-15)
    # the length of a sequence does not divide its own sum: doubling one row's valid tokens
    # doubles its contribution, unlike seq-mean-token-mean
    mask2 = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]])
    n2, d2 = aggregate_loss(loss, mask2, "seq-mean-token-sum-norm", loss_scale_factor=5)
    assert (n2 / d2).item() == pytest.approx((10 / 5 + 26 / 5) / 2, rel=1e-15)
    for bad in (None, 0, -1.0):
        with pytest.raises(ValueError, match="loss_scale_factor"):
            aggregate_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=bad)


def test_ppo_policy_loss_seq_mean_token_sum_norm():
    lp, _old, adv = ppo_inputs([1.0, 1.0, 1.0], [1.0, 2.0, 3.0])
    lp2, adv2 = torch.cat([lp.detach(), lp.detach()]), torch.cat([adv, adv])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    num, den, _ = ppo_policy_loss(
        lp2, torch.zeros_like(lp2), adv2, mask, agg_mode="seq-mean-token-sum-norm", loss_scale_factor=8
    )
    # ratio 1, loss -A: row sums -6 and -1; two rows, L = 8
    assert num.item() == pytest.approx(-7.0) and den.item() == 16.0


def test_aggregate_ignores_nan_on_masked_positions():
    loss = t([[1.0, float("nan")], [float("inf"), 3.0]])
    mask = torch.tensor([[True, False], [False, True]])
    for mode in MODES:
        n, d = aggregate_loss(loss, mask, mode, loss_scale_factor=1)
        assert math.isfinite(n.item()) and n.item() == 4.0 and d.item() == 2.0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cuts", [[0, 1, 8], [0, 3, 5, 6, 8], [0, 2, 4, 6, 8], [0, 7, 8]])
def test_aggregate_invariant_to_micro_batch_split(mode, cuts):
    g = torch.Generator().manual_seed(11)
    loss = torch.randn(8, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(8, 6, generator=g) > 0.4
    mask[3] = False  # padding row inside some micro-batch
    mask[5, :] = torch.tensor([1, 0, 0, 0, 0, 0], dtype=torch.bool)
    n_full, d_full = aggregate_loss(loss, mask, mode, loss_scale_factor=6)
    parts = [aggregate_loss(loss[a:b], mask[a:b], mode, loss_scale_factor=6) for a, b in itertools.pairwise(cuts)]
    n_sum = sum(p[0] for p in parts)
    d_sum = sum(p[1] for p in parts)
    torch.testing.assert_close(n_sum / d_sum, n_full / d_full, rtol=1e-13, atol=1e-13)
    assert d_sum.item() == d_full.item()
    # the naive mean of micro-batch means is NOT split-invariant (test can fail)
    naive = sum(p[0] / p[1] for p in parts) / len(parts)
    assert abs(naive.item() - (n_full / d_full).item()) > 1e-6


def test_unknown_agg_mode_error():
    with pytest.raises(ValueError) as e:
        aggregate_loss(t([[1.0]]), torch.ones(1, 1), "token_mean")
    msg = str(e.value)
    assert "loss aggregation mode" in msg and "Did you mean 'token-mean'?" in msg
    assert set(AGG_MODES.names()) == set(MODES)


# ----------------------------------------------------------------- PPO policy loss


def ppo_inputs(ratios, adv):
    lp = t([[math.log(r) for r in ratios]]).requires_grad_(True)
    return lp, torch.zeros(1, len(ratios), dtype=torch.float64), t([adv])


def test_ppo_policy_loss_hand_computed_symmetric():
    lp, old, adv = ppo_inputs([0.5, 1.0, 1.5], [1.0, -1.0, 2.0])
    num, den, m = ppo_policy_loss(lp, old, adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.2)
    # per token: max(-0.5, -0.8) = -0.5 ; max(1, 1) = 1 ; max(-3, -2.4) = -2.4 (clipped)
    assert num.item() == pytest.approx(-1.9, abs=1e-12) and den.item() == 3.0
    assert m["pg_clipfrac"].item() == pytest.approx(1 / 3) and m["pg_clipfrac_lower"].item() == 0.0
    k3 = [r - 1 - math.log(r) for r in (0.5, 1.0, 1.5)]
    assert m["approx_kl"].item() == pytest.approx(sum(k3) / 3, rel=1e-12)
    num.backward()
    # d/dlogp of -A*r is -A*r on unclipped tokens, 0 where the clip is active
    torch.testing.assert_close(lp.grad, t([[-0.5, 1.0, 0.0]]))


def test_ppo_policy_loss_asymmetric_clip_and_mask():
    lp, old, adv = ppo_inputs([0.5, 1.0, 1.5], [-1.0, -1.0, 2.0])
    num, den, m = ppo_policy_loss(lp, old, adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.28)
    # max(0.5, 0.8) = 0.8 (lower clip) ; 1 ; max(-3, -2.56) = -2.56
    assert num.item() == pytest.approx(0.8 + 1.0 - 2.56, abs=1e-12)
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 3)
    num, den, m = ppo_policy_loss(lp, old, adv, torch.tensor([[1, 1, 0]]), clip_low=0.2, clip_high=0.28)
    assert num.item() == pytest.approx(1.8, abs=1e-12) and den.item() == 2.0
    assert m["pg_clipfrac"].item() == pytest.approx(0.5)


def test_ppo_dual_clip_hand_computed():
    lp, old, adv = ppo_inputs([4.0, 2.0, 0.5], [-1.0, -1.0, 1.0])
    mask = torch.ones(1, 3)
    num, _, m = ppo_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip_c=3.0)
    # max(4, 1.2)=4 -> capped at -c*A = 3 ; max(2, 1.2)=2 < 3 ; A>0: max(-0.5, -0.8) = -0.5
    assert num.item() == pytest.approx(3.0 + 2.0 - 0.5, abs=1e-12)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(1 / 3) and m["pg_clipfrac"].item() == 0.0
    num.backward()
    torch.testing.assert_close(lp.grad, t([[0.0, 2.0, -0.5]]))  # capped token has no gradient
    num_plain, _, _ = ppo_policy_loss(lp.detach(), old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert num_plain.item() == pytest.approx(5.5, abs=1e-12)
    with pytest.raises(ValueError, match="dual_clip_c"):
        ppo_policy_loss(lp, old, adv, mask, dual_clip_c=1.0)


def test_ppo_seq_mean_token_mean_mode():
    lp, _old, adv = ppo_inputs([1.0, 1.0, 1.0], [1.0, 2.0, 3.0])
    lp2 = torch.cat([lp.detach(), lp.detach()])
    adv2 = torch.cat([adv, adv])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    num, den, _ = ppo_policy_loss(lp2, torch.zeros_like(lp2), adv2, mask, agg_mode="seq-mean-token-mean")
    assert num.item() == pytest.approx(-2.0 + -1.0) and den.item() == 2.0


def test_ppo_metrics_are_detached_tensors_and_finite():
    torch.manual_seed(0)
    lp = (torch.randn(4, 5, dtype=torch.float64) * 30).requires_grad_(True)  # extreme ratios
    num, _den, m = ppo_policy_loss(
        lp,
        torch.zeros(4, 5, dtype=torch.float64),
        torch.randn(4, 5, dtype=torch.float64),
        torch.ones(4, 5),
        dual_clip_c=3.0,
    )
    assert torch.isfinite(num) and all(isinstance(v, torch.Tensor) and not v.requires_grad for v in m.values())
    assert all(torch.isfinite(v) for v in m.values())


# ----------------------------------------------------------------- value / entropy / kl losses


def test_value_loss_hand_computed():
    v, old, ret = t([[1.0, 2.0, 0.0]]), t([[0.5, 2.0, 1.0]]), t([[1.0, 3.0, 0.5]])
    mask = torch.ones(1, 3)
    num, den, m = value_loss(v, old, ret, mask, clip_range=0.2)
    # t0: max(0, (0.7-1)^2=.09) ; t1: max(1, 1) ; t2: max(.25, (0.8-.5)^2=.09)
    assert num.item() == pytest.approx(0.5 * (0.09 + 1.0 + 0.25), abs=1e-12) and den.item() == 3.0
    assert m["vf_clipfrac"].item() == pytest.approx(1 / 3)
    num, _, m = value_loss(v, old, ret, mask, clip_range=None)
    assert num.item() == pytest.approx(0.5 * (0.0 + 1.0 + 0.25)) and m["vf_clipfrac"].item() == 0.0
    num, den, _ = value_loss(v, old, ret, torch.tensor([[0, 1, 1]]), clip_range=0.2, agg_mode="seq-mean-token-sum")
    assert num.item() == pytest.approx(0.5 * 1.25) and den.item() == 1.0


def test_value_clipfrac_counts_only_clips_that_happened():
    # t0: |v - old| = 0.15 < 0.2, no clip, but old + (v - old) = 0.08000000000000002 != v and
    #     lies farther from R: comparing squared errors alone counted it as clipped.
    # t1: clip active and binding (v_clip = 0.7, error 0.09 > 0).
    # t2: clamp moves v to 0.8 but the unclipped error is the larger: not counted (as in verl).
    v, old, ret = t([[0.08, 1.0, 0.0]]), t([[-0.07, 0.5, 1.0]]), t([[-0.72, 1.0, 0.5]])
    assert (old + (v - old))[0, 0].item() != v[0, 0].item()  # the rounding this test is about
    err_t0 = (0.08 - -0.72) ** 2
    num, den, m = value_loss(v, old, ret, torch.ones(1, 3), clip_range=0.2)
    assert m["vf_clipfrac"].item() == pytest.approx(1 / 3)
    assert num.item() == pytest.approx(0.5 * (err_t0 + 0.09 + 0.25), rel=1e-12) and den.item() == 3.0
    # the former metric, (v_clip - R)^2 > (v - R)^2, gives 2/3 here
    v_clip = old + (v - old).clamp(-0.2, 0.2)
    assert ((v_clip - ret).square() > (v - ret).square()).double().mean().item() == pytest.approx(2 / 3)


def test_entropy_bonus_and_kl_loss():
    ent = t([[1.0, 2.0, 4.0]])
    mask = torch.tensor([[1, 1, 0]])
    n, d = entropy_bonus(ent, mask)
    assert (n.item(), d.item()) == (3.0, 2.0)
    lp, ref = t([[-1.0, -2.0, -3.0]]), t([[-1.5, -1.0, 0.0]])
    n, d = kl_loss(lp, ref, mask, estimator="k1")
    assert n.item() == pytest.approx(0.5 - 1.0) and d.item() == 2.0
    n, _ = kl_loss(lp, ref, mask, estimator="k2", agg_mode="seq-mean-token-mean")
    assert n.item() == pytest.approx((0.125 + 0.5) / 2)
    with pytest.raises(ValueError, match="KL estimator"):
        kl_loss(lp, ref, mask, estimator="k4")


# ----------------------------------------------------------------- utilities


def test_masked_stats_vs_python():
    x = t([[1.0, 2.0, float("nan")], [4.0, float("inf"), 8.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    vals = [1.0, 2.0, 4.0, 8.0]
    assert masked_mean(x, mask).item() == pytest.approx(statistics.fmean(vals))
    assert masked_var(x, mask).item() == pytest.approx(statistics.variance(vals))
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(statistics.pvariance(vals))
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), t([1.5, 6.0]))
    w = masked_whiten(x, mask, eps=0.0)
    sd = statistics.stdev(vals)
    expect = [[(1 - 3.75) / sd, (2 - 3.75) / sd, 0.0], [(4 - 3.75) / sd, 0.0, (8 - 3.75) / sd]]
    torch.testing.assert_close(w, t(expect))
    empty = torch.zeros(2, 3, dtype=torch.bool)
    assert masked_mean(x, empty).item() == 0.0 and masked_var(x, empty).item() == 0.0
    assert torch.all(masked_whiten(x, empty) == 0)


def test_explained_variance():
    ret = t([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert explained_variance(ret, ret, mask).item() == pytest.approx(1.0)
    assert explained_variance(torch.full_like(ret, 5.0), ret, mask).item() == pytest.approx(0.0, abs=1e-12)
    v = t([[1.5, 2.0, 2.0, 0.0]])
    err = [1.0 - 1.5, 0.0, 1.0]
    expect = 1 - statistics.variance(err) / statistics.variance([1.0, 2.0, 3.0])
    assert explained_variance(v, ret, mask).item() == pytest.approx(expect)
    flat = t([[2.0, 2.0, 2.0, 2.0]])
    assert explained_variance(v, flat, mask).item() == 0.0
