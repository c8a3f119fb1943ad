"""GPU tier: the sampler on a GPU against float64 and against the distribution it draws from.

Greedy and unfiltered sampling go through one Triton kernel (``rollout/sampling_kernel.py``),
top-k/top-p through another (rejection from the mass above a pivot) or, where FlashInfer is
installed, through its rejection samplers (``rollout/sampling_flashinfer.py``): the top-k/top-p
tests run on both. The torch path on the CPU is their reference for which tokens top-k/top-p keep."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rlhf.rollout import sampling_kernel
from megatron_rlhf.rollout.native_config import flashinfer_installed
from megatron_rlhf.rollout.sampling import SamplingParams, apply_top_k_top_p, sample

pytestmark = pytest.mark.gpu

FILTERED_SAMPLERS = [
    "triton",
    pytest.param(
        "flashinfer", marks=pytest.mark.skipif(not flashinfer_installed(), reason="flashinfer is not installed")
    ),
]
"""``rollout.engine.filtered_sampler`` values the top-k/top-p tests run with."""


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (4 * torch.randn(rows, vocab, generator=g)).to("cuda", torch.bfloat16)


@pytest.mark.parametrize(
    "temperature,top_p,sampler",
    [(0.0, 1.0, "triton"), (1.0, 1.0, "triton"), (0.7, 1.0, "triton")] + [(0.7, 0.9, s) for s in FILTERED_SAMPLERS],
)
@pytest.mark.parametrize("vocab", [1000, 151_936])
def test_sampled_logprobs_on_gpu_match_float64(temperature: float, top_p: float, sampler: str, vocab: int) -> None:
    """bf16 logits, a vocabulary with a partial last block (1000) and Qwen's (151,936): each
    log-prob is log softmax(z)[token] in float64 over the whole vocabulary; greedy is the argmax."""
    logits = _logits(64, vocab)
    generator = torch.Generator(device="cuda").manual_seed(1)
    tokens, logprobs = sample(logits, SamplingParams(temperature=temperature, top_p=top_p), generator, sampler)
    z = logits.double() / (temperature or 1.0)
    reference = torch.log_softmax(z, dim=-1).gather(-1, tokens[:, None])[:, 0]
    if temperature == 0.0:
        assert torch.equal(tokens, logits.float().argmax(dim=-1))
    assert (logprobs.double() - reference).abs().max().item() < 1e-5


def test_greedy_kernel_takes_the_lowest_index_on_ties_across_chunks() -> None:
    logits = _logits(4, 151_936)
    top = logits.max() + 1
    logits[0, [5, 140_000]] = top  # different chunks
    logits[1, [70_001, 70_002]] = top  # one block
    logits[2, 30_000:] = float("-inf")  # whole chunks of -inf: no NaN
    tokens, logprobs = sampling_kernel.sample_unfiltered(logits, 0.0, None)
    assert tokens[:2].tolist() == [5, 70_001]
    assert tokens.tolist() == logits.float().argmax(dim=-1).tolist()
    assert torch.isfinite(logprobs).all()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_kernel_draws_follow_softmax_and_repeat_with_the_generator(temperature: float) -> None:
    """200,000 rows of the same logits: each token's frequency within 5 standard errors of
    softmax(z / T) and Pearson's chi-square below its 0.999 quantile (5 degrees of freedom); the
    same generator seed gives the same tokens, another seed others."""
    values = torch.tensor([0.3, 2.0, -1.2, 0.9, 1.6, -0.5])
    rows = 200_000
    logits = values.expand(rows, -1).contiguous().cuda()
    params = SamplingParams(temperature=temperature)
    tokens, _ = sample(logits, params, torch.Generator(device="cuda").manual_seed(7))
    expected = torch.softmax(values.double() / temperature, dim=0).tolist()
    counts = torch.bincount(tokens.cpu(), minlength=len(values)).tolist()
    for v, p in enumerate(expected):
        assert abs(counts[v] / rows - p) < 5 * math.sqrt(p * (1 - p) / rows), (v, counts[v] / rows, p)
    chi2 = sum((counts[v] - rows * p) ** 2 / (rows * p) for v, p in enumerate(expected))
    assert chi2 < 20.515, (chi2, counts, expected)
    again, _ = sample(logits, params, torch.Generator(device="cuda").manual_seed(7))
    other, _ = sample(logits, params, torch.Generator(device="cuda").manual_seed(8))
    assert torch.equal(tokens, again) and not torch.equal(tokens, other)


def test_kernel_draws_across_chunks_and_blocks_of_a_full_vocabulary_follow_softmax() -> None:
    """Qwen's vocabulary (16 chunks of 9,496 columns, each several blocks): 24 tokens at z = 8 spread
    over every chunk, a -inf chunk and a -inf block, the rest at z = 0. 20,000 draws: each hot
    token's frequency and the rest's share within 5 standard errors; no -inf token is drawn."""
    vocab, rows = 151_936, 20_000
    values = torch.zeros(vocab)
    hot = torch.linspace(3, vocab - 3, 24).long()
    values[hot] = 8.0
    values[2 * 9_496 : 3 * 9_496] = float("-inf")  # a whole chunk
    values[50_000:52_048] = float("-inf")  # a block inside another chunk
    values[hot] = 8.0  # (one hot token lies in the -inf chunk)
    logits = values.cuda().expand(rows, -1)  # row stride 0: one row's memory
    tokens, logprobs = sample(logits, SamplingParams(temperature=1.0), torch.Generator(device="cuda").manual_seed(3))
    probabilities = torch.softmax(values.double(), dim=0)
    assert probabilities[tokens.cpu()].min() > 0
    counts = torch.bincount(tokens.cpu(), minlength=vocab).double()
    for token in hot.tolist():
        p = probabilities[token].item()
        assert abs(counts[token].item() / rows - p) < 5 * math.sqrt(p * (1 - p) / rows), token
    rest = 1 - probabilities[hot].sum().item()
    share = 1 - counts[hot].sum().item() / rows
    assert abs(share - rest) < 5 * math.sqrt(rest * (1 - rest) / rows)
    reference = torch.log(probabilities[tokens.cpu()])
    assert (logprobs.double().cpu() - reference).abs().max().item() < 1e-5


@pytest.mark.parametrize("sampler", FILTERED_SAMPLERS)
@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 0.9), (0.7, 0, 0.6), (1.0, 3, 1.0), (1.0, 4, 0.8), (1.3, 0, 0.3), (1.0, 1, 1.0), (1.0, 1, 0.8)],
)
def test_filtered_kernel_draws_follow_the_filtered_softmax(
    sampler: str, temperature: float, top_k: int, top_p: float
) -> None:
    """200,000 rows of the same logits (a tie at the top, a -inf): the tokens top-k/top-p keep on
    the CPU (``apply_top_k_top_p``, the sorted reference) are the only ones drawn, each within 5
    standard errors of the renormalised softmax, Pearson's chi-square below its 0.999 quantile;
    the log-probs are over the whole vocabulary; the same seed repeats the draw. top_k=1 keeps both
    tokens tied at the top."""
    values = torch.tensor([0.3, 2.0, -1.2, 0.9, 1.6, -0.5, 2.0, -float("inf")])
    rows = 200_000
    logits = values.expand(rows, -1).contiguous().cuda()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    tokens, logprobs = sample(logits, params, torch.Generator(device="cuda").manual_seed(11), sampler)
    kept = apply_top_k_top_p((values / temperature)[None], top_k, top_p)[0].double()
    expected = torch.softmax(kept, dim=0).tolist()
    counts = torch.bincount(tokens.cpu(), minlength=len(values)).tolist()
    assert all(counts[v] == 0 for v, p in enumerate(expected) if p == 0), (counts, expected)
    support = [v for v, p in enumerate(expected) if p > 0]
    for v in support:
        p = expected[v]
        assert abs(counts[v] / rows - p) < 5 * math.sqrt(p * (1 - p) / rows), (v, counts[v] / rows, p)
    chi2 = sum((counts[v] - rows * expected[v]) ** 2 / (rows * expected[v]) for v in support)
    quantiles = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458}  # chi-square 0.999
    assert len(support) == 1 or chi2 < quantiles[len(support) - 1], (chi2, counts, expected)
    reference = torch.log_softmax(values.double() / temperature, dim=0)[tokens.cpu()]
    assert (logprobs.double().cpu() - reference).abs().max().item() < 1e-6
    again, _ = sample(logits, params, torch.Generator(device="cuda").manual_seed(11), sampler)
    assert torch.equal(tokens, again)


@pytest.mark.parametrize("sampler", FILTERED_SAMPLERS)
def test_filtered_kernel_on_a_full_vocabulary_keeps_the_sorted_nucleus(sampler: str) -> None:
    """Qwen's vocabulary, 64 rows of random bf16 logits, top-p 0.9 and top-k 50 + top-p 0.9: every
    token drawn lies in the set the sorted CPU reference keeps for its row. And rows whose nucleus
    is 24 hot tokens spread over every block (the rest 12 below them, one -inf block): 20,000
    draws, each hot token within 5 standard errors of 1/24."""
    logits = _logits(64, 151_936)
    for top_k, top_p in ((0, 0.9), (50, 0.9)):
        params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
        tokens, _ = sample(logits, params, torch.Generator(device="cuda").manual_seed(2), sampler)
        kept = apply_top_k_top_p(logits.float().cpu(), top_k, top_p)
        assert torch.isfinite(kept.gather(-1, tokens.cpu()[:, None])).all(), (top_k, top_p)
    vocab, rows = 151_936, 20_000
    values = torch.full((vocab,), -12.0)
    hot = torch.linspace(3, vocab - 3, 24).long()
    values[50_000:52_048] = float("-inf")
    values[hot] = 0.0
    tokens, _ = sample(
        values.cuda().expand(rows, -1),
        SamplingParams(temperature=1.0, top_p=0.9),
        torch.Generator(device="cuda").manual_seed(4),
        sampler,
    )
    counts = torch.bincount(tokens.cpu(), minlength=vocab)
    assert counts[hot].sum().item() == rows  # the 24 hot tokens hold > 0.9 of the mass: the nucleus
    p = 1 / 24
    assert (counts[hot].double() / rows - p).abs().max().item() < 5 * math.sqrt(p * (1 - p) / rows)


@pytest.mark.parametrize("sampler", FILTERED_SAMPLERS)
def test_filtered_kernel_returns_on_rows_of_nan_or_all_minus_inf(sampler: str) -> None:
    """A row the kernel can never accept a draw from (all -inf, or NaN: a diverged model) ends after
    its bounded rounds with its first column and a non-finite log-prob, as the torch path does;
    before the bound, such a row kept the GPU in the kernel for good. A healthy row beside them is
    drawn as usual: its one dominant token holds the whole nucleus."""
    logits = torch.zeros(3, 151_936, device="cuda")
    logits[0] = float("-inf")
    logits[1] = float("nan")
    logits[2, 777] = 40.0
    tokens, logprobs = sample(
        logits, SamplingParams(temperature=1.0, top_p=0.9), torch.Generator(device="cuda").manual_seed(0), sampler
    )
    assert tokens.tolist() == [0, 0, 777]
    assert not torch.isfinite(logprobs[:2]).any() and torch.isfinite(logprobs[2])
