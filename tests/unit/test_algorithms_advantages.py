"""Advantage estimators vs independent float64 pure-Python references."""

from __future__ import annotations

import dataclasses
import inspect
import math
import statistics

import pytest
import torch

from megatron_rlhf.algorithms import ADVANTAGE_ESTIMATORS, AdvantageConfig, compute_advantages

EPS = 1e-6
ALL = ["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]


# ----------------------------------------------------------------- pure-Python references


def ref_gae_row(r, m, v, gamma, lam):
    """GAE over the valid indices only (masked steps removed from the episode)."""
    idx = [t for t in range(len(r)) if m[t]]
    adv = [0.0] * len(r)
    next_v, running = 0.0, 0.0
    for t in reversed(idx):
        delta = r[t] + gamma * next_v - v[t]
        running = delta + gamma * lam * running
        adv[t] = running
        next_v = v[t]
    return adv


def ref_return_row(r, m, gamma):
    idx = [t for t in range(len(r)) if m[t]]
    out = [0.0] * len(r)
    g = 0.0
    for t in reversed(idx):
        g = r[t] + gamma * g
        out[t] = g
    return out


def ref_whiten(rows, mask, eps):
    flat = [x for row, mr in zip(rows, mask, strict=True) for x, mm in zip(row, mr, strict=True) if mm]
    mu = sum(flat) / len(flat)
    var = sum((x - mu) ** 2 for x in flat) / (len(flat) - 1)
    return [
        [(x - mu) / math.sqrt(var + eps) if mm else 0.0 for x, mm in zip(row, mr, strict=True)]
        for row, mr in zip(rows, mask, strict=True)
    ]


def ref_groups(rewards, mask, groups):
    """score per row and {group: [scores of rows with >= 1 valid token]}."""
    scores = [sum(x for x, mm in zip(row, mr, strict=True) if mm) for row, mr in zip(rewards, mask, strict=True)]
    members: dict[int, list[float]] = {}
    for i, g in enumerate(groups):
        if any(mask[i]):
            members.setdefault(g, []).append(scores[i])
    return scores, members


def broadcast(row_vals, mask):
    return [[row_vals[i] if mm else 0.0 for mm in mask[i]] for i in range(len(mask))]


# ----------------------------------------------------------------- fixtures


def make_batch(seed=0, B=8, T=7):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0] = torch.tensor([1, 1, 0, 0, 1, 1, 0], dtype=torch.bool)  # multi-turn gap
    mask[1] = False  # all-masked row (padding)
    mask[2] = True
    # outcome scores at last valid token
    for i in range(B):
        valid = mask[i].nonzero().flatten()
        if len(valid):
            rewards[i, valid[-1]] += float(i % 3)
    # groups: 5 -> rows {0,2,3}, 9 -> {1,4}, 2 -> {5}, 7 -> {6,7}
    groups = torch.tensor([5, 9, 5, 5, 9, 2, 7, 7])
    # zero-variance group 7: identical outcome rewards
    rewards[6] = 0.0
    rewards[7] = 0.0
    mask[6, -1] = True
    mask[7, -1] = True
    rewards[6, -1] = 1.0
    rewards[7, -1] = 1.0
    # poison masked positions: they must not leak
    rewards = rewards.masked_fill(~mask, float("nan"))
    values = values.masked_fill(~mask, float("inf"))
    return rewards, mask, values, groups


def call(name, rewards, mask, values, groups, **cfg):
    return ADVANTAGE_ESTIMATORS.get(name)(
        token_rewards=rewards, response_mask=mask, values=values, group_index=groups, config=AdvantageConfig(**cfg)
    )


def tl(x):
    return x.tolist()


def as_t(rows):
    return torch.tensor(rows, dtype=torch.float64)


# ----------------------------------------------------------------- GAE


def test_gae_hand_computed_1x3():
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 0.5, 0.5]], dtype=torch.float64)
    m = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = call("gae", r, m, v, None, whiten=False)
    assert tl(adv) == [[0.5, 0.5, 0.5]] and tl(ret) == [[1.0, 1.0, 1.0]]
    adv, ret = call("gae", r, m, v, None, whiten=False, lam=0.0)  # one-step TD
    assert tl(adv) == [[0.0, 0.0, 0.5]] and tl(ret) == [[0.5, 0.5, 1.0]]
    adv, _ = call("gae", r, m, v, None, whiten=False, gamma=0.5, lam=0.5)
    # deltas: [0+.25-.5, 0+.25-.5, 1-.5] = [-.25,-.25,.5]; A2=.5, A1=-.25+.25*.5, A0=-.25+.25*A1
    torch.testing.assert_close(adv, as_t([[-0.25 + 0.25 * (-0.125), -0.125, 0.5]]))


@pytest.mark.parametrize("gamma,lam,whiten", [(1.0, 1.0, False), (0.9, 0.8, False), (0.99, 0.95, True)])
def test_gae_matches_reference(gamma, lam, whiten):
    rewards, mask, values, _ = make_batch(1)
    adv, ret = call("gae", rewards, mask, values, None, gamma=gamma, lam=lam, whiten=whiten)
    R, M, V = tl(rewards), tl(mask), tl(values)
    ref_adv = [ref_gae_row(R[i], M[i], V[i], gamma, lam) for i in range(len(R))]
    ref_ret = [
        [a + v if mm else 0.0 for a, v, mm in zip(ar, vr, mr, strict=True)]
        for ar, vr, mr in zip(ref_adv, V, M, strict=True)
    ]
    if whiten:
        ref_adv = ref_whiten(ref_adv, M, EPS)
    torch.testing.assert_close(adv, as_t(ref_adv), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, as_t(ref_ret), rtol=1e-12, atol=1e-12)


def test_gae_skips_masked_gap():
    # the gap [1, 2] must be invisible: same result as the compacted sequence
    r = torch.tensor([[0.0, 5.0, 5.0, 1.0]], dtype=torch.float64)
    v = torch.tensor([[0.2, 9.0, 9.0, 0.4]], dtype=torch.float64)
    m = torch.tensor([[True, False, False, True]])
    adv, _ = call("gae", r, m, v, None, gamma=0.9, lam=0.7, whiten=False)
    a1 = 1.0 - 0.4
    a0 = (0.0 + 0.9 * 0.4 - 0.2) + 0.9 * 0.7 * a1
    torch.testing.assert_close(adv, as_t([[a0, 0.0, 0.0, a1]]))


def test_gae_requires_values():
    rewards, mask, _, _ = make_batch()
    with pytest.raises(ValueError, match=r"gae.*values"):
        call("gae", rewards, mask, None, None)


# ----------------------------------------------------------------- group estimators


def test_grpo_matches_reference():
    rewards, mask, _, groups = make_batch(2)
    scores, members = ref_groups(tl(rewards), tl(mask), tl(groups))
    row = []
    for i, g in enumerate(tl(groups)):
        xs = members.get(g, [0.0])
        std = statistics.stdev(xs) if len(xs) > 1 else 0.0
        row.append((scores[i] - statistics.fmean(xs)) / (std + EPS) if any(tl(mask)[i]) else 0.0)
    adv, ret = call("grpo", rewards, mask, None, groups)
    torch.testing.assert_close(adv, as_t(broadcast(row, tl(mask))), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, adv)
    assert adv.abs().max() > 0.5  # not trivially zero


def test_dr_grpo_and_grpo_without_std_match_reference():
    rewards, mask, _, groups = make_batch(3)
    scores, members = ref_groups(tl(rewards), tl(mask), tl(groups))
    row = [scores[i] - statistics.fmean(members[g]) if any(tl(mask)[i]) else 0.0 for i, g in enumerate(tl(groups))]
    expected = as_t(broadcast(row, tl(mask)))
    torch.testing.assert_close(call("dr_grpo", rewards, mask, None, groups)[0], expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        call("grpo", rewards, mask, None, groups, norm_by_std=False)[0], expected, rtol=1e-12, atol=1e-12
    )


def test_rloo_matches_leave_one_out_reference():
    rewards, mask, _, groups = make_batch(4)
    G, M = tl(groups), tl(mask)
    scores, _ = ref_groups(tl(rewards), M, G)
    row = []
    for i in range(len(G)):
        others = [scores[j] for j in range(len(G)) if j != i and G[j] == G[i] and any(M[j])]
        row.append(scores[i] - sum(others) / len(others) if others and any(M[i]) else 0.0)
    adv, _ = call("rloo", rewards, mask, None, groups)
    torch.testing.assert_close(adv, as_t(broadcast(row, M)), rtol=1e-12, atol=1e-12)


def test_group_edge_cases_are_zero():
    rewards, mask, _, groups = make_batch(5)
    for name in ["grpo", "dr_grpo", "rloo"]:
        adv, _ = call(name, rewards, mask, None, groups)
        assert torch.all(adv[5] == 0), name  # group of size 1
        assert torch.all(adv[6:8] == 0), name  # zero-variance group
        assert torch.all(adv[1] == 0), name  # all-masked row


def test_group_estimators_need_group_index():
    rewards, mask, _, _ = make_batch()
    for name in ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"]:
        with pytest.raises(ValueError, match="group_index"):
            call(name, rewards, mask, None, None)


# ----------------------------------------------------------------- REINFORCE++


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_reference(gamma):
    rewards, mask, _, _ = make_batch(6)
    R, M = tl(rewards), tl(mask)
    ret_ref = [ref_return_row(R[i], M[i], gamma) for i in range(len(R))]
    adv, ret = call("reinforce_pp", rewards, mask, None, None, gamma=gamma)
    torch.testing.assert_close(ret, as_t(ret_ref), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(adv, as_t(ref_whiten(ret_ref, M, EPS)), rtol=1e-12, atol=1e-12)


def ref_return_row_reset(r, m, gamma):
    """Return-to-go that restarts after every masked token (verl <= 0.8 REINFORCE++ loop)."""
    out = [0.0] * len(r)
    g = 0.0
    for t in reversed(range(len(r))):
        g = r[t] + gamma * g
        out[t] = g if m[t] else 0.0
        if not m[t]:
            g = 0.0  # also drops the (possibly NaN) reward of the masked token
    return out


def test_reinforce_pp_reset_at_gaps_hand_computed():
    # turn 1 = tokens 0-1, tool output = 2-3 (masked), turn 2 = 4-5 with the outcome reward
    r = torch.tensor([[0.5, 0.0, 9.0, 9.0, 0.0, 1.0]], dtype=torch.float64)
    m = torch.tensor([[True, True, False, False, True, True]])
    _, ret = call("reinforce_pp", r, m, None, None, gamma=0.5, reset_return_at_gaps=True)
    assert tl(ret) == [[0.5, 0.0, 0.0, 0.0, 0.5, 1.0]]  # turn 1 never sees the outcome
    _, ret = call("reinforce_pp", r, m, None, None, gamma=0.5)  # default: carried across the gap,
    assert tl(ret) == [[0.5 + 0.5 * 0.25, 0.5 * 0.5, 0.0, 0.0, 0.5, 1.0]]  # which costs no discount
    assert AdvantageConfig().reset_return_at_gaps is False


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_reset_at_gaps_matches_loop_reference(gamma):
    rewards, mask, _, _ = make_batch(9)
    R, M = tl(rewards), tl(mask)
    ret_ref = [ref_return_row_reset(R[i], M[i], gamma) for i in range(len(R))]
    adv, ret = call("reinforce_pp", rewards, mask, None, None, gamma=gamma, reset_return_at_gaps=True)
    torch.testing.assert_close(ret, as_t(ret_ref), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(adv, as_t(ref_whiten(ret_ref, M, EPS)), rtol=1e-12, atol=1e-12)
    # the batch has gaps, so resetting changes the result (this test can fail)
    carried = [ref_return_row(R[i], M[i], gamma) for i in range(len(R))]
    assert not torch.allclose(ret, as_t(carried))


@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_reinforce_pp_baseline_matches_reference(gamma):
    rewards, mask, _, groups = make_batch(7)
    R, M, G = tl(rewards), tl(mask), tl(groups)
    scores, members = ref_groups(R, M, G)
    shifted = []
    for i in range(len(R)):
        row = list(R[i])
        valid = [t for t in range(len(row)) if M[i][t]]
        if valid:
            row[valid[-1]] -= statistics.fmean(members[G[i]])
        shifted.append(row)
    ret_ref = [ref_return_row(shifted[i], M[i], gamma) for i in range(len(R))]
    adv, ret = call("reinforce_pp_baseline", rewards, mask, None, groups, gamma=gamma)
    torch.testing.assert_close(ret, as_t(ret_ref), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(adv, as_t(ref_whiten(ret_ref, M, EPS)), rtol=1e-12, atol=1e-12)
    if gamma == 1.0:  # return at the first valid token is R_i - group mean
        i = 3
        first = M[i].index(True)
        assert ret[i, first].item() == pytest.approx(scores[i] - statistics.fmean(members[G[i]]), abs=1e-12)


# ----------------------------------------------------------------- all estimators


@pytest.mark.parametrize("name", ALL)
def test_finite_zero_on_mask_and_shapes(name):
    rewards, mask, values, groups = make_batch(8)
    adv, ret = call(name, rewards, mask, values, groups)
    assert adv.shape == ret.shape == rewards.shape
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)
    assert torch.all(adv[1] == 0)


@pytest.mark.parametrize("name", ALL)
def test_fully_masked_batch_gives_zeros(name):
    r = torch.zeros(2, 3, dtype=torch.float64)
    m = torch.zeros(2, 3, dtype=torch.bool)
    adv, ret = call(name, r, m, torch.zeros_like(r), torch.tensor([0, 0]))
    assert tl(adv) == [[0.0] * 3] * 2 and tl(ret) == [[0.0] * 3] * 2


def test_all_estimators_share_one_signature():
    sigs = {str(inspect.signature(ADVANTAGE_ESTIMATORS.get(n))) for n in ALL}
    assert len(sigs) == 1
    params = inspect.signature(ADVANTAGE_ESTIMATORS.get("gae")).parameters.values()
    assert [p.name for p in params] == ["token_rewards", "response_mask", "values", "group_index", "config"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params)
    assert set(ADVANTAGE_ESTIMATORS.names()) == set(ALL)


def test_registry_error_names_registry_and_closest():
    with pytest.raises(ValueError) as e:
        ADVANTAGE_ESTIMATORS.get("reinforce_pp_basline")
    msg = str(e.value)
    assert "advantage estimator" in msg and "'reinforce_pp_basline'" in msg
    assert "Did you mean 'reinforce_pp_baseline'?" in msg and "'rloo'" in msg
    with pytest.raises(ValueError, match="Did you mean 'grpo'"):
        compute_advantages("gpro", token_rewards=torch.zeros(1, 1), response_mask=torch.ones(1, 1))


def test_config_is_keyword_only_and_validated():
    with pytest.raises(TypeError):
        AdvantageConfig(0.9)  # type: ignore[misc]
    with pytest.raises(ValueError, match="gamma"):
        AdvantageConfig(gamma=1.5)
    with pytest.raises(ValueError, match="eps"):
        AdvantageConfig(eps=0.0)


CHANGED = {"gamma": 0.9, "lam": 0.7, "whiten": False, "eps": 0.5, "norm_by_std": False, "reset_return_at_gaps": True}
"""A value other than the default for each AdvantageConfig field, far enough to move any output that reads it."""


@pytest.mark.parametrize("name", ALL)
def test_an_estimator_reads_exactly_the_fields_it_declares(name):
    """``EstimatorNeeds.reads`` decides which ``algorithm.advantage`` settings a run warns have no
    effect: changing a field outside it leaves the output as it was, and changing one inside moves it."""
    assert set(CHANGED) == {f.name for f in dataclasses.fields(AdvantageConfig)}
    gen = torch.Generator().manual_seed(0)
    token_rewards = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[:, 2] = False  # a gap inside each response (a tool's output), for reset_return_at_gaps
    mask[1, 4] = False
    inputs = dict(
        token_rewards=token_rewards,
        response_mask=mask,
        values=torch.randn(6, 5, generator=gen, dtype=torch.float64),
        group_index=torch.tensor([0, 0, 0, 1, 1, 1]),
    )
    base = compute_advantages(name, **inputs, config=AdvantageConfig())
    reads = ADVANTAGE_ESTIMATORS.info(name).reads
    assert reads is not None and reads <= set(CHANGED)
    for field, value in CHANGED.items():
        moved = compute_advantages(name, **inputs, config=AdvantageConfig(**{field: value}))
        same = all(torch.equal(a, b) for a, b in zip(base, moved, strict=True))
        assert same == (field not in reads), f"{name}: {field} {'is read' if same else 'moves the output'}"
