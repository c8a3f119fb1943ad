"""One optimizer step of a model on a batch, and forward-only passes, through the pipeline schedule.

Divergence guard: a step whose loss or gradients are not finite on any rank of the job is not
applied on any rank (``update_skipped`` = 1; the LR schedule and the step count do not move), so a
NaN never reaches the weights or the optimizer's moments.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_rlhf.debug import faults
from megatron_rlhf.models.roles import RoleModel
from megatron_rlhf.training.optim import TrainState
from megatron_rlhf.training.schedule import Batch, LossFn, OutputFn, micro_batches, rows_of, run_schedule


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def train_step(
    state: TrainState,
    batch: Batch,
    loss_fn: LossFn,
    *,
    max_tokens_per_micro_batch: int,
    group_size: int = 1,
    pack_sequences: bool = True,
) -> dict[str, float]:
    """Forward+backward over the batch's micro-batches, then one optimizer and LR-schedule step.
    ``pack_sequences``: several sequences share a row of a micro-batch (``micro_batches``).

    Returns metrics identical on every rank: the loss (numerator / denominator summed over all
    micro-batches and DP ranks), the gradient norm, the learning rate, and each metric of
    ``loss_fn`` over micro-batches and DP ranks (a scalar's mean, a (sum, count) pair's ratio of
    sums: ``schedule.Metric``).
    """
    role, model = state.role, state.ddp_model
    device = _device(model)
    per_micro_batch = _forward_backward(state, batch, loss_fn, max_tokens_per_micro_batch, group_size, pack_sequences)
    lr = state.optimizer.param_groups[0]["lr"]  # the rate this step uses (the scheduler moves it next)
    faults.on_gradients_reduced(_gradient_buffers(model), state.step)
    bad_grads = _nonfinite_grads_anywhere(model, device)  # queued now, read after the metrics' sync
    metrics = _reduce_metrics(per_micro_batch, role, device)
    grad_norm: float | None = float("nan")
    update_ok = math.isfinite(metrics["loss"]) and bad_grads.item() == 0.0
    if update_ok:
        update_ok, grad_norm, _ = state.optimizer.step()
    if update_ok:
        state.scheduler.step(increment=1)
        state.step += 1
    metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    metrics["lr"] = lr
    metrics["update_skipped"] = 0.0 if update_ok else 1.0
    return metrics


def warm_up_step(
    state: TrainState,
    batch: Batch,
    loss_fn: LossFn,
    *,
    max_tokens_per_micro_batch: int,
    group_size: int = 1,
    pack_sequences: bool = True,
) -> None:
    """``train_step``'s forward and backward with no optimizer step, the gradients discarded: the
    first step's one-time costs (kernel compilation, the allocator growing to the step's peak) are
    paid here, and the model, its optimizer and the schedule are left exactly as they were."""
    _forward_backward(state, batch, loss_fn, max_tokens_per_micro_batch, group_size, pack_sequences)
    warm_up_gradient_reads(state)
    state.ddp_model.zero_grad_buffer()
    state.optimizer.zero_grad()


def warm_up_gradient_reads(state: TrainState) -> None:
    """What ``train_step`` runs over the gradients before the optimizer's update, on whatever
    gradients they hold: the non-finite check, the copy to the optimizer's fp32 gradients and their
    norm. On a GPU each of their kernels loads at its first launch (75 ms for the norm's, 32 ms for
    the check's on an H200), which otherwise falls in step 1. The update itself (Adam) cannot run
    without moving the weights. The optimizer's fp32 gradients are left for ``zero_grad``; the fp16
    loss scaler, which counts every ``prepare_grads`` as a step without overflow, is restored."""
    model = state.ddp_model
    _nonfinite_grads_anywhere(model, _device(model))
    inner = getattr(state.optimizer, "chained_optimizers", [state.optimizer])
    scalers = [scaler for scaler in (getattr(o, "grad_scaler", None) for o in inner) if scaler is not None]
    saved = [scaler.state_dict() for scaler in scalers]
    state.optimizer.prepare_grads()
    state.optimizer.get_grad_norm()
    for scaler, scaler_state in zip(scalers, saved, strict=True):
        scaler.load_state_dict(scaler_state)


def _forward_backward(
    state: TrainState, batch: Batch, loss_fn: LossFn, max_tokens: int, group_size: int, pack: bool
) -> list:
    """Gradients of ``batch`` in the model's (zeroed) gradient buffers, reduced over DP; returns the
    loss step's per-micro-batch figures (last pipeline stage)."""
    model = state.ddp_model
    pieces, _ = micro_batches(batch, max_tokens, state.role.groups, _device(model), group_size=group_size, pack=pack)
    model.train()
    model.zero_grad_buffer()
    state.optimizer.zero_grad()
    return run_schedule(model, state.role.groups, pieces, _loss_step(loss_fn), forward_only=False)


def _gradient_buffers(model: DistributedDataParallel) -> list[torch.Tensor]:
    """The flat buffers that hold the model's gradients (dense and expert-parallel)."""
    return [buffer.grad_data for buffer in model.buffers + model.expert_parallel_buffers]


def _nonfinite_grads_anywhere(model: DistributedDataParallel, device: torch.device) -> torch.Tensor:
    """Collective over the whole job: a device flag (1,), nonzero if some rank holds a non-finite
    value in its gradient buffers (checked before the optimizer reads them; a NaN in any rank's
    local gradients reaches the reduced gradients of some rank). Not read here: the caller reads
    it after its next host sync, so the check runs on the GPU meanwhile."""
    # The smallest and largest gradient of each buffer (a NaN anywhere makes both NaN): one read of
    # the buffers and no host sync before the all-reduce, where ``isfinite(...).all()`` wrote and
    # read a bool copy of each.
    extremes = [x for grads in _gradient_buffers(model) if grads.numel() for x in torch.aminmax(grads)]
    bad = torch.zeros(1, device=device)
    if extremes:
        bad += (~torch.isfinite(torch.stack(extremes))).any()
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad


def _loss_step(
    loss_fn: LossFn,
) -> Callable[[Batch, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
    def step(piece: Batch, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        numerator, denominator, metrics = loss_fn(piece, output)
        reported: dict[str, torch.Tensor] = {}
        for name, value in {**metrics, "loss": (numerator, denominator)}.items():
            if isinstance(value, tuple):
                for suffix, part in zip(RATIO_PARTS, value, strict=True):
                    reported[name + suffix] = part.detach().float()
            else:
                reported[name] = value.detach().float()
        return numerator, denominator.to(torch.int), reported

    return step


RATIO_PARTS = (":sum", ":count")
"""The suffixes of a (sum, count) metric's two parts, summed apart (``_loss_step``)."""


def _reduce_metrics(
    per_micro_batch: list[dict[str, torch.Tensor]], role: RoleModel, device: torch.device
) -> dict[str, float]:
    """Sum over micro-batches on the last stage, over DP, then share along the pipeline; a scalar
    metric is then divided by the micro-batches, a (sum, count) one by its summed count."""
    pg = role.groups.pg_collection
    names = sorted(per_micro_batch[0]) if per_micro_batch else []
    # Stages other than the last have no metrics; the last stage's names are agreed on first.
    name_list = [names]
    dist.broadcast_object_list(name_list, src=dist.get_global_rank(pg.pp, role.groups.layout.pp - 1), group=pg.pp)
    names = name_list[0]
    totals = torch.zeros(len(names) + 1, dtype=torch.float64, device=device)
    for metrics in per_micro_batch:
        totals[:-1] += torch.stack([metrics[n].to(device, torch.float64) for n in names])
        totals[-1] += 1
    dist.all_reduce(totals, group=pg.dp)
    dist.all_reduce(totals, group=pg.pp)  # only the last stage contributes
    values = dict(zip(names, totals[:-1].tolist(), strict=True))
    micro_batch_count = max(totals[-1].item(), 1.0)
    sums, counts = RATIO_PARTS
    result: dict[str, float] = {}
    for name, value in values.items():
        if name.endswith(sums):
            ratio = name.removesuffix(sums)
            result[ratio] = value / max(values[ratio + counts], 1.0)
        elif not name.endswith(counts):
            result[name] = value / micro_batch_count
    return result


@torch.no_grad()
def forward_pass(
    role: RoleModel, batch: Batch, output_fn: OutputFn, *, max_tokens_per_micro_batch: int, pack_sequences: bool = True
) -> torch.Tensor | None:
    """Apply ``output_fn(micro_batch, model_output)`` to every micro-batch; results are laid out one
    row per sequence (``rows_of``), padded back to the batch's width and concatenated (B, S, ...)
    in the batch's row order on the last pipeline stage, None elsewhere. Positions past a row's
    last token hold 0: what a model computes there depends on which rows shared its micro-batch,
    so on the layout and the budget."""
    model = role.model
    device = _device(model)
    width = batch["input_ids"].shape[1]
    pieces, rows = micro_batches(batch, max_tokens_per_micro_batch, role.groups, device, pack=pack_sequences)
    was_training = model.training
    model.eval()
    outputs = run_schedule(model, role.groups, pieces, output_fn, forward_only=True)
    model.train(was_training)
    if not role.groups.is_last_stage:
        return None
    padded = [
        torch.nn.functional.pad(rows_of(piece, output), (0, 0) * (output.dim() - 2) + (0, width - output.shape[1]))
        for piece, output in zip(pieces, outputs, strict=True)
    ]
    return torch.cat(padded)[torch.argsort(rows).to(device)]


def forward_outputs(role: RoleModel, input_ids: torch.Tensor, micro_batch_size: int) -> torch.Tensor | None:
    """The raw model output for full-length rows ``input_ids (B, S)``: logits (B, S, V) over the real
    vocabulary (TP shards gathered, padding stripped) or scores (B, S, num_labels); last stage only."""
    pg, arch = role.groups.pg_collection, role.arch

    def output(piece: Batch, out: torch.Tensor) -> torch.Tensor:
        if arch.score_head:
            return out
        return gather_from_tensor_model_parallel_region(out, group=pg.tp)[..., : arch.vocab_size]

    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    return forward_pass(role, batch, output, max_tokens_per_micro_batch=micro_batch_size * input_ids.shape[1])


def forward_all_rows(
    role: RoleModel, batch: Batch, output_fn: OutputFn, *, max_tokens_per_micro_batch: int, pack_sequences: bool = True
) -> torch.Tensor:
    """(B, S) float32 outputs of every row, on every rank, on the CPU.

    Each data-parallel rank runs a contiguous 1/dp of the rows (B must divide evenly), the shares
    are gathered over DP on the last pipeline stage and broadcast along the pipeline. Used where
    every rank needs the whole batch's figures (rewards, reference log-probs, values of a rollout).
    """
    groups, pg = role.groups, role.groups.pg_collection
    rows, width = batch["input_ids"].shape
    dp = groups.layout.dp
    if rows % dp:
        raise ValueError(f"{rows} rows cannot be split evenly over the {role.role}'s {dp} data-parallel ranks")
    share = rows // dp
    mine = {key: value[groups.dp_rank * share : (groups.dp_rank + 1) * share] for key, value in batch.items()}
    local = forward_pass(
        role, mine, output_fn, max_tokens_per_micro_batch=max_tokens_per_micro_batch, pack_sequences=pack_sequences
    )
    device = _device(role.model)
    everything = torch.empty((rows, width), dtype=torch.float32, device=device)
    if local is not None:
        dist.all_gather(list(everything.split(share)), local.float().contiguous(), group=pg.dp)
    dist.broadcast(everything, src=dist.get_global_rank(pg.pp, groups.layout.pp - 1), group=pg.pp)
    return everything.cpu()
