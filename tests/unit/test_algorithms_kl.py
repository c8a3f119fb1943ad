"""KL estimators, controllers and reward penalty vs hand / math-module references."""

from __future__ import annotations

import math
import typing

import pytest
import torch

from megatron_rlhf.algorithms import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    KL_MEASURES,
    AdaptiveKLController,
    FixedKLController,
    KLControllerConfig,
    apply_kl_penalty,
    build_kl_controller,
    controller_kl,
)

LOGP = [[-0.5, -2.0, -1.0, -0.1]]
REF = [[-1.0, -1.5, -1.0, -3.0]]


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize(
    "name,formula",
    [
        ("k1", lambda lp, rf: lp - rf),
        ("kl", lambda lp, rf: lp - rf),
        ("abs", lambda lp, rf: abs(lp - rf)),
        ("k2", lambda lp, rf: 0.5 * (lp - rf) ** 2),
        ("mse", lambda lp, rf: 0.5 * (lp - rf) ** 2),
        ("k3", lambda lp, rf: math.exp(rf - lp) - (rf - lp) - 1.0),
        ("low_var_kl", lambda lp, rf: math.exp(rf - lp) - (rf - lp) - 1.0),
    ],
)
def test_estimators_match_formula(name, formula):
    out = KL_ESTIMATORS.get(name)(t(LOGP), t(REF))
    expected = [[formula(a, b) for a, b in zip(LOGP[0], REF[0], strict=True)]]
    torch.testing.assert_close(out, t(expected), rtol=1e-12, atol=1e-12)


def test_aliases_and_hand_values():
    assert KL_ESTIMATORS.get("k3") is KL_ESTIMATORS.get("low_var_kl")
    assert KL_ESTIMATORS.get("k2") is KL_ESTIMATORS.get("mse")
    assert KL_ESTIMATORS.get("k1") is KL_ESTIMATORS.get("kl")
    # logp=0, ref=log 2: k1 = -log 2, k3 = 2 - log 2 - 1
    lp, rf = t([[0.0]]), t([[math.log(2.0)]])
    assert KL_ESTIMATORS.get("k1")(lp, rf).item() == pytest.approx(-math.log(2.0))
    assert KL_ESTIMATORS.get("k3")(lp, rf).item() == pytest.approx(1.0 - math.log(2.0))


@pytest.mark.parametrize(
    "name,value",
    [
        ("k1+", lambda lp, rf: lp - rf),
        ("kl+", lambda lp, rf: lp - rf),
        ("abs+", lambda lp, rf: abs(lp - rf)),
        ("k3+", lambda lp, rf: math.exp(rf - lp) - (rf - lp) - 1.0),
        ("low_var_kl+", lambda lp, rf: math.exp(rf - lp) - (rf - lp) - 1.0),
    ],
)
def test_straight_through_value_of_estimator_gradient_of_k2(name, value):
    lp = t(LOGP).requires_grad_(True)
    rf = t(REF).requires_grad_(True)
    out = KL_ESTIMATORS.get(name)(lp, rf)
    expected = [[value(a, b) for a, b in zip(LOGP[0], REF[0], strict=True)]]
    torch.testing.assert_close(out.detach(), t(expected), rtol=1e-12, atol=1e-12)
    weights = t([[1.0, 2.0, -1.0, 0.5]])  # a weighted sum, so each token's gradient is checked
    (out * weights).sum().backward()
    # d/dlogp 0.5 (logp - ref)^2 = logp - ref, and the opposite for ref
    k2_grad = [[w * (a - b) for w, a, b in zip(weights[0].tolist(), LOGP[0], REF[0], strict=True)]]
    torch.testing.assert_close(lp.grad, t(k2_grad), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rf.grad, -t(k2_grad), rtol=1e-12, atol=1e-12)
    # the plain estimator's gradient differs (this test can fail)
    lp_plain = t(LOGP).requires_grad_(True)
    (KL_ESTIMATORS.get(name.rstrip("+"))(lp_plain, t(REF)) * weights).sum().backward()
    assert not torch.allclose(lp_plain.grad, lp.grad)


def test_k3_is_nonnegative_and_clamped():
    torch.manual_seed(0)
    lp = torch.randn(16, 32, dtype=torch.float64) * 3
    rf = torch.randn(16, 32, dtype=torch.float64) * 3
    assert (KL_ESTIMATORS.get("k3")(lp, rf) >= 0).all()
    extreme = KL_ESTIMATORS.get("k3")(t([[-100.0, 0.0]]), t([[0.0, -100.0]])).float()
    assert torch.isfinite(extreme).all() and (extreme <= 10.0).all()
    assert extreme.tolist() == [[10.0, 10.0]]  # both directions capped at K3_MAX
    below_cap = KL_ESTIMATORS.get("k3")(t([[0.0]]), t([[-5.0]])).item()
    assert below_cap == pytest.approx(math.exp(-5.0) + 5.0 - 1.0, rel=1e-12)


def test_k3_float32_small_log_ratio_vs_float64():
    # |ref - logp| ~ 1e-3: k3 ~ 5e-7, far below float32's resolution of exp() near 1.
    logp = torch.tensor([[-0.5, -1.0, -2.0, -0.25, -1.5, -3.0]], dtype=torch.float32)
    ref = logp + torch.tensor([[1e-3, -1e-3, 1.5e-3, -7e-4, 8e-4, -1.2e-3]], dtype=torch.float32)
    x = ref.double() - logp.double()  # the float32 difference is exact here (Sterbenz)
    truth = torch.tensor([[math.expm1(v) - v for v in x[0].tolist()]], dtype=torch.float64)
    out = KL_ESTIMATORS.get("k3")(logp, ref)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), truth, rtol=1e-3, atol=0.0)
    # the former exp(x) - x - 1 in float32 misses by several percent: this test can fail
    x32 = ref - logp
    naive = (torch.exp(x32) - x32 - 1.0).double()
    assert ((naive - truth).abs() / truth).max().item() > 1e-2


def test_unknown_estimator_suggests_closest():
    with pytest.raises(ValueError) as e:
        KL_ESTIMATORS.get("low_var_kll")
    msg = str(e.value)
    assert "KL estimator" in msg and "'low_var_kll'" in msg and "Did you mean 'low_var_kl'?" in msg
    assert "'k1'" in msg


def test_fixed_controller_never_moves():
    c = FixedKLController(0.05)
    c.update(current_kl=100.0, n_steps=1000)
    assert c.value == 0.05


def test_adaptive_controller_hand_computed_with_clip():
    c = AdaptiveKLController(init_coef=0.1, target_kl=6.0, horizon=10_000)
    c.update(current_kl=9.0, n_steps=256)  # 9/6-1 = 0.5 -> clipped to 0.2
    assert c.value == pytest.approx(0.1 * 1.00512, rel=1e-12)  # 1 + 0.2*256/1e4
    assert c.value != pytest.approx(0.1 * (1 + 0.5 * 256 / 10_000))  # unclipped would differ
    c.update(current_kl=5.4, n_steps=512)  # 0.9-1 = -0.1, inside the clip
    assert c.value == pytest.approx(0.100512 * 0.99488, rel=1e-12)
    c.update(current_kl=0.0, n_steps=100)  # -1 -> clipped to -0.2
    assert c.value == pytest.approx(0.100512 * 0.99488 * 0.998, rel=1e-12)
    c.update(current_kl=6.0, n_steps=999)  # on target: no change
    assert c.value == pytest.approx(0.100512 * 0.99488 * 0.998, rel=1e-12)


def test_adaptive_controller_validates():
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, 0.0, 100)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 1.0, 0)


def test_a_resumed_controller_continues_an_adaptive_coefficient_and_not_a_fixed_one():
    """Before: a fixed run with coef 0 (no penalty) resumed as adaptive continued from 0, which the
    update only scales: the penalty never came."""
    adaptive = KLControllerConfig(type="adaptive", coef=0.05)
    moved = build_kl_controller(adaptive)
    moved.update(current_kl=1.0, n_steps=100)  # above target: the coefficient grew
    for saved, expected in [
        (moved.state_dict(), moved.value),  # adaptive -> adaptive: its state continues
        (build_kl_controller(KLControllerConfig(coef=0.0)).state_dict(), 0.05),  # fixed -> adaptive
        ({"kl_coef": 0.0}, 0.05),  # a checkpoint that does not say which controller saved it
        ({"kl_coef": 0.02}, 0.02),
    ]:
        resumed = build_kl_controller(adaptive)
        resumed.load_state_dict(saved)
        assert resumed.value == expected, saved
    fixed = build_kl_controller(KLControllerConfig(coef=0.3))
    fixed.load_state_dict(moved.state_dict())  # adaptive -> fixed: the config's coefficient
    assert fixed.value == 0.3
    with pytest.raises(ValueError, match=r"coef=0 with type=adaptive would stay 0"):
        KLControllerConfig(type="adaptive", coef=0.0)


def test_build_kl_controller():
    fixed = build_kl_controller(KLControllerConfig(type="fixed", coef=0.02))
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.02
    ad = build_kl_controller(KLControllerConfig(type="adaptive", coef=0.2, target_kl=1.0, horizon=100))
    assert isinstance(ad, AdaptiveKLController)
    ad.update(current_kl=1.1, n_steps=10)
    assert ad.value == pytest.approx(0.2 * (1 + 0.1 * 10 / 100))
    with pytest.raises(
        ValueError, match=r"^type='adaptiv' must be one of \['fixed', 'adaptive'\]; did you mean 'adaptive'\?"
    ):
        build_kl_controller(KLControllerConfig(type="adaptiv"))  # type: ignore[arg-type]


def test_the_controller_settings_offer_exactly_the_registered_entries():
    hints = typing.get_type_hints(KLControllerConfig)
    assert set(typing.get_args(hints["type"])) == set(KL_CONTROLLERS.names())
    assert set(typing.get_args(hints["kl_measure"])) == set(KL_MEASURES.names())


def test_controller_kl_measures_hand_computed():
    kl = t([[0.1, 0.3, float("nan"), 0.0], [0.4, 0.0, 0.2, 0.6], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])  # row 2: padding, not a sample
    # token_mean (verl): per-sequence means 0.2 and 0.3, averaged; not the batch token mean 1.6 / 6
    assert controller_kl(kl, mask, "token_mean") == pytest.approx(0.25, rel=1e-12)
    assert controller_kl(kl, mask) == pytest.approx(0.25, rel=1e-12)  # the default
    assert controller_kl(kl, mask) != pytest.approx(1.6 / 6)
    # sequence_sum (Ziegler et al.): per-sequence sums 0.4 and 1.2, averaged
    assert controller_kl(kl, mask, "sequence_sum") == pytest.approx(0.8, rel=1e-12)
    with pytest.raises(ValueError, match="KL controller measure"):
        controller_kl(kl, mask, "token-mean")


def test_kl_measure_config_default_and_check():
    assert KLControllerConfig().kl_measure == "token_mean"
    assert KLControllerConfig(kl_measure="sequence_sum").kl_measure == "sequence_sum"
    with pytest.raises(ValueError, match=r"kl_measure='sequence-sum' must be one of .*; did you mean 'sequence_sum'\?"):
        KLControllerConfig(kl_measure="sequence-sum")  # type: ignore[arg-type]


def test_apply_kl_penalty_hand_computed_and_ignores_masked_nan():
    rewards = t([[0.0, 0.0, 1.0, 0.0]])
    kl = t([[0.1, -0.2, 0.3, float("nan")]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = apply_kl_penalty(rewards, kl, 0.5, mask)
    torch.testing.assert_close(out, t([[-0.05, 0.1, 0.85, 0.0]]), rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="shape"):
        apply_kl_penalty(rewards, kl[:, :2], 0.5, mask)
