"""LoRA adapters on megatron's tensor-parallel linears, equal to PEFT's on the HF model.

An adapted linear keeps its class, its weight and its parameter names; its adapter is a module beside
it (``linear_qkv_lora``: megatron's DDP buckets it and the optimizer holds it) whose output a forward
hook on the linear adds to the linear's. Not a child of the linear: megatron checkpoints a linear's
whole state dict with its own rule, which would save a TP-split adapter as replicated (TP rank 0's
shard only); the adapter's ``sharded_state_dict`` shards it like the base. The base weights are
frozen: megatron then runs them through ``LinearWithFrozenWeight`` (no weight gradient, no saved
input) and DDP gives them no gradient buffer.

Fused linears: PEFT adapts q_proj, k_proj, v_proj (gate_proj, up_proj) separately, each with its own
A (rank, in) and B (out, rank). megatron fuses them into one output, laid out per query group as
[q rows of the group, k rows, v rows] (``hf_weights``' "qkv" kind) and, for fc1, as
[gate shard; up shard]. The adapter keeps one A and one B per PEFT name and scatters each B into its
rows of a zero "fused B" of shape (local out, targets * rank), so one pair of GEMMs gives all the
targets' contributions and ``merged_delta`` is the local shard of the fused weight's update.

Tensor parallelism (sequence parallelism off, as in this stack):
* column-parallel (linear_qkv, linear_fc1): A replicated, B split along the output like the base.
  ``x @ A^T`` (tokens, rank) is complete on every rank; it passes through
  ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward) before B, so the
  gradient of A and of x sums every rank's share of the output.
* row-parallel (linear_proj, linear_fc2): A split along the input like the base, B replicated.
  ``x_local @ A_local^T`` is a partial sum: ``reduce_from_tensor_model_parallel_region`` all-reduces
  it (tokens, rank) before B, a tensor ``hidden / rank`` times smaller than the base's output, so the
  base's own all-reduce stays untouched.

Merging (generation, which reads megatron's weights directly and would skip the hooks):
``merge_adapters`` adds each adapter's delta into its weight and switches the adapters off;
``unmerge_adapters`` copies back the base weights it kept (the only bit-exact way back: a bf16
``W + delta - delta`` is not W). ``mirror_adapters`` gives a copy of the model in another layout
the same adapters, so that a resharding copy moves them with the weights (``hybrid/reshard.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import zlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.models.lora_config import TARGET_LINEARS, LoraConfig, target_shapes

ADAPTER_SUFFIX = "_lora"
"""An adapter is the module ``<linear>_lora`` beside its linear (``self_attention.linear_qkv_lora``)."""


@dataclasses.dataclass(frozen=True)
class FusedRows:
    """How a linear's local output rows are made of PEFT modules: ``repeats`` blocks (query groups of
    this rank for linear_qkv, else 1), each the concatenation of ``parts`` (name, rows per block)."""

    repeats: int
    parts: tuple[tuple[str, int], ...]


def fused_rows(linear: str, arch: Architecture, tp: int) -> FusedRows:
    """The local output layout of megatron's ``linear`` at tensor-parallel size ``tp``."""
    names = tuple(name for name, owner in TARGET_LINEARS.items() if owner == linear)
    if not names:
        raise ValueError(f"no LoRA layout for {linear!r}; expected one of {sorted(set(TARGET_LINEARS.values()))}")
    shapes = target_shapes(arch)
    if shapes[names[0]].input_split:  # row-parallel: every rank has the whole output
        return FusedRows(1, tuple((name, shapes[name].out_features) for name in names))
    # linear_qkv interleaves q, k and v per query group; linear_fc1 is this rank's gate rows, then up rows
    blocks = arch.num_query_groups if linear == "linear_qkv" else tp
    return FusedRows(blocks // tp, tuple((name, shapes[name].out_features // blocks) for name in names))


class LoraAdapter(torch.nn.Module):
    """The adapters of one megatron linear: ``lora_A[name]`` (rank, local in), ``lora_B[name]``
    (local out rows of ``name``, rank) per adapted PEFT name, PEFT's names and shapes."""

    def __init__(
        self,
        rows: FusedRows,
        targets: tuple[str, ...],
        *,
        in_features: int,
        cfg: LoraConfig,
        input_is_split: bool,
        tp_group: torch.distributed.ProcessGroup,
        init: torch.Generator,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.rows, self.targets, self.rank = rows, targets, cfg.rank
        self.scaling, self.input_is_split, self.tp_group = cfg.scaling, input_is_split, tp_group
        self.dropout = cfg.dropout
        self.enabled = True
        tp, tp_rank = tp_group.size(), tp_group.rank()
        full_in = in_features * tp if input_is_split else in_features
        # PEFT's A init (nn.Linear's kaiming_uniform(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))), drawn for
        # the full matrix from a generator of its own, then sliced: every TP rank and every layout
        # starts from the same adapters. B starts at zero: the adapted model is the base model.
        bound = 1.0 / math.sqrt(full_in)
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        out_rows = dict(rows.parts)
        for name in targets:
            a = torch.empty(cfg.rank, full_in, dtype=torch.float32).uniform_(-bound, bound, generator=init)
            if input_is_split:
                a = a[:, tp_rank * in_features : (tp_rank + 1) * in_features]
            self.lora_A[name] = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
            self.lora_B[name] = torch.nn.Parameter(
                torch.zeros(rows.repeats * out_rows[name], cfg.rank, device=device, dtype=dtype)
            )
            # megatron counts a parameter without these attributes once per TP group (a duplicate)
            # in the gradient norm: the split piece must say it is split, or clipping goes wrong.
            split = self.lora_A[name] if input_is_split else self.lora_B[name]
            set_tensor_model_parallel_attributes(split, is_parallel=True, dim=1 if input_is_split else 0, stride=1)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        """Inverted dropout with one mask over the full input width, drawn from the default RNG
        (seeded alike on every rank) and sliced for a split input: every TP layout drops the same
        features as TP1 on the same tokens, and the ranks' generators stay in step. megatron's
        model-parallel RNG tracker is not used: nothing in this stack seeds it (no other dropout)."""
        tp, keep = self.tp_group.size(), 1.0 - self.dropout
        width = x.shape[-1] * tp if self.input_is_split else x.shape[-1]
        mask = torch.empty(*x.shape[:-1], width, dtype=x.dtype, device=x.device).bernoulli_(keep)
        if self.input_is_split:
            mask = mask.chunk(tp, dim=-1)[self.tp_group.rank()]
        return x * mask / keep

    def fused_a(self) -> torch.Tensor:
        """(targets * rank, local in): the targets' A stacked."""
        return torch.cat([self.lora_A[name] for name in self.targets])

    def fused_b(self) -> torch.Tensor:
        """(local out, targets * rank): each target's B in its rows and its own rank columns, zero
        elsewhere, in the base weight's row layout."""
        width = len(self.targets) * self.rank
        b_any = self.lora_B[self.targets[0]]
        blocks = []
        for name, rows in self.rows.parts:
            if name in self.targets:
                j = self.targets.index(name)
                b = self.lora_B[name].view(self.rows.repeats, rows, self.rank)
                blocks.append(F.pad(b, (j * self.rank, width - (j + 1) * self.rank)))
            else:
                blocks.append(b_any.new_zeros(self.rows.repeats, rows, width))
        return torch.cat(blocks, dim=1).reshape(-1, width)

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The linear's output ``out`` (..., local out) plus the adapters' for its input ``x``
        (..., local in). The up-projection, its scaling and the sum are one GEMM (``addmm``): adding a
        separate adapter output would read and write tensors as wide as the linear's output three
        more times, which on a GPU costs more than the weight gradients LoRA saves."""
        if self.training and self.dropout:
            x = self._drop(x)
        low = F.linear(x, self.fused_a())  # (..., targets * rank)
        if self.input_is_split:
            low = reduce_from_tensor_model_parallel_region(low, group=self.tp_group)
        else:
            low = copy_to_tensor_model_parallel_region(low, group=self.tp_group)
        summed = torch.addmm(
            out.reshape(-1, out.shape[-1]), low.reshape(-1, low.shape[-1]), self.fused_b().t(), alpha=self.scaling
        )
        return summed.view(out.shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """megatron's checkpoint entries, sharded like the base: column-parallel B along its rows,
        row-parallel A along its columns (full PEFT-shaped tensors in the checkpoint, reshardable
        to any TP), the rest replicated."""
        piece, dim = ("lora_A", 1) if self.input_is_split else ("lora_B", 0)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {f"{piece}.{name}": dim for name in self.targets},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )

    def merged_delta(self) -> torch.Tensor:
        """scaling * B @ A in the base weight's local layout (column-parallel: this rank's output rows;
        row-parallel: its input columns), computed locally: what merging adds to the weight."""
        return (self.fused_b() @ self.fused_a()) * self.scaling


def _add_adapter_output(
    adapter: LoraAdapter,
    linear: torch.nn.Module,
    args: tuple[torch.Tensor, ...],
    output: tuple[torch.Tensor, torch.Tensor | None],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward hook of an adapted linear: its output plus its adapter's (the bias, returned apart by
    megatron's ``skip_bias_add``, is untouched)."""
    out, bias = output
    if not adapter.enabled:
        return output
    return adapter(args[0], out), bias


def _linears(model: GPTModel) -> Iterator[tuple[int, str, torch.nn.Module, torch.nn.Module]]:
    """(global layer number, megatron name, parent module, linear) of every linear LoRA may adapt
    on this stage."""
    for layer in model.decoder.layers:
        for parent, name in (
            (layer.self_attention, "linear_qkv"),
            (layer.self_attention, "linear_proj"),
            (layer.mlp, "linear_fc1"),
            (layer.mlp, "linear_fc2"),
        ):
            yield layer.layer_number, name, parent, getattr(parent, name)


def adapted_linears(model: GPTModel) -> Iterator[tuple[int, torch.nn.Module, LoraAdapter]]:
    """(global layer number, linear, its adapter) of every adapted linear on this stage."""
    for layer_number, name, parent, linear in _linears(model):
        adapter = getattr(parent, name + ADAPTER_SUFFIX, None)
        if isinstance(adapter, LoraAdapter):
            yield layer_number, linear, adapter


def apply_lora(
    model: GPTModel, arch: Architecture, cfg: LoraConfig, tp_group: torch.distributed.ProcessGroup, *, seed: int
) -> None:
    """Adapt ``model``'s linears named by ``cfg`` in place and freeze everything else but a score head
    (a new head must train for the adapters to get any gradient, as PEFT's sequence classifiers keep
    ``score`` trainable). Call after the base weights are loaded."""
    targets = cfg.targets()
    weight = next(model.parameters())
    for layer_number, name, parent, linear in _linears(model):
        mine = tuple(t for t in targets if TARGET_LINEARS[t] == name)
        if not mine:
            continue
        if not isinstance(linear, ColumnParallelLinear | RowParallelLinear):
            raise TypeError(f"LoRA adapts megatron's parallel linears; {name} is a {type(linear).__name__}")
        split_input = isinstance(linear, RowParallelLinear)
        init = torch.Generator().manual_seed(seed + zlib.crc32(f"{layer_number}.{name}".encode()))
        adapter = LoraAdapter(
            fused_rows(name, arch, tp_group.size()),
            mine,
            in_features=linear.weight.shape[1],
            cfg=cfg,
            input_is_split=split_input,
            tp_group=tp_group,
            init=init,
            dtype=weight.dtype,
            device=weight.device,
        )
        setattr(parent, name + ADAPTER_SUFFIX, adapter)
        linear.register_forward_hook(functools.partial(_add_adapter_output, adapter))
    trainable = {id(p) for a in adapters(model) for p in a.parameters()}
    if arch.score_head and hasattr(model, "output_layer"):
        trainable |= {id(p) for p in model.output_layer.parameters()}
    for param in model.parameters():
        param.requires_grad_(id(param) in trainable)


def adapters(model: torch.nn.Module) -> list[LoraAdapter]:
    """The model's adapters (none without LoRA), in module order."""
    return [module for module in model.modules() if isinstance(module, LoraAdapter)]


def adapted_weights(model: torch.nn.Module) -> Iterator[tuple[torch.Tensor, LoraAdapter]]:
    """(base weight, its adapter) of every adapted linear on this stage."""
    for _, linear, adapter in adapted_linears(model):
        weight = linear.weight
        assert isinstance(weight, torch.Tensor)
        yield weight, adapter


def add_delta(weight: torch.Tensor, adapter: LoraAdapter) -> None:
    """``weight += scaling * B @ A`` (``merged_delta``), summed in float32 and rounded once to the
    weight's dtype: in bf16 that is one rounding of the merged value, not one of the delta and a
    second of the sum."""
    with torch.no_grad():
        weight.copy_(merged_weight(weight, adapter))


def merged_weight(weight: torch.Tensor, adapter: LoraAdapter) -> torch.Tensor:
    """A new tensor ``weight + scaling * B @ A`` in ``weight``'s dtype, summed in float32 and rounded
    once (``add_delta``'s value, ``weight`` untouched): what the HF export writes for an adapted linear."""
    with torch.no_grad():
        delta = (adapter.fused_b().float() @ adapter.fused_a().float()) * adapter.scaling
        return (weight.detach().float() + delta).to(weight.dtype)


def merge_adapters(model: torch.nn.Module, *, keep_base: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Merge every adapter into its linear's weight (``add_delta``) and switch the adapters off (their
    hook would add their output a second time). ``keep_base``: return (weight, a copy of it before
    the merge) per adapted linear, for ``unmerge_adapters``; else nothing is kept (a copy whose
    weights are rewritten before the next merge, like the resharded generation copy)."""
    kept = []
    for weight, adapter in adapted_weights(model):
        if keep_base:
            kept.append((weight, weight.detach().clone()))
        add_delta(weight, adapter)
        adapter.enabled = False
    return kept


def unmerge_adapters(model: torch.nn.Module, kept: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Undo ``merge_adapters(model, keep_base=True)``: the weights it kept copied back (bit-exact;
    subtracting the delta again would not give the base back after the merge's rounding) and the
    adapters on."""
    with torch.no_grad():
        for weight, base in kept:
            weight.copy_(base)
    for adapter in adapters(model):
        adapter.enabled = True


def mirror_adapters(
    source: GPTModel, target: GPTModel, arch: Architecture, tp_group: torch.distributed.ProcessGroup
) -> None:
    """Give ``target`` (``source``'s architecture in another layout) the adapters ``source`` has, at
    the same linears with the same targets, rank and scaling, in ``target``'s TP layout and frozen,
    without a forward hook: a copy that merges them into its weights (``merge_adapters``) rather than
    running them. Their values are not copied here: ``LayoutCopy.refresh`` reshards them with the
    weights (by their names and tensor-parallel attributes; A and B are small next to the weights).
    Every pipeline stage adapts the same linears, so this stage's adapters describe the whole model's."""
    like: dict[str, LoraAdapter] = {}
    for _, name, parent, _ in _linears(source):
        adapter = getattr(parent, name + ADAPTER_SUFFIX, None)
        if isinstance(adapter, LoraAdapter):
            like.setdefault(name, adapter)
    weight = next(target.parameters())
    for _, name, parent, linear in _linears(target):
        found = like.get(name)
        if found is None:
            continue
        base = linear.weight
        assert isinstance(base, torch.Tensor)
        # alpha only sets the scaling, which is then taken from the source exactly
        cfg = LoraConfig(rank=found.rank, alpha=found.scaling * found.rank, target_modules=list(found.targets))
        adapter = LoraAdapter(
            fused_rows(name, arch, tp_group.size()),
            found.targets,
            in_features=base.shape[1],
            cfg=cfg,
            input_is_split=found.input_is_split,
            tp_group=tp_group,
            init=torch.Generator(),  # values overwritten by the copy
            dtype=weight.dtype,
            device=weight.device,
        )
        adapter.scaling = found.scaling
        adapter.requires_grad_(False)
        setattr(parent, name + ADAPTER_SUFFIX, adapter)


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """The base model inside the block (the reference a LoRA actor gets for free)."""
    found = adapters(model)
    for adapter in found:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in found:
            adapter.enabled = True
