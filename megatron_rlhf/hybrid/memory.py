"""Train <-> generate memory switching for one model's training state.

Before generation (``to_generation``): the DDP gradient buffers are freed (they hold nothing between
steps: the next step zeroes them anyway), and the optimizer's fp32 main parameters and Adam moments
move to pinned CPU memory. After generation (``to_training``) they come back, bit for bit. Model
weights stay where they are: generation reads them directly (or reshards them, hybrid/reshard.py).
Nothing here creates process groups. On CPU (CPU mode) there is no device memory to free and both
calls move nothing.

Main parameters that alias the model's own parameters (fp32 training) are left in place: moving
them would break the aliasing the optimizer relies on. With ``cpu_offload_fraction`` the optimizer
state it keeps on the host (fp32 masters, moments, gradient copies) stays where it is; only the share
on the device moves.

Gradient buffers are released only once the model has taken an optimizer step: with fp32 parameters
on a GPU, releasing megatron's buffers before the first step made the next ``zero_grad_buffer``
fault (illegal memory access with megatron-core 0.19.2; bf16 was fine, and
so was fp32 after one step). Before that step they hold only zeros; the first rollout keeps them.
"""

from __future__ import annotations

import torch

from megatron_rlhf.hybrid.config import OffloadMode
from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.parallel.layout import Layout
from megatron_rlhf.training.optim import TrainState, torch_optimizers

GIB = 1024**3
HEADROOM_FRACTION = 0.10
"""Device memory kept free beyond the estimate in ``auto`` (allocator fragmentation, CUDA graph pools,
sampling workspaces)."""


def kv_cache_bytes(arch: Architecture, *, generation_tp: int, slots: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of the engine's KV cache (rollout/kv_cache.py) on one rank of the generation layout."""
    element = torch.empty((), dtype=dtype).element_size()
    return arch.num_layers * slots * (arch.num_query_groups // generation_tp) * max_len * 2 * arch.head_dim * element


def generation_bytes(
    arch: Architecture,
    *,
    train: Layout,
    generation_tp: int,
    weight_bytes: int,
    slots: int,
    max_len: int,
    dtype: torch.dtype,
    lora_base_bytes: int = 0,
) -> int:
    """What generation allocates on one rank beside the training memory: the KV cache, and the
    resharded generation copy (``weight_bytes``, this rank's share of the actor in ``train``, spread
    over ``generation_tp`` instead) unless the layouts match (zero copy); then, for a LoRA actor,
    its adapted linears' base weights (``lora_base_bytes``), kept while the adapters are merged
    into them (``hybrid/reshard.py``)."""
    needs = kv_cache_bytes(arch, generation_tp=generation_tp, slots=slots, max_len=max_len, dtype=dtype)
    if not (generation_tp == train.tp and train.pp == 1):
        needs += weight_bytes * train.tp * train.pp // generation_tp
    else:
        needs += lora_base_bytes
    return needs


def optimizer_bytes_to_come(state: TrainState) -> int:
    """Device bytes of the Adam moments (2 x fp32 of each main parameter on the device) that torch's
    Adam has not allocated yet: it does so at the first step, so memory measured before it
    understates the training peak. Moments of parameters the optimizer keeps on the host
    (``cpu_offload_fraction``) take no device memory and are not counted."""
    optimizers = torch_optimizers(state.optimizer, split_offloaded=True)
    if any(len(s) > 0 for optimizer in optimizers for s in optimizer.state.values()):
        return 0
    return sum(
        8 * p.numel()
        for optimizer in optimizers
        for group in optimizer.param_groups
        for p in group["params"]
        if p.is_cuda
    )


def decide_offload(mode: OffloadMode, *, generation_needs: int, free: int, total: int) -> tuple[bool, str]:
    """Whether the training memory leaves the device while generating, and why.

    ``auto`` offloads only when what generation allocates (KV cache, generation weights) does not fit
    in the memory free at the training peak, less a headroom of ``HEADROOM_FRACTION`` of the device.
    """
    if mode != "auto":
        return mode == "always", f"hybrid.offload={mode}"
    room = free - int(HEADROOM_FRACTION * total)
    fits = generation_needs <= room
    return (not fits), (
        f"hybrid.offload=auto: generation needs {generation_needs / GIB:.2f} GiB, "
        f"{room / GIB:.2f} GiB free at the training peak (after a {HEADROOM_FRACTION:.0%} headroom): "
        + (
            "keep the optimizer state on the device and generation's memory allocated between rollouts"
            if fits
            else "offload it while generating"
        )
    )


class TrainingMemory:
    def __init__(self, state: TrainState) -> None:
        self.state = state
        self.on_gpu = any(p.is_cuda for p in state.role.model.parameters())
        self._host: dict[tuple[int, str | None], torch.Tensor] = {}  # pinned buffers, reused across switches
        self._offloaded: list[tuple[object, str | None, torch.Tensor, torch.device]] = []
        self._grads_released = False

    def _movable(self) -> list[tuple[object, str | None, torch.Tensor]]:
        """(owner, state key or None for a parameter, tensor) for every optimizer tensor on a GPU; the
        state an offloading optimizer keeps on the host stays there."""
        model_storages = {p.untyped_storage().data_ptr() for p in self.state.role.model.parameters()}
        found: list[tuple[object, str | None, torch.Tensor]] = []
        for torch_optimizer in torch_optimizers(self.state.optimizer, split_offloaded=True):
            for group in torch_optimizer.param_groups:
                for param in group["params"]:
                    if param.is_cuda and param.untyped_storage().data_ptr() not in model_storages:
                        found.append((param, None, param.data))
            for param_state in torch_optimizer.state.values():
                for key, value in param_state.items():
                    if torch.is_tensor(value) and value.is_cuda:
                        found.append((param_state, key, value))
        return found

    def to_generation(self) -> int:
        """Free the gradient buffers and move the optimizer state to the host; returns the bytes moved."""
        moved = 0
        if self.on_gpu:
            torch.cuda.synchronize()
            if self.state.step > 0:
                self.state.ddp_model.offload_grad_buffers(synchronize=False, empty_cache=False)
                self._grads_released = True
            for owner, key, tensor in self._movable():
                host = self._host.get((id(owner), key))
                if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
                    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
                self._offloaded.append((owner, key, host, tensor.device))
                moved += tensor.numel() * tensor.element_size()
            torch.cuda.synchronize()
            for owner, key, host, _ in self._offloaded:
                self._set(owner, key, host)
            torch.cuda.empty_cache()
        return moved

    def to_training(self) -> int:
        """Bring back what ``to_generation`` moved, bit for bit; returns the bytes moved."""
        moved = 0
        if self._grads_released:
            self.state.ddp_model.restore_grad_buffers(synchronize=False)
            self._grads_released = False
        if self._offloaded:
            for owner, key, host, device in self._offloaded:
                self._set(owner, key, host.to(device, non_blocking=True))
                moved += host.numel() * host.element_size()
            # Keep the pinned buffers for the next switch (allocating pinned memory is slow).
            self._host = {(id(owner), key): host for owner, key, host, _ in self._offloaded}
            self._offloaded = []
        if self.on_gpu:
            torch.cuda.synchronize()
        return moved

    @staticmethod
    def _set(owner: object, key: str | None, tensor: torch.Tensor) -> None:
        """Point a parameter (``key`` None) or an optimizer state entry at ``tensor``."""
        if key is None:
            assert isinstance(owner, torch.Tensor)
            owner.data = tensor
        else:
            assert isinstance(owner, dict)
            owner[key] = tensor
