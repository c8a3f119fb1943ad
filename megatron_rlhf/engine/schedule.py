"""Forward-only and training passes through megatron-core's pipeline schedules.

A batch is a dict of tensors with a leading batch dimension: ``input_ids (B, S)`` right-padded,
``attention_mask (B, S)`` (1 on real tokens) and whatever the loss needs (masks, advantages, ...).
It is cut into micro-batches by a token budget, longest rows first; each micro-batch is trimmed to
its own longest sequence, so shapes vary between micro-batches (``variable_seq_lengths``).

A loss function takes ``(micro_batch, model_output)`` on the last pipeline stage and returns
``(numerator, denominator, metrics)``: with ``calculate_per_token_loss`` megatron sums both over
micro-batches and data-parallel ranks before dividing, so the loss does not depend on the layout or
on the micro-batch split.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from megatron_rlhf.engine.microbatch import plan_micro_batches
from megatron_rlhf.parallel.layout import ParallelGroups

Batch = dict[str, torch.Tensor]
LossFn = Callable[[Batch, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]
OutputFn = Callable[[Batch, torch.Tensor], torch.Tensor]


def micro_batches(
    batch: Batch, max_tokens: int, groups: ParallelGroups, device: torch.device, *, group_size: int = 1
) -> tuple[list[Batch], torch.Tensor]:
    """Cut ``batch`` by token budget, trim each piece to its longest row, move it to ``device``.

    Rows are planned in units of ``group_size`` consecutive rows (e.g. 2 for chosen/rejected pairs)
    that always stay in the same micro-batch. Units are taken longest first, so that rows of similar
    length share a micro-batch: with skewed lengths (responses of 16 to 512 tokens) the padding
    computed is then small wherever the budget packs several rows. Returns the pieces and ``rows``:
    the batch row at each position of the pieces concatenated.
    """
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    if len(lengths) % group_size:
        raise ValueError(f"batch of {len(lengths)} rows is not a multiple of group_size={group_size}")
    unit_lengths = [max(lengths[i : i + group_size]) for i in range(0, len(lengths), group_size)]
    longest_first = sorted(range(len(unit_lengths)), key=lambda unit: -unit_lengths[unit])  # stable for ties
    plan = plan_micro_batches([unit_lengths[u] for u in longest_first], max_tokens // group_size,
                              groups.pg_collection.dp, device)  # fmt: skip
    pieces, rows = [], []
    for positions in plan:
        indices = [longest_first[p] * group_size + k for p in positions for k in range(group_size)]
        rows += indices
        index = torch.tensor(indices)
        width = int(max(lengths[i] for i in indices))
        piece = {key: value[index][:, :width].to(device) if value.dim() > 1 else value[index].to(device)
                 for key, value in batch.items()}  # fmt: skip
        piece["position_ids"] = torch.arange(width, device=device).expand(len(indices), width)
        pieces.append(piece)
    return pieces, torch.tensor(rows)


def run_schedule(
    model: torch.nn.Module,
    groups: ParallelGroups,
    pieces: list[Batch],
    step_fn: Callable[[Batch, torch.Tensor], object],
    *,
    forward_only: bool,
) -> list:
    """Run ``pieces`` through the pipeline; returns what ``step_fn`` gave per micro-batch
    (last stage only; empty elsewhere)."""
    config = model.config
    config.variable_seq_lengths = True

    def forward_step(data_iterator, chunk):
        piece = next(data_iterator)
        output = chunk(piece["input_ids"], piece["position_ids"], None)
        return output, partial(_call_step, step_fn, piece)

    return get_forward_backward_func(pp_size=groups.layout.pp)(
        forward_step_func=forward_step,
        data_iterator=iter(pieces),
        model=[model],
        num_microbatches=len(pieces),
        seq_length=max(p["input_ids"].shape[1] for p in pieces),
        micro_batch_size=max(p["input_ids"].shape[0] for p in pieces),
        forward_only=forward_only,
        # Forward-only passes collect whatever step_fn returns (log-probs, values) per micro-batch.
        collect_non_loss_data=forward_only,
        p2p_communicator=P2PCommunicator(pp_group=groups.pg_collection.pp, config=config),
        pg_collection=groups.pg_collection,
    )


def _call_step(step_fn, piece, output, non_loss_data: bool = False):
    return step_fn(piece, output)
