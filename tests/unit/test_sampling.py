"""Token sampler (rollout/sampling.py) vs distributions and log-probs computed independently here."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rlhf.rollout import sampling_flashinfer
from megatron_rlhf.rollout.native_config import NativeEngineConfig, flashinfer_installed
from megatron_rlhf.rollout.sampling import SamplingParams, apply_top_k_top_p, sample
from megatron_rlhf.training.logprobs import token_logprobs_and_entropy

# Unsorted on purpose (the sampler must not rely on index order). Cumulative nucleus masses are
# kept >= 0.01 away from every top_p used below (asserted in `expected_distribution`).
LOGITS = [0.3, 2.0, -1.2, 0.9, 1.6, -0.5]
N = 200_000
# 0.999 quantiles of the chi-square distribution, by degrees of freedom (scipy.stats.chi2.ppf).
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def expected_distribution(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """float64, plain Python: softmax(logits / T) restricted to top-k then the top-p nucleus, renormalised."""
    z = [x / temperature for x in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    kept = order[:top_k] if 0 < top_k < len(z) else order
    total = sum(math.exp(z[i]) for i in kept)
    if top_p < 1:
        nucleus, mass = [], 0.0
        for i in kept:
            nucleus.append(i)
            mass += math.exp(z[i]) / total
            if mass >= top_p:
                assert mass - top_p > 0.01, "test logits put the nucleus boundary too close to top_p"
                break
            assert top_p - mass > 0.01, "test logits put the nucleus boundary too close to top_p"
        kept = nucleus
    total = sum(math.exp(z[i]) for i in kept)
    return [math.exp(z[i]) / total if i in kept else 0.0 for i in range(len(z))]


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [
        (1.0, 0, 1.0),
        (0.5, 0, 1.0),
        (2.0, 0, 1.0),
        (1.0, 3, 1.0),
        (1.0, 0, 0.7),
        (1.0, 4, 0.8),
        (2.0, 0, 0.8),  # top-p on the tempered distribution
        (0.7, 3, 0.9),
    ],
)
def test_empirical_frequencies_match_expected(temperature: float, top_k: int, top_p: float) -> None:
    expected = expected_distribution(LOGITS, temperature, top_k, top_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    logits = torch.tensor(LOGITS).expand(N, -1)
    tokens, _ = sample(logits, params, torch.Generator().manual_seed(1234))
    assert tokens.shape == (N,) and tokens.dtype == torch.int64
    counts = torch.bincount(tokens, minlength=len(LOGITS)).tolist()
    kept = [v for v, p in enumerate(expected) if p > 0]
    for v, p in enumerate(expected):
        if p == 0:
            assert counts[v] == 0, f"filtered-out token {v} was sampled {counts[v]} times"
        else:  # each frequency within 5 standard errors (two-sided tail 5.7e-7 per token)
            assert abs(counts[v] / N - p) < 5 * math.sqrt(p * (1 - p) / N), (v, counts[v] / N, p)
    if len(kept) > 1:  # and jointly: Pearson chi-square below its 0.999 quantile
        chi2 = sum((counts[v] - N * expected[v]) ** 2 / (N * expected[v]) for v in kept)
        assert chi2 < CHI2_999[len(kept) - 1], (chi2, counts, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.3, 5, 1.0), (0.8, 0, 0.5), (1.0, 7, 0.9)]
)
def test_logprobs_are_full_vocabulary_before_filtering(dtype, temperature, top_k, top_p) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (2.0 * torch.randn(64, 50, generator=gen)).to(dtype)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    tokens, logprobs = sample(logits, params, torch.Generator().manual_seed(7))
    assert logprobs.shape == (64,) and logprobs.dtype == torch.float32
    ref = torch.log_softmax(logits.double() / temperature, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs.double(), ref, rtol=0, atol=1e-6)
    # Exactly what the trainer recomputes (so the first PPO ratio is 1).
    trainer, _ = token_logprobs_and_entropy(
        logits[:, None, :],
        tokens[:, None],
        tp_group=None,
        vocab_size=50,
        temperature=temperature,
        compute_entropy=False,
    )
    torch.testing.assert_close(logprobs, trainer[:, 0], rtol=0, atol=1e-6)
    if top_k or top_p < 1:  # filtering changes which tokens may be drawn, never their log-prob
        filtered = apply_top_k_top_p(logits.float() / temperature, top_k, top_p)
        assert torch.isfinite(filtered.gather(-1, tokens[:, None])).all()
        assert (torch.isinf(filtered).sum(-1) > 0).all()


def test_greedy_is_argmax_lowest_index_on_ties_and_consumes_no_randomness() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -3.0]], dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    state = gen.get_state()
    tokens, logprobs = sample(logits, SamplingParams(temperature=0.0, top_k=2, top_p=0.5), gen)
    assert tokens.tolist() == [1, 0, 2]
    assert torch.equal(gen.get_state(), state)
    ref = torch.log_softmax(logits.double(), dim=-1).gather(-1, tokens[:, None]).squeeze(-1)  # at T=1
    torch.testing.assert_close(logprobs.double(), ref, rtol=0, atol=1e-6)
    tokens_none, _ = sample(logits, SamplingParams(temperature=0.0), None)
    assert torch.equal(tokens_none, tokens)


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    logits = torch.zeros(256, 1000)  # uniform: maximal entropy
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=500)
    a, la = sample(logits, params, torch.Generator().manual_seed(11))
    b, lb = sample(logits, params, torch.Generator().manual_seed(11))
    c, _ = sample(logits, params, torch.Generator().manual_seed(12))
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert (a != c).sum() > 200  # independent uniform draws over >= 500 tokens almost never agree
    gen = torch.Generator().manual_seed(11)
    first, _ = sample(logits, params, gen)
    second, _ = sample(logits, params, gen)  # the generator advances between calls
    assert torch.equal(first, a) and (first != second).sum() > 200


def test_top_k_keeps_ties_and_top_p_keeps_at_least_one() -> None:
    z = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0], [10.0, 0.0, 0.0, 0.0, 0.0]])
    inf = float("-inf")
    # top_k=2: the 2nd largest value (2.0) is tied, so both 2.0s are kept.
    assert apply_top_k_top_p(z, 2, 1.0).tolist() == [[inf, 3.0, 2.0, 2.0, inf], [10.0, 0.0, 0.0, 0.0, 0.0]]
    # top_p tiny: only the most likely token(s); the dominant token alone on row 2.
    assert apply_top_k_top_p(z, 0, 1e-6).tolist() == [[inf, 3.0, inf, inf, inf], [10.0, inf, inf, inf, inf]]
    # Ties at the nucleus boundary are all kept: uniform row, top_p=0.3 -> every token.
    uniform = torch.zeros(1, 4)
    assert apply_top_k_top_p(uniform, 0, 0.3).tolist() == [[0.0] * 4]
    assert torch.equal(apply_top_k_top_p(z, 0, 1.0), z) and torch.equal(apply_top_k_top_p(z, 5, 1.0), z)
    # Permutation of the vocabulary permutes the result (no dependence on index order).
    perm = torch.tensor([4, 2, 0, 3, 1])
    assert torch.equal(apply_top_k_top_p(z[:, perm], 3, 0.6), apply_top_k_top_p(z, 3, 0.6)[:, perm])


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"n": 0}, "n"),
        ({"stop_token_ids": (1, -2)}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}="):
        SamplingParams(**kwargs)


def test_params_defaults_and_frozen() -> None:
    p = SamplingParams(stop_token_ids=[2, 3])
    assert p.stop_token_ids == (2, 3) and p.temperature == 1.0 and p.n == 1 and not p.greedy
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]
    with pytest.raises(TypeError):
        SamplingParams(1.0)  # type: ignore[misc]  # keyword-only


@pytest.mark.skipif(flashinfer_installed(), reason="the refusal where flashinfer is absent")
def test_the_flashinfer_sampler_is_refused_up_front_where_flashinfer_is_absent() -> None:
    """``rollout.engine.filtered_sampler=flashinfer`` fails when the config is built, not at the
    first top-k/top-p draw; auto (the default) keeps the Triton kernel without a word."""
    with pytest.raises(ValueError, match=r"filtered_sampler='flashinfer', but flashinfer is not importable"):
        NativeEngineConfig(filtered_sampler="flashinfer")
    with pytest.raises(ValueError, match=r"filtered_sampler"):
        NativeEngineConfig(filtered_sampler="cuda")  # type: ignore[arg-type]
    assert NativeEngineConfig().filtered_sampler == "auto"
    assert not sampling_flashinfer.chosen("auto") and not sampling_flashinfer.chosen("triton")
