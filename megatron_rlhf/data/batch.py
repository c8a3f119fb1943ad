"""Examples -> right-padded batch tensors.

Shape legend: B = examples, S = longest sequence (rounded up to ``pad_to_multiple_of``).

  SFT          input_ids (B, S) long, loss_mask (B, S) bool, attention_mask (B, S) bool,
               lengths (B,) long.
  preference   the same keys over 2B rows: rows 0..B-1 are the chosen sides, rows B..2B-1 the
               rejected ones; pair_index (2B,) long gives each row's pair (i for rows i and B+i),
               is_chosen (2B,) bool. One forward pass scores both sides.
  prompt       input_ids, attention_mask, lengths (no loss_mask).

``loss_mask[b, t]`` marks token t as a target, i.e. the label of position t-1: next-token losses
use ``logits[:, :-1]`` against ``input_ids[:, 1:]`` under ``loss_mask[:, 1:]``. Padding is
``pad_id`` in input_ids and False in both masks. ``pad_to_multiple_of`` keeps S divisible by,
e.g., the tensor-parallel size under sequence parallelism.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import TypeGuard

import numpy as np
import torch
from torch import Tensor

from .datasets import PreferenceExample, PromptExample, SFTExample

__all__ = ["flat_tensor", "pack_batch", "padded_ids", "right_padded"]

_NUMPY_DTYPES = {torch.int64: np.int64, torch.float32: np.float32}


def flat_tensor(rows: Iterable[Iterable[int | float]], dtype: torch.dtype) -> Tensor:
    """The rows' Python numbers one after the other, as one tensor (int64 or float32). numpy reads
    an iterator several times faster than ``torch.tensor`` reads a list (docs/benchmarks.md, "Host
    overheads")."""
    return torch.from_numpy(np.fromiter(itertools.chain.from_iterable(rows), dtype=_NUMPY_DTYPES[dtype]))


def right_padded(flat: Tensor, lengths: Tensor, width: int, value: int | float | bool) -> Tensor:
    """(rows, width) of ``flat``'s dtype: row i holds the next ``lengths[i]`` elements of ``flat``
    (the rows one after the other), then ``value``. One copy, however many rows: building a tensor
    per row costs tens of microseconds each, which a 256-sequence rollout notices."""
    out = torch.full((len(lengths), width), value, dtype=flat.dtype)
    out[torch.arange(width) < lengths[:, None]] = flat  # row-major order: the rows' order in flat
    return out


def padded_ids(flat_ids: Tensor, lengths: Tensor, pad_id: int, multiple: int = 1) -> dict[str, Tensor]:
    """``input_ids`` (rows of ``lengths`` tokens taken in turn from ``flat_ids``, right-padded with
    ``pad_id`` to the longest, rounded up to ``multiple``), ``attention_mask`` and ``lengths``."""
    width = -(-int(lengths.max()) // multiple) * multiple
    return {
        "input_ids": right_padded(flat_ids.long(), lengths, width, pad_id),
        "attention_mask": torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1),
        "lengths": lengths,
    }


def _pack(ids: Sequence[Tensor], masks: Sequence[Tensor] | None, pad_id: int, multiple: int) -> dict[str, Tensor]:
    lengths = torch.tensor([t.numel() for t in ids], dtype=torch.long)
    batch = padded_ids(torch.cat(list(ids)), lengths, pad_id, multiple)
    if masks is not None:
        batch["loss_mask"] = right_padded(torch.cat(list(masks)).bool(), lengths, batch["input_ids"].shape[1], False)
    return batch


def pack_batch(
    examples: Sequence[SFTExample] | Sequence[PreferenceExample] | Sequence[PromptExample],
    pad_id: int,
    *,
    pad_to_multiple_of: int = 1,
) -> dict[str, Tensor]:
    """Right-pad one kind of example into batch tensors (keys and shapes in the module docstring)."""
    if not examples:
        raise ValueError("pack_batch needs at least one example")
    if isinstance(pad_id, bool) or not isinstance(pad_id, int) or pad_id < 0:
        raise ValueError(f"pad_id must be a non-negative int, got {pad_id!r}")
    if isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be a positive int, got {pad_to_multiple_of!r}")
    kind = type(examples[0])
    odd = next((i for i, ex in enumerate(examples) if type(ex) is not kind), None)
    if odd is not None:
        raise TypeError(
            f"pack_batch got mixed examples: [0] is {kind.__name__}, [{odd}] is {type(examples[odd]).__name__}"
        )
    if _all_of(examples, SFTExample):
        return _pack([e.input_ids for e in examples], [e.loss_mask for e in examples], pad_id, pad_to_multiple_of)
    if _all_of(examples, PromptExample):
        return _pack([e.prompt_ids for e in examples], None, pad_id, pad_to_multiple_of)
    if _all_of(examples, PreferenceExample):
        sides = [e.chosen for e in examples] + [e.rejected for e in examples]
        batch = _pack([s.input_ids for s in sides], [s.loss_mask for s in sides], pad_id, pad_to_multiple_of)
        n = len(examples)
        batch["pair_index"] = torch.arange(n).repeat(2)
        batch["is_chosen"] = torch.arange(2 * n) < n
        return batch
    raise TypeError(f"pack_batch takes SFTExample, PreferenceExample or PromptExample, got {kind.__name__}")


def _all_of[E](examples: Sequence[object], kind: type[E]) -> TypeGuard[Sequence[E]]:
    return all(type(e) is kind for e in examples)
