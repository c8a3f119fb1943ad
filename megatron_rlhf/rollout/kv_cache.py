"""The generation engine's KV cache: preallocated, one slot per running sequence.

Shapes: per local layer, keys and values (slots, max_len, groups_per_tp_rank, head_dim). A slot is
reused by the next waiting prompt as soon as its sequence finishes (continuous batching).
"""

from __future__ import annotations

import dataclasses

import torch


class KVCache:
    def __init__(
        self, *, num_layers: int, slots: int, max_len: int, groups: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (num_layers, slots, max_len, groups, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    def layer(self, layer_number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """megatron numbers layers from 1 within a pipeline stage's block."""
        return self.keys[layer_number - 1], self.values[layer_number - 1]

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


@dataclasses.dataclass
class DecodeStep:
    """What the cached attention needs for one forward: which slots, which positions."""

    cache: KVCache
    slots: torch.Tensor  # (b,) int64
    positions: torch.Tensor  # (b, sq) int64: the position of every query token of each row
    rotary_freqs: torch.Tensor  # (sq, b, 1, rotary_dim): rotary angles at those positions
    kv_len: int  # attend over cache positions [0, kv_len)
