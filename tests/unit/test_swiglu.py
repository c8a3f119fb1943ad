"""The SwiGLU autograd function of ``models/swiglu.py`` on CPU (its torch formulas; the GPU tier
checks the Triton kernel) against torch autograd of silu(gate) * up in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_rlhf.models.swiglu import swiglu_impl


def _value_and_grad(fn, x: torch.Tensor, upstream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = x.clone().requires_grad_()
    out = fn(leaf)
    (out * upstream).sum().backward()
    return out.detach(), leaf.grad


@pytest.mark.parametrize("shape", [(7, 2 * 11), (3, 4, 2 * 5)])
def test_swiglu_value_and_gradient_equal_autograd_of_silu_times_up(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    y = 3 * torch.randn(*shape, generator=g, dtype=torch.float64)
    upstream = torch.randn(*shape[:-1], shape[-1] // 2, generator=g, dtype=torch.float64)

    def plain(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    ours, reference = _value_and_grad(lambda x: swiglu_impl(x, None), y, upstream), _value_and_grad(plain, y, upstream)
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
