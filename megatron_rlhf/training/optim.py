"""Training state for one model: megatron DDP, the (distributed) optimizer and the LR schedule.

* DDP accumulates gradients in fp32 buffers and reduces them over the model's own data-parallel
  group; ``finalize_model_grads`` is wired in explicitly (without it megatron never reduces DP
  gradients, silently).
* With ``calculate_per_token_loss`` the schedule divides gradients by the global loss denominator
  (summed over micro-batches and DP ranks), so updates do not depend on the layout.
* bf16 parameters get fp32 main parameters inside the optimizer (megatron's mixed precision).
* ``cpu_offload_fraction > 0`` keeps that share of the optimizer state (fp32 main parameters, Adam
  moments, a gradient copy) in host memory and steps it there: megatron's ``HybridDeviceOptimizer``
  inside the distributed optimizer, in its precision-aware mode (the optimizer holds the bf16
  parameter shards and makes the fp32 masters itself, on the host for the offloaded share), the
  combination megatron documents for the offload. It is what lets a 7B-class model with a
  reference train on one GPU; each step then pays a device -> host gradient copy, a CPU Adam step
  and a host -> device parameter copy.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, FullParamLayout
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_rlhf.models.roles import RoleModel
from megatron_rlhf.training.config import OptimConfig


@dataclasses.dataclass
class TrainState:
    role: RoleModel
    ddp_model: DistributedDataParallel
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    step: int = 0


def torch_optimizers(optimizer: MegatronOptimizer, *, split_offloaded: bool = False) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside megatron's (chained) optimizer. With ``split_offloaded``, a
    ``HybridDeviceOptimizer`` (``cpu_offload_fraction``) is replaced by its sub-optimizers: they hold
    the state, keyed by their own fp32 copies of the parameters (the offloaded share's on the host);
    the wrapper's own ``state`` holds the same dicts once synchronised."""
    found: list[torch.optim.Optimizer] = []
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = inner.optimizer
        hybrid = split_offloaded and isinstance(torch_optimizer, HybridDeviceOptimizer)
        found += torch_optimizer.sub_optimizers if hybrid else [torch_optimizer]
    return found


def fuse_device_adam(optimizer: MegatronOptimizer) -> None:
    """Run torch's Adam on the GPU as its fused kernel (one pass over parameters, gradients and
    moments), the role apex's or TE's FusedAdam plays where megatron finds them. Without them
    megatron builds ``torch.optim.AdamW`` on its default multi-tensor path: seven passes over the
    state (``docs/benchmarks.md``, "Kernels"). The fused kernel
    reads each ``step`` on the device, so existing ones (state loaded from a checkpoint) move there.
    Called again after loading a checkpoint, whose saved parameter groups replace these settings.
    Offloading optimizers (``cpu_offload_fraction``) keep megatron's own settings."""
    for torch_optimizer in torch_optimizers(optimizer):
        if type(torch_optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
            continue
        for group in torch_optimizer.param_groups:
            if group["params"] and all(p.is_cuda for p in group["params"]):
                group["fused"], group["foreach"] = True, False
                for param in group["params"]:
                    step = torch_optimizer.state.get(param, {}).get("step")
                    if torch.is_tensor(step):
                        torch_optimizer.state[param]["step"] = step.to(device=param.device, dtype=torch.float32)


def _offload_settings(fraction: float) -> dict:
    """megatron's optimizer settings for ``OptimConfig.cpu_offload_fraction`` (none when 0)."""
    if fraction == 0:
        return {}
    # overlap_cpu_optimizer_d2h_h2d (one CPU optimizer per parameter, copies on side streams) stays
    # off: one CPU Adam over all offloaded parameters is the simpler path (its gain is not measured yet).
    # The host gradient copies are not pinned: torch's pinned allocator rounds every block up to a
    # power of two and caches it, which for a 7B model's 30 GB of fp32 gradients came to ~59 GB.
    return {
        "optimizer_cpu_offload": True,
        "optimizer_offload_fraction": fraction,
        "use_precision_aware_optimizer": True,
        "pin_cpu_grads": False,
        "pin_cpu_params": False,
    }


def _distributed_optimizer_layout(
    model: torch.nn.Module, ddp_config: DistributedDataParallelConfig, pg: ProcessGroupCollection
) -> FullParamLayout:
    """Where each parameter lies in the distributed optimizer's buffers, as megatron's own training
    loop computes it for DDP (which otherwise computes the same itself, with a warning): one bucket
    (``overlap_grad_reduce`` is off), sharded over the model's data-parallel group (one optimizer
    instance: DDP's intra-instance groups are ``dp_cp`` and ``expt_dp``). DDP checks it against its
    own grouping of the parameters."""
    return DistributedOptimizer.compute_full_param_layout(
        [param for param in model.parameters() if param.requires_grad],
        None,
        pg.dp_cp.size(),
        ddp_config,
        expert_data_parallel_world_size=pg.expt_dp.size(),
    )


def make_train_state(role: RoleModel, cfg: OptimConfig) -> TrainState:
    model = role.model
    pg = role.groups.pg_collection
    params_dtype = model.config.params_dtype
    if cfg.cpu_offload_fraction and params_dtype == torch.float32:
        # megatron's offload steps bf16/fp16 parameter shards with fp32 masters of its own; fp32
        # shards are views it cannot hand to a torch optimizer ("can't optimize a non-leaf Tensor").
        raise ValueError(
            f"cpu_offload_fraction={cfg.cpu_offload_fraction} needs bf16 or fp16 parameters "
            "(dtype=bf16; dtype=auto is fp32 in CPU mode)"
        )
    # Read by DDP at construction (it decides how DP gradients are scaled): set it first.
    model.config.calculate_per_token_loss = True
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=cfg.distributed_optimizer,
    )
    ddp_model = DistributedDataParallel(
        config=model.config,
        ddp_config=ddp_config,
        module=model,
        pg_collection=pg,
        full_param_layout=_distributed_optimizer_layout(model, ddp_config, pg) if cfg.distributed_optimizer else None,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad,
            bf16=params_dtype == torch.bfloat16,
            fp16=params_dtype == torch.float16,
            params_dtype=params_dtype,
            use_distributed_optimizer=cfg.distributed_optimizer,
            **_offload_settings(cfg.cpu_offload_fraction),
        ),
        [ddp_model],
        use_gloo_process_groups=False,
        pg_collection=pg,
    )
    if cfg.cpu_offload_fraction and next(model.parameters()).is_cuda:
        # The offload's split staged each parameter through a pinned block, kept by torch's host
        # cache (rounded up to powers of two: ~30 GB for a 7B model): give it back.
        torch._C._host_emptyCache()
    fuse_device_adam(optimizer)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if cfg.warmup_steps else cfg.lr,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.warmup_steps,
        # A run resolves a null decay_steps from its length (``OptimConfig.resolve_length``); without
        # one (a benchmark), only a constant schedule is built.
        lr_decay_steps=max(_decay_steps(cfg), cfg.warmup_steps + 1),
        lr_decay_style=cfg.decay_style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
        # A resumed run follows its own config's schedule at the checkpoint's step; megatron's
        # default takes the checkpoint's schedule instead.
        override_opt_param_scheduler=True,
        use_checkpoint_opt_param_scheduler=False,
    )
    config = model.config
    config.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=pg)
    config.no_sync_func = ddp_model.no_sync
    config.grad_scale_func = optimizer.scale_loss
    return TrainState(role=role, ddp_model=ddp_model, optimizer=optimizer, scheduler=scheduler)


def _decay_steps(cfg: OptimConfig) -> int:
    if cfg.decay_steps is not None:
        return cfg.decay_steps
    if cfg.decay_style != "constant":
        raise ValueError(f"decay_style={cfg.decay_style!r} needs decay_steps: the run's length sets it at the start")
    return 1


def set_learning_rate(state: TrainState, cfg: OptimConfig, scale: float) -> None:
    """Scale ``cfg``'s learning rate schedule (its peak, floor and, without warm-up, start) by
    ``scale`` in place, and apply it at the schedule's current step: the health watch's recovery after
    a rollback. Absolute, from the config: loading a checkpoint restores the optimizer's param groups."""
    scheduler = state.scheduler
    scheduler.max_lr, scheduler.min_lr = cfg.lr * scale, cfg.min_lr * scale
    scheduler.init_lr = 0.0 if cfg.warmup_steps else scheduler.max_lr
    for group in state.optimizer.param_groups:
        if "max_lr" in group:
            group["max_lr"] = scheduler.max_lr
        if "min_lr" in group:
            group["min_lr"] = scheduler.min_lr
    scheduler.step(0)
