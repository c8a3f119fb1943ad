"""The generation engine's KV cache: preallocated, one slot per running sequence.

Shapes: per local layer, one tensor (slots, groups_per_tp_rank, max_len, 2 * head_dim) holding
each position's key (first half of the last dim) and value (second half) side by side, so that one
write stores both. A slot's positions of one KV group are contiguous, so decode attention reads the
cache slice [0, kv_len) of all slots in place (models/attention.py). A slot is reused by the next
waiting prompt as soon as its sequence finishes (continuous batching).
"""

from __future__ import annotations

import dataclasses

import torch


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        slots: int,
        max_len: int,
        groups: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.data = torch.zeros(num_layers, slots, groups, max_len, 2 * head_dim, dtype=dtype, device=device)
        self.slots, self.groups, self.max_len = slots, groups, max_len

    def layer(self, layer_number: int) -> torch.Tensor:
        """megatron numbers layers from 1 within a pipeline stage's block."""
        return self.data[layer_number - 1]


@dataclasses.dataclass
class DecodeStep:
    """What the cached attention needs for one forward: which slots, which positions.

    A prefill starts every row at position 0 and attends over its own keys, unless ``continued``:
    then each row's tokens follow what its slot already holds (a later turn of a multi-turn
    trajectory) and attend over the slot's cache. A decode step has one row per cache slot, in slot
    order, and attends over the cache.
    """

    cache: KVCache
    slots: torch.Tensor  # (b,) int64
    positions: torch.Tensor  # (b, sq) int64: the position of every query token of each row
    cos: torch.Tensor  # (sq, b, 1, hn) in the model dtype: rotary cosines at those positions
    sin: torch.Tensor
    prefill: bool
    kv_len: int | None  # decode: attend over cache positions [0, kv_len) at most
    window: int | None  # a sliding window's size (megatron's convention), or None
    continued: bool = False  # a prefill whose rows start after their slot's cached tokens
