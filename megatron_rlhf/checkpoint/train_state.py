"""Resumable training state of one model: weights, optimizer, LR schedule, step, RNG.

Weights and optimizer states go through megatron's dist_checkpointing with the distributed
optimizer's ``fully_reshardable`` format, so a checkpoint reloads into another TP/PP/DP layout.
The step counter, LR-scheduler state and per-rank RNG states are stored beside it.

Megatron-core 0.19.2 traps on the torch-Adam path (no apex/TE), all handled here:
* Building the state dict of an optimizer that has not stepped yet fails (``DistributedOptimizer.
  state_dict`` asserts that the parameters share one ``step``): on load, and on a save when every
  update so far was skipped (non-finite gradients). ``_allocate_adam_state`` creates zero state
  first, which is what Adam's first step would create: a resumed run continues bit for bit.
* Loading the ``fully_reshardable`` format copies every tensor of a parameter's Adam state from the
  checkpoint, ``step`` included, which that format does not store (KeyError 'step'):
  ``_tolerate_missing_step`` keeps the step that ``load_state_dict`` has just set.
* Loading leaves every parameter pointing at ONE shared ``step`` tensor; Adam then increments it
  once per parameter per step and its bias correction goes wrong, silently.
  ``_unshare_adam_steps`` gives each parameter its own copy.
The resume test compares a resumed run with an uninterrupted one bit for bit.

Saving: megatron builds the ``fully_reshardable`` optimizer state by copying every parameter's fp32
main param and Adam moments into pageable host buffers, gathering them over DP (through the device)
and copying them again (``get_parameter_state_dp_zero``): many passes over 12 bytes a parameter, in
the training process, before a background writer can start (45 of a 92 s save for a 1.5B model).
When a model's distributed optimizer has a data-parallel group of one, every parameter's state is
whole on its rank and that gather is the identity: ``_in_place_fully_reshardable`` then describes the
same checkpoint tensors (same keys, shapes, dtype, sharding and replica ids) over the optimizer's
own tensors, and dist_checkpointing's staging makes the one copy to the host. The files are the same
as megatron's, so checkpoints written either way load either way. Any other case (DP > 1, megatron's
offloading or precision-aware optimizer, a partial parameter) takes megatron's path.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections import ChainMap
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import MegatronOptimizer, param_group_identifier_keys

from megatron_rlhf.checkpoint.mcore import (
    dist_save_request,
    global_dp_rank_of,
    has_integrity_manifest,
    results_in_this_process,
    write_bytes,
)
from megatron_rlhf.checkpoint.mcore_meta import TRAINED_STATE_FILE
from megatron_rlhf.training.optim import TrainState, fuse_device_adam, torch_optimizers

OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


def _sharded(state: TrainState, is_loading: bool) -> dict:
    groups = state.role.groups
    metadata = {"dp_cp_group": groups.pg_collection.dp_cp, **OPTIMIZER_FORMAT}
    with global_dp_rank_of(groups), contextlib.nullcontext() if is_loading else _save_in_place():
        model_sd = state.role.model.sharded_state_dict(metadata=metadata)
        optimizer_sd = state.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return {"model": model_sd, "optimizer": optimizer_sd}


@contextlib.contextmanager
def _save_in_place() -> Iterator[None]:
    """While a save's sharded state dict is made: megatron's ``fully_reshardable`` optimizer state
    is described in place (``_in_place_fully_reshardable``) where it can be, without megatron's gather."""
    original = DistributedOptimizer.sharded_param_state_fully_reshardable

    def sharded_param_state(
        self: DistributedOptimizer,
        model_sharded_state_dict: dict,
        is_loading: bool = False,
        metadata: dict | None = None,
    ) -> dict | None:
        in_place = None if is_loading else _in_place_fully_reshardable(self, model_sharded_state_dict)
        if in_place is not None:
            return in_place
        return original(self, model_sharded_state_dict, is_loading, metadata)

    DistributedOptimizer.sharded_param_state_fully_reshardable = sharded_param_state
    try:
        yield
    finally:
        DistributedOptimizer.sharded_param_state_fully_reshardable = original


def _in_place_fully_reshardable(optimizer: DistributedOptimizer, model_sharded_state_dict: dict) -> dict | None:
    """What megatron-core 0.19.2's ``sharded_param_state_fully_reshardable`` returns for a save
    (``{param_idx: {"param" | "exp_avg" | "exp_avg_sq": ShardedTensor}}``, params in each buffer's
    ``param_index_map`` order, each tensor shaped, sharded and replicated like its model parameter,
    fp32), with the optimizer's own tensors as data instead of gathered host copies. ``None`` where
    that does not hold: a data-parallel group larger than one (a parameter's state is spread over
    ranks), megatron's offloading or precision-aware optimizer (state kept elsewhere or scaled), a
    parameter not whole on this rank, state that is not fp32 or not the parameter's size."""
    if (
        optimizer.data_parallel_group.size() != 1
        or isinstance(optimizer.optimizer, HybridDeviceOptimizer)
        or optimizer.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    ):
        return None
    model_tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    sharded_of = {sharded.data: sharded for sharded in nested_values(model_tensors)}
    keys = ("param",) + optimizer.optimizer_state_keys
    state: dict = {}
    for gbuf_idx, gbuf_range_maps in enumerate(optimizer.gbuf_ranges):
        if len(gbuf_range_maps) != 1:
            return None
        (range_maps,) = gbuf_range_maps.values()
        owned = ChainMap(*(range_map["param_map"] for range_map in range_maps))
        for model_param in optimizer.buffers[gbuf_idx].param_index_map:
            sharded = sharded_of.get(model_param)
            if sharded is None or sharded.flattened_range is not None or model_param not in owned:
                return None
            param_range = owned[model_param]["param"]
            if (param_range.start, param_range.end) != (0, model_param.numel()):
                return None
            tensors = optimizer._get_main_param_and_optimizer_states(model_param)
            entry = {}
            for key in keys:
                tensor = tensors.get(key)
                if (
                    not torch.is_tensor(tensor)
                    or tensor.dtype != torch.float32
                    or tensor.numel() != model_param.numel()
                ):
                    return None
                fields = {
                    "key": f"optimizer.state.{key}.{sharded.key}",
                    "data": tensor.detach().reshape(sharded.data.shape),
                    "dtype": torch.float32,
                    "replica_id": sharded.replica_id,
                }
                if isinstance(sharded, ShardedTensorFactory):
                    fields.pop("dtype")
                entry[key] = replace(sharded, **fields)
                entry[key].validate_metadata_integrity()
            state[len(state)] = entry
    return state


def train_state_save_request(state: TrainState, ckpt_dir: str | Path) -> AsyncRequest:
    """Collective. Writes each rank's RNG file and plans the save of the weights and optimizer
    (``dist_save_request``); its last finalize function writes ``train_state.json`` with the step
    and LR schedule as they are now, when the request was made."""
    ckpt = Path(ckpt_dir)
    if dist.get_rank() == 0:
        (ckpt / "dist").mkdir(parents=True, exist_ok=True)
        (ckpt / "rng").mkdir(parents=True, exist_ok=True)
    dist.barrier()
    _allocate_adam_state(state.optimizer)  # no update yet (all skipped): megatron cannot describe empty state
    fuse_device_adam(state.optimizer)  # the fused kernel reads the new steps on the device
    request = dist_save_request(_sharded(state, is_loading=False), ckpt / "dist")
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    buffer = io.BytesIO()
    torch.save(rng, buffer)
    write_bytes(ckpt / "rng" / f"rank{dist.get_rank():05d}.pt", buffer.getvalue())
    meta = {"step": state.step, "scheduler": state.scheduler.state_dict(), "layout": str(state.role.groups.layout)}

    def write_meta() -> None:
        if dist.get_rank() == 0:
            (ckpt / TRAINED_STATE_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        dist.barrier()

    request.add_finalize_fn(write_meta)
    return request


def save_train_state(state: TrainState, ckpt_dir: str | Path) -> None:
    """Collective. Writes ``ckpt_dir/{dist,rng}`` and ``train_state.json`` (written last)."""
    with results_in_this_process():
        train_state_save_request(state, ckpt_dir).execute_sync()


def load_train_state(state: TrainState, ckpt_dir: str | Path) -> None:
    """Collective. Fills ``state`` (any layout) from ``save_train_state``'s output. The optimizer's
    moments and step come from the checkpoint; its hyperparameters and the LR schedule are the
    ones ``state`` was built with (a resumed run's config), followed at the saved step."""
    ckpt = Path(ckpt_dir)
    meta_path = ckpt / TRAINED_STATE_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path}: missing; {ckpt} is not a complete training checkpoint")
    meta = json.loads(meta_path.read_text())
    _allocate_adam_state(state.optimizer)
    loaded = dist_checkpointing.load(
        _sharded(state, is_loading=True), str(ckpt / "dist"), verify_integrity=has_integrity_manifest(ckpt / "dist")
    )
    state.role.model.load_state_dict(loaded["model"], strict=True)
    _keep_current_hyperparameters(state.optimizer, loaded["optimizer"])
    with _tolerate_missing_step():
        state.optimizer.load_state_dict(loaded["optimizer"])
    _unshare_adam_steps(state.optimizer)
    fuse_device_adam(state.optimizer)
    # megatron's scheduler adds the saved step count to its own: start from 0 so that loading into a
    # state that has stepped (a rollback within a run) does not count those steps twice. Its
    # schedule is this state's (``make_train_state`` overrides the checkpoint's).
    state.scheduler.num_steps = 0
    state.scheduler.load_state_dict(meta["scheduler"])
    state.step = meta["step"]
    rng_file = ckpt / "rng" / f"rank{dist.get_rank():05d}.pt"
    if rng_file.is_file():  # same world size: restore this rank's generators exactly
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])


def _keep_current_hyperparameters(optimizer: MegatronOptimizer, loaded: dict) -> None:
    """Give the checkpoint's parameter groups the hyperparameters of ``optimizer``'s (lr, min/max lr,
    weight decay, betas, eps), so that a resumed run follows its own config. megatron pairs saved
    with current groups by a tuple that includes max_lr and min_lr: without this, a changed learning
    rate fails the load (``KeyError: (None, 1e-05, ...)``), and torch would restore the old values.
    Groups are paired by megatron's other identifier keys (weight-decay and lr multipliers, expert
    and decoupled-lr flags), which do not come from the config."""
    structural = [key for key in param_group_identifier_keys if key not in ("max_lr", "min_lr", "start_wd", "end_wd")]
    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    saved_dicts = [loaded] if len(inners) == 1 else [loaded[index] for index in sorted(loaded)]
    for inner, saved in zip(inners, saved_dicts, strict=True):
        current = {tuple(group.get(key) for key in structural): group for group in inner.optimizer.param_groups}
        for group in saved["optimizer"]["param_groups"]:
            ours = current.get(tuple(group.get(key) for key in structural))
            if ours is None:
                raise ValueError(
                    f"the checkpoint's optimizer has a parameter group { ({k: group.get(k) for k in structural}) } "
                    f"that this model's optimizer does not (it has {list(current)})"
                )
            group.update({key: value for key, value in ours.items() if key not in ("params", "step")})


@contextlib.contextmanager
def _tolerate_missing_step() -> Iterator[None]:
    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self: DistributedOptimizer, model_param: torch.nn.Parameter, tensors: dict) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        step = self.optimizer.state[main_param].get("step")
        if torch.is_tensor(step) and "step" not in tensors:
            tensors = {**tensors, "step": step}
        original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original


def _allocate_adam_state(optimizer: object) -> None:
    """Zero Adam state (moments and step) for parameters that have none yet; loading overwrites it.

    A ``HybridDeviceOptimizer`` (``cpu_offload_fraction``) keeps the state in its sub-optimizers,
    keyed by their own fp32 copies (on the host for the offloaded share): it is allocated there,
    beside each copy, and then published to the wrapper (which adds ``master_param``)."""
    for torch_optimizer in torch_optimizers(optimizer, split_offloaded=True):
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                state = torch_optimizer.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
    for torch_optimizer in torch_optimizers(optimizer):
        if isinstance(torch_optimizer, HybridDeviceOptimizer):
            torch_optimizer._sync_sub_optimizers_state_to_hdo()


def _unshare_adam_steps(optimizer: object) -> None:
    """Give every parameter its own copy of the Adam ``step`` tensor."""
    for torch_optimizer in torch_optimizers(optimizer):
        for param_state in torch_optimizer.state.values():
            if "step" in param_state:
                old = param_state["step"]
                param_state["step"] = old.clone() if torch.is_tensor(old) else old
