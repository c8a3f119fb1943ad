"""The gradient check before each optimizer step (``engine.train._nonfinite_grads_anywhere``)."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_rlhf.training.train import _nonfinite_grads_anywhere


def _model_with_buffers(*grads: torch.Tensor) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        buffers=[types.SimpleNamespace(grad_data=g) for g in grads], expert_parallel_buffers=[]
    )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 4, 9])
def test_one_non_finite_value_in_any_buffer_is_found(world_of_one, bad: float, where: int) -> None:
    clean = torch.randn(7)
    dirty = torch.randn(10)
    dirty[where] = bad
    assert _nonfinite_grads_anywhere(_model_with_buffers(clean, dirty), torch.device("cpu")).item() != 0


def test_finite_buffers_pass_including_an_empty_one_and_extreme_finite_values(world_of_one) -> None:
    big = torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max, 0.0])
    model = _model_with_buffers(torch.randn(5), torch.empty(0), big)
    assert _nonfinite_grads_anywhere(model, torch.device("cpu")).item() == 0
    assert _nonfinite_grads_anywhere(_model_with_buffers(), torch.device("cpu")).item() == 0
