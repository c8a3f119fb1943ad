"""A model's weights copied into another parallel layout: the actor's generation copy, and the
actor's weights in the reference's layout (``hybrid/reference.py``).

A ``LayoutCopy`` builds the destination model in the target layout once, and ``refresh()`` copies
the source's current weights into it in place with megatron-core's
``megatron.core.resharding.refit.swap_model_weights`` (collective over the whole world). The actor
trains in its own layout (say TP2, or PP2) and generates in another: TP = the generation tp, PP = 1
(the native engine collapses pipelines), DP = the rest of the world; ``WeightResharder`` is the
``LayoutCopy`` into that generation layout.

* Zero copy: when the target layout equals the source's (for generation: the generation tp equals
  the training tp and the training pp is 1), the source already is in it. No destination is built
  and ``refresh()`` returns the source ``RoleModel`` itself (same module, same groups): readers see
  the live training weights.
* Copy service: megatron's "nccl" service (``NCCLCopyService``), which is plain
  ``torch.distributed.batch_isend_irecv`` on the default group (same-rank pieces are local copies):
  NCCL point-to-point on GPU, and it runs unchanged on gloo in CPU mode. The "gloo" service stages
  every piece through pinned host memory (~1.8x the destination's bytes; pinning needs a CUDA
  driver) and creates a new process group, so it is slower on GPU and unusable on CPU-only hosts.
* The destination has the source's dtype (a dtype mismatch aborts megatron's copy) and the
  source's padded vocabulary (a mismatch raises): its vocab pad multiple is chosen so that
  ``padded_vocab_size(vocab, target_tp, multiple)`` equals the source model's.
* Plan cache: megatron caches the copy plan by rank and layout sizes, not by model identity, so a
  second model pair with the same layouts would silently reuse the first pair's plan (wrong
  tensors). ``refresh()`` clears the cache whenever the pair differs from the last one copied
  through this module (so two copies used in turn, the generation copy and the reference's copy
  of the actor, each rebuild their plan on every refresh). Anything else in the process that
  calls ``swap_model_weights`` directly must call ``refit.clear_plan_cache()`` itself.
* Memory: the destination's parameters are views into one flat buffer whose storage exists only
  between ``refresh()`` (which allocates it if it is not there, then copies) and ``release()``
  (which frees it). When offloading, the hybrid engine calls ``refresh()`` after the optimizer state
  has left the GPU and ``release()`` before it comes back, so the generation copy lives in the
  memory the offload freed; otherwise it never releases it, and every refresh writes into the same
  storage (the addresses the engine's CUDA graphs read). Parameter objects (and megatron's cached
  name -> tensor maps of them) stay valid across the cycle: only the storage under them is freed and
  reallocated. megatron 0.19.2 does no bucketing: all the temporaries of one refresh exist at once.
* LoRA: a source with adapters gets a copy with the same adapters (``models/lora.py``'s
  ``mirror_adapters``, no forward hook), and ``refresh()`` reshards them with the weights (megatron's
  plan reads their names and tensor-parallel attributes; the plan follows the destination's
  parameters, so a copy without them would simply leave the source's adapters behind).

Generation weights of a LoRA actor (``WeightResharder``) are the merged ``W + scale * B @ A``,
computed where it costs least and leaves the actor's base exactly as it was:
* resharded: in the generation copy, after the copy. ``refresh()`` copies W and the adapters (A and
  B: rank x (in + out) values per linear, small next to W) into the generation layout, then adds
  each adapter's delta into the copy's own W (``merge_adapters``; ``merged_delta`` is local in any
  TP layout, so no communication beyond the copy). The alternatives cost more: resharding the
  deltas moves a second set of full-size weights, and resharding W + delta needs the merged
  weights in the training layout first (the zero-copy problem below). The actor's weights are only
  read. The next ``refresh()`` overwrites the copy's W, so nothing is undone.
* zero copy: the generation weights are the actor's own, bf16 on a GPU (fp32 on CPU) with no fp32
  master copy (the base is frozen), so merging in place and subtracting the delta afterwards would
  not give W back bit-exactly. Of the two exact ways, (a) a generation copy of the adapted
  linears holding W + delta, which the engine would have to read instead of the model's weights,
  and (b) keeping W of the adapted linears, merging in place, generating, and copying W back, this
  takes (b): the engine reads the model's weights as always (same addresses, so CUDA graphs stay
  valid), and its cost is one copy of the adapted weights while generating plus two device
  copies of them per rollout (``restore()`` puts them back). Both cost that memory; a GPU run
  will measure what the copies cost in time (not measured yet).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.resharding import refit
from megatron.core.resharding.copy_services.nccl_copy_service import NCCLCopyService
from megatron.core.resharding.utils import invalidate_refit_tensor_cache

from megatron_rlhf.models.architecture import matching_vocab_pad_multiple
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.lora import adapters, merge_adapters, mirror_adapters, unmerge_adapters
from megatron_rlhf.models.roles import RoleModel
from megatron_rlhf.parallel.layout import Layout, layout_errors, parallel_groups

# The model pair whose plan megatron's plan cache holds now (see the module docstring).
_LAST_PAIR: list[object | None] = [None]


def generation_layout(train: Layout, generation_tp: int, world_size: int) -> Layout:
    """The generation layout of a model trained in ``train``: TP=generation_tp, PP=1, DP=the rest."""
    if generation_tp < 1:
        raise ValueError(f"generation tp={generation_tp} must be >= 1")
    if train.tp * train.pp * train.dp != world_size:
        raise ValueError(
            f"the training layout {train} has {train.tp * train.pp * train.dp} ranks, not the world size {world_size}"
        )
    if world_size % generation_tp:
        raise ValueError(f"generation tp={generation_tp} must divide the world size {world_size}")
    return Layout(tp=generation_tp, pp=1, dp=world_size // generation_tp)


class LayoutCopy:
    """Builds (once) the copy of ``source`` in ``layout`` and refreshes its weights in place.

    Collective: construct it, and call ``refresh()``, on every rank in the same order.
    """

    def __init__(self, source: RoleModel, layout: Layout) -> None:
        self.source = source
        self.layout = layout
        self.zero_copy = layout == source.groups.layout
        self._pair = object()  # identifies this (source, destination) pair for the plan cache
        if self.zero_copy:
            self.target = source
            return
        dtypes = {p.dtype for p in source.model.parameters()}
        devices = {p.device for p in source.model.parameters()}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(
                f"the {source.role}'s parameters must share one dtype and one device "
                f"(got {sorted(map(str, dtypes))} on {sorted(map(str, devices))})"
            )
        multiple = matching_vocab_pad_multiple(source.arch.vocab_size, source.padded_vocab_size, layout.tp)
        groups = parallel_groups(layout)
        model = build_model(source.arch, groups, dtype=dtypes.pop(), device=devices.pop(), vocab_pad_multiple=multiple)
        if adapters(source.model):
            mirror_adapters(source.model, model, source.arch, groups.pg_collection.tp)
        model.requires_grad_(False)  # read only; the copy writes into .data in place
        model.eval()
        self._flat = _flatten_parameters(model)
        self.release()
        self.target = RoleModel(
            role=source.role, arch=source.arch, groups=groups, model=model, source=source.source, hub_id=source.hub_id
        )
        self._service = NCCLCopyService()

    def refresh(self) -> RoleModel:
        """Copy the source's current weights into the copy (in place) and return it.

        Call it after the optimizer step has finished writing the parameters (with the
        distributed optimizer and overlapped param gather, force the param sync first).
        In the zero-copy case this returns the source ``RoleModel`` and moves nothing.
        """
        if self.zero_copy:
            return self.source
        storage = self._flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self._flat.numel() * self._flat.element_size())
        if _LAST_PAIR[0] is not self._pair:
            refit.clear_plan_cache()
            _LAST_PAIR[0] = self._pair
        # megatron caches the {name: tensor} dict of each model; re-read the training model's in
        # case its parameters were replaced since the last copy (cheap next to the copy itself).
        invalidate_refit_tensor_cache(self.source.model)
        refit.swap_model_weights(self.source.model, self.target.model, self._service)
        return self.target

    def release(self) -> None:
        """Free the copy's memory (its parameters keep their shapes, not their values)."""
        if not self.zero_copy:
            self._flat.untyped_storage().resize_(0)

    def destination_bytes(self) -> int:
        """This rank's bytes of the copy while it exists (0 in the zero-copy case)."""
        if self.zero_copy:
            return 0
        return self._flat.numel() * self._flat.element_size()


class WeightResharder(LayoutCopy):
    """The actor's generation copy: ``source`` in its generation layout at ``generation_tp``."""

    def __init__(self, source: RoleModel, generation_tp: int) -> None:
        world_size = dist.get_world_size()
        layout = generation_layout(source.groups.layout, generation_tp, world_size)
        if layout != source.groups.layout:
            errors = layout_errors("generation", generation_tp, 1, source.arch, world_size, pipeline=False)
            if errors:
                raise ValueError("cannot generate in this layout: " + "; ".join(errors))
        super().__init__(source, layout)
        self.lora = bool(adapters(source.model))
        """Whether the actor has LoRA adapters, merged into the generation weights at each refresh."""
        self._base: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def merges_in_place(self) -> bool:
        """Whether ``refresh()`` merges the adapters into the actor's own weights (zero copy with
        LoRA), to be undone by ``restore()`` before the actor trains again."""
        return self.lora and self.zero_copy

    def refresh(self) -> RoleModel:
        """The generation weights: the copy (or the actor itself), with the adapters merged in."""
        target = super().refresh()
        if self.merges_in_place:
            if self._base is not None:
                raise RuntimeError("the generation weights are merged already: call restore() first")
            self._base = merge_adapters(target.model, keep_base=True)
        elif self.lora:
            merge_adapters(target.model, keep_base=False)
        return target

    def restore(self) -> None:
        """After generating: the actor's base weights back bit-exactly and its adapters on, where
        ``refresh()`` merged in place; else nothing to do (the copy is rewritten at the next refresh)."""
        if self._base is not None:
            unmerge_adapters(self.source.model, self._base)
            self._base = None


_ALIGN = 128  # elements: every parameter view starts 256-byte aligned (bf16), as kernels prefer


def _flatten_parameters(model: torch.nn.Module) -> torch.Tensor:
    """Re-point every parameter of ``model`` at a slice of one new flat buffer (contents not
    kept: ``refresh()`` overwrites them); returns the buffer."""
    params = list(model.parameters())
    sizes = [-(-p.numel() // _ALIGN) * _ALIGN for p in params]
    flat = torch.empty(sum(sizes), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for param, size in zip(params, sizes, strict=True):
        param.data = flat[offset : offset + param.numel()].view_as(param)
        offset += size
    return flat
