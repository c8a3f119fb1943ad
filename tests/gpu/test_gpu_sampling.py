"""GPU tier: the sampler's fused (compiled) log-prob kernels on bf16 logits against float64."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.rollout.sampling import SamplingParams, sample


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_sampled_logprobs_on_gpu_match_float64(temperature: float) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(64, 1000, generator=g)).to("cuda", torch.bfloat16)
    generator = torch.Generator(device="cuda").manual_seed(1)
    tokens, logprobs = sample(logits, SamplingParams(temperature=temperature), generator)
    z = logits.double() / (temperature or 1.0)
    reference = torch.log_softmax(z, dim=-1).gather(-1, tokens[:, None])[:, 0]
    if temperature == 0.0:
        assert torch.equal(tokens, logits.float().argmax(dim=-1))
    assert (logprobs.double() - reference).abs().max().item() < 1e-5
