"""OptimConfig.cpu_offload_fraction: its range and what it needs, named in the message."""

from __future__ import annotations

import pytest

from megatron_rlhf.training.optim import OptimConfig


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_fraction_in_range_is_accepted(fraction: float) -> None:
    assert OptimConfig(cpu_offload_fraction=fraction).errors() == []


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_fraction_out_of_range_is_named(fraction: float) -> None:
    with pytest.raises(ValueError, match=rf"^cpu_offload_fraction={fraction} must be in \[0, 1\]$"):
        OptimConfig(cpu_offload_fraction=fraction)


def test_offload_needs_the_distributed_optimizer() -> None:
    with pytest.raises(ValueError, match=r"^cpu_offload_fraction=1.0 needs distributed_optimizer=true$"):
        OptimConfig(cpu_offload_fraction=1.0, distributed_optimizer=False)
