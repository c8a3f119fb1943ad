"""hybrid.offload: the memory figures the auto decision compares, against hand-derived values."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rlhf.hybrid.config import HybridConfig
from megatron_rlhf.hybrid.memory import GIB, decide_offload, kv_cache_bytes


@dataclasses.dataclass
class _Shape:
    """The fields of models.architecture.Architecture the estimate reads."""

    num_layers: int = 28
    num_query_groups: int = 2
    head_dim: int = 128


def test_kv_cache_bytes_hand_derived():
    # Qwen2.5-1.5B shape: 28 layers x 256 slots x 2 KV groups x 384 positions x (K and V) 2 x 128 x 2 bytes.
    arch = _Shape()
    assert (
        kv_cache_bytes(arch, generation_tp=1, slots=256, max_len=384, dtype=torch.bfloat16)
        == 28 * 256 * 2 * 384 * 2 * 128 * 2
    )
    assert (
        kv_cache_bytes(arch, generation_tp=2, slots=256, max_len=384, dtype=torch.float32)
        == 28 * 256 * 1 * 384 * 2 * 128 * 4
    )


@pytest.mark.parametrize(
    "needs_gib, free_gib, offload", [(10, 100, False), (90, 100, True), (85, 100, False), (87, 100, True)]
)
def test_auto_offloads_only_when_generation_does_not_fit(needs_gib, free_gib, offload):
    """Room = free - 10% of a 140 GiB device = free - 14 GiB."""
    decided, reason = decide_offload("auto", generation_needs=needs_gib * GIB, free=free_gib * GIB, total=140 * GIB)
    assert decided is offload
    assert f"generation needs {needs_gib:.2f} GiB, {free_gib - 14:.2f} GiB free" in reason


def test_always_and_never_are_not_measured():
    assert decide_offload("always", generation_needs=0, free=0, total=1) == (True, "hybrid.offload=always")
    assert decide_offload("never", generation_needs=10 * GIB, free=0, total=1) == (False, "hybrid.offload=never")


def test_unknown_mode_is_named():
    assert HybridConfig(offload="auto").errors() == []
    with pytest.raises(ValueError, match=r"^offload='sometimes' must be one of \['auto', 'always', 'never'\]"):
        HybridConfig(offload="sometimes")
