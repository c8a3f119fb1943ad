"""Forward-only and training passes through megatron-core's pipeline schedules.

A batch is a dict of tensors with a leading batch dimension: ``input_ids (B, S)`` right-padded,
``attention_mask (B, S)`` (1 on real tokens) and whatever the loss needs (masks, advantages, ...).
It is cut into micro-batches (pieces) by a token budget; by default several sequences are packed
into one row of a piece, each attending only to itself, so that padding is hardly computed. Each
piece is as wide as its fullest row, so shapes vary between micro-batches
(``variable_seq_lengths``). Outputs and losses read a piece's sequences through ``rows_of``, one
row per sequence as if unpacked.

A batch may carry ``logits_mask (B, S)``: the tokens whose log-probs are all that its loss or output
reads (an RL rollout's response, an SFT row's target). The LM head then runs only at the positions
that predict them (``logit_index``) and the model's output is ``(1, k, Vp/tp)``, one row per such
position, instead of ``(b, s, Vp/tp)``: a prompt's positions cost no LM head nor vocabulary pass.
``next_token_logprobs`` lays the result back out. Only for language-model outputs (not score heads).

A loss function takes ``(micro_batch, model_output)`` on the last pipeline stage and returns
``(numerator, denominator, metrics)``: with ``calculate_per_token_loss`` megatron sums both over
micro-batches and data-parallel ranks before dividing, so the loss does not depend on the layout or
on the micro-batch split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, overload

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from megatron_rlhf.parallel.layout import ParallelGroups
from megatron_rlhf.training.microbatch import pack_rows, plan_micro_batches

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import ColumnParallelLinear

Batch = dict[str, torch.Tensor]
Metric = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""One micro-batch's figure: a scalar, which the step reports as its mean over the micro-batches
(verl's way, PPO's figures), or a (sum, count) pair, which it reports as the ratio of the sums over
the whole batch: a share or a mean that does not move with how the batch was cut."""
LossOutput = tuple[torch.Tensor, torch.Tensor, dict[str, Metric]]
"""A loss function's (numerator, denominator, metrics) of one micro-batch."""
LossFn = Callable[[Batch, torch.Tensor], LossOutput]
OutputFn = Callable[[Batch, torch.Tensor], torch.Tensor]


def logits_only_at(batch: Batch, mask_key: str) -> Batch:
    """``batch`` with ``logits_mask`` set to ``batch[mask_key]`` (a rollout's policy tokens, an SFT
    target): the LM head runs only at the positions that predict those tokens. The mask may have
    gaps (a multi-turn response's tool results): they cost no LM head either."""
    return {**batch, "logits_mask": batch[mask_key]}


class MicroBatches(Sequence[Batch]):
    """The pieces of a plan, each laid out (``_piece``) and sent to the device when first read.

    Why lazily: laying a piece out is a few milliseconds of small host ops (16k tokens), and the
    GPU waited for all of a pass's pieces before its first kernel (docs/benchmarks.md, "Host
    overheads"). Read in order by the schedule, piece i+1 is laid out while the GPU
    runs piece i: its copy to the device is asynchronous from pinned memory, so the host never
    waits for the device here."""

    def __init__(self, batch: Batch, plan: list[list[list[int]]], lengths: list[int], device: torch.device) -> None:
        self.batch, self.plan, self.lengths, self.device = batch, plan, lengths, device
        self._built: dict[int, Batch] = {}

    def __len__(self) -> int:
        return len(self.plan)

    @overload
    def __getitem__(self, index: int) -> Batch: ...

    @overload
    def __getitem__(self, index: slice) -> list[Batch]: ...

    def __getitem__(self, index: int | slice) -> Batch | list[Batch]:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self.plan))[index]]
        index = range(len(self.plan))[index]
        if index not in self._built:
            self._built[index] = _piece(self.batch, self.plan[index], self.lengths, self.device)
        return self._built[index]

    @property
    def widest(self) -> int:
        """The largest piece's width, from the plan: nothing is built."""
        return max(_width(_fills(bins, self.lengths)) for bins in self.plan)

    @property
    def most_rows(self) -> int:
        return max(len(bins) for bins in self.plan)


def micro_batches(
    batch: Batch,
    max_tokens: int,
    groups: ParallelGroups,
    device: torch.device,
    *,
    group_size: int = 1,
    pack: bool = True,
) -> tuple[MicroBatches, torch.Tensor]:
    """Cut ``batch`` by token budget into pieces on ``device`` (``MicroBatches``, built as read);
    returns them and ``rows``: the batch row of each sequence of the pieces, in order (``rows_of``
    lays a piece's outputs out so).

    With ``pack`` (and ``group_size`` 1) several sequences share a row of a piece (``pack_rows``),
    so that nearly no padding is computed. Otherwise rows are planned in units of ``group_size``
    consecutive rows (e.g. 2 for chosen/rejected pairs, whose loss reads both rows of a pair in one
    micro-batch) that always stay in the same micro-batch, longest first, so that rows of similar
    length share a micro-batch; each piece is trimmed to its longest row.
    """
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    if len(lengths) % group_size:
        raise ValueError(f"batch of {len(lengths)} rows is not a multiple of group_size={group_size}")
    dp = groups.pg_collection.dp
    if pack and group_size == 1:
        plan = pack_rows(lengths, max_tokens, dp, device)
    else:
        unit_lengths = [max(lengths[i : i + group_size]) for i in range(0, len(lengths), group_size)]
        longest_first = sorted(range(len(unit_lengths)), key=lambda unit: -unit_lengths[unit])  # stable for ties
        units = plan_micro_batches([unit_lengths[u] for u in longest_first], max_tokens // group_size, dp, device)
        plan = [
            [[longest_first[p] * group_size + k] for p in positions for k in range(group_size)] for positions in units
        ]
    return MicroBatches(batch, plan, lengths, device), torch.tensor(
        [row for bins in plan for bin_rows in bins for row in bin_rows]
    )


def _fills(bins: list[list[int]], lengths: list[int]) -> list[int]:
    """Tokens in each row of a piece (its sequences one after the other)."""
    return [sum(lengths[row] for row in rows) for rows in bins]


def _width(fills: list[int]) -> int:
    """A piece's width: its fullest row (at least 1)."""
    return max(max(fills), 1)


def _piece(batch: Batch, bins: list[list[int]], lengths: list[int], device: torch.device) -> Batch:
    """One micro-batch: row i of the piece holds the sequences ``bins[i]`` one after the other.

    Per-token tensors (dim 1 the batch's width) are gathered into that layout, zero (and
    ``attention_mask`` 0) past a row's last sequence; per-row tensors are indexed by sequence. Added:
    ``position_ids`` restarting at 0 with each sequence (a row's padding continues its last
    sequence, as right padding does), ``segment_start`` (b, s) True at each sequence's first token,
    ``segment_bin``/``segment_offset``/``segment_length`` (n,) where each sequence lies, and when a
    row holds several sequences ``cu_seqlens`` (n + 1,) int32: where each sequence starts in the
    piece's tokens read row by row, then ``b * s`` (a row's tail padding belongs to its last
    sequence). Attention reads it (``packed_seq_params``): a token attends only to earlier tokens of
    its own sequence.
    """
    batch_width = batch["input_ids"].shape[1]
    fills = _fills(bins, lengths)
    width = _width(fills)
    segment_bin, segment_offset, span = [], [], []  # span: the columns a sequence owns in its row
    for b, rows in enumerate(bins):
        offset = 0
        for k, row in enumerate(rows):
            segment_bin.append(b)
            segment_offset.append(offset)
            span.append(lengths[row] if k < len(rows) - 1 else width - offset)
            offset += lengths[row]
    sequences = torch.tensor([row for rows in bins for row in rows])
    # The spans tile the piece row by row: each token's sequence, and the column where it starts.
    spans = torch.tensor(span)
    source_row = sequences.repeat_interleave(spans, output_size=len(bins) * width).view(len(bins), width)
    offsets = torch.tensor(segment_offset)
    start = offsets.repeat_interleave(spans, output_size=len(bins) * width).view(len(bins), width)
    position_ids = torch.arange(width) - start
    real = torch.arange(width) < torch.tensor(fills)[:, None]
    source_column = position_ids.clamp(max=batch_width - 1)
    piece = {}
    for key, value in batch.items():
        if value.dim() > 1 and value.shape[1] == batch_width:
            gathered = value[source_row, source_column]
            piece[key] = gathered.masked_fill(~real.view(*real.shape, *(1,) * (value.dim() - 2)), 0)
        else:
            piece[key] = value[sequences]
    piece["position_ids"] = position_ids
    piece["segment_start"] = (position_ids == 0) & real
    piece["segment_bin"], piece["segment_offset"] = torch.tensor(segment_bin), offsets
    piece["segment_length"] = torch.tensor(lengths)[sequences]
    if any(len(rows) > 1 for rows in bins):
        starts = piece["segment_bin"] * width + piece["segment_offset"]
        piece["cu_seqlens"] = torch.cat([starts, torch.tensor([len(bins) * width])]).int()
    if "logits_mask" in piece:
        piece.update(_logit_positions(piece))
    if device.type == "cpu":
        return piece
    return {key: value.pin_memory().to(device, non_blocking=True) for key, value in piece.items()}


def _logit_positions(piece: Batch) -> Batch:
    """Where a piece's LM head runs: ``logit_index`` (k,), the positions (flat over the piece's
    (b, s)) that predict a token of ``logits_mask`` within the same sequence, ``logit_target`` (k,)
    those tokens, and ``logit_index_sb`` (k,), the same positions in megatron's (s, b) order.
    Computed with the piece, on the host: no device sync to find them."""
    ids = piece["input_ids"]
    b, s = ids.shape
    predicts = torch.zeros(b, s, dtype=torch.bool)
    predicts[:, :-1] = piece["logits_mask"][:, 1:].bool() & ~piece["segment_start"][:, 1:]
    index = predicts.flatten().nonzero().flatten()
    return {
        "logit_index": index,
        "logit_target": ids.flatten()[index + 1],
        "logit_index_sb": index % s * b + index // s,
    }


def rows_of(piece: Batch, x: torch.Tensor) -> torch.Tensor:
    """(b, s, ...) in a piece's layout -> (n, s, ...): row i is sequence i of the piece (the order of
    ``micro_batches``'s ``rows``) from its first token, 0 past its end."""
    width = x.shape[1]
    columns = torch.arange(width, device=x.device)
    picked = x[piece["segment_bin"][:, None], (piece["segment_offset"][:, None] + columns).clamp(max=width - 1)]
    past_end = columns >= piece["segment_length"][:, None]
    return picked.masked_fill(past_end.view(*past_end.shape, *(1,) * (x.dim() - 2)), 0)


def run_schedule(
    model: GPTModel,
    groups: ParallelGroups,
    pieces: MicroBatches,
    step_fn: Callable[[Batch, torch.Tensor], object],
    *,
    forward_only: bool,
) -> list:
    """Run ``pieces`` through the pipeline; returns what ``step_fn`` gave per micro-batch
    (last stage only; empty elsewhere)."""
    config = model.config
    config.variable_seq_lengths = True

    rope = next((m for m in model.modules() if isinstance(m, RotaryEmbedding)), None)
    if config.sequence_parallel and "logits_mask" in pieces.batch:
        raise NotImplementedError("logits_mask with sequence parallelism: the LM head's input is split over TP there")

    def forward_step(data_iterator: Iterator[Batch], chunk: GPTModel) -> tuple[torch.Tensor, Callable[..., object]]:
        piece = next(data_iterator)
        selected = {"output_processor": partial(_logits_at, piece["logit_index_sb"])} if "logit_index" in piece else {}
        with _rotary_positions(rope, piece["position_ids"]):
            output = chunk(
                piece["input_ids"], piece["position_ids"], None, packed_seq_params=_packed_rows(piece), **selected
            )
        return output, partial(_call_step, step_fn, piece)

    return get_forward_backward_func(pp_size=groups.layout.pp)(
        forward_step_func=forward_step,
        data_iterator=iter(pieces),
        model=[model],
        num_microbatches=len(pieces),
        seq_length=pieces.widest,
        micro_batch_size=pieces.most_rows,
        forward_only=forward_only,
        # Forward-only passes collect whatever step_fn returns (log-probs, values) per micro-batch.
        collect_non_loss_data=forward_only,
        p2p_communicator=P2PCommunicator(pp_group=groups.pg_collection.pp, config=config),
        pg_collection=groups.pg_collection,
    )


def _logits_at(
    index_sb: torch.Tensor,
    *,
    hidden_states: torch.Tensor,
    output_layer: ColumnParallelLinear,
    output_weight: torch.Tensor | None,
    runtime_gather_output: bool | None,
    scale_logits: Callable[[torch.Tensor], torch.Tensor],
    **_: object,
) -> torch.Tensor:
    """megatron's ``output_processor``: the LM head over the final hidden states (s, b, h) at the
    positions ``index_sb`` only; (1, k, Vp/tp) logits."""
    picked = hidden_states.reshape(-1, hidden_states.shape[-1])[index_sb]
    logits, _ = output_layer(picked[:, None], weight=output_weight, runtime_gather_output=runtime_gather_output)
    return scale_logits(logits).transpose(0, 1)


def _packed_rows(piece: Batch) -> PackedSeqParams | None:
    """megatron's description of a piece's packed rows for attention (``SDPAttention``), in its
    (s, b) layout; the row width bounds every sequence's length."""
    if "cu_seqlens" not in piece:
        return None
    width = piece["input_ids"].shape[1]
    cu_seqlens = piece["cu_seqlens"]
    return PackedSeqParams(
        qkv_format="sbhd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=width, max_seqlen_kv=width
    )


@contextmanager
def _rotary_positions(rope: RotaryEmbedding | None, position_ids: torch.Tensor) -> Iterator[None]:
    """megatron's GPTModel rotates the token in column t by the angles of position t, whatever
    ``position_ids`` say (they feed only learned position embeddings): index its rotary table by
    ``position_ids`` (b, s) instead, so that each sequence of a packed row starts at position 0.
    The (s, b, 1, d) table broadcasts in megatron's rotary formula as its (s, 1, 1, d) one does."""
    if rope is None:
        yield
        return
    handle = rope.register_forward_hook(lambda module, args, table: table[position_ids.t(), 0, 0].unsqueeze(2))
    try:
        yield
    finally:
        handle.remove()


def _call_step(
    step_fn: Callable[[Batch, torch.Tensor], object], piece: Batch, output: torch.Tensor, non_loss_data: bool = False
) -> object:
    """megatron's loss function of a micro-batch (it passes ``non_loss_data`` on forward-only passes)."""
    return step_fn(piece, output)
