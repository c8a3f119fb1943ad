"""CPU (gloo) mode: run megatron-core without a GPU, for development and CI.

megatron-core hard-codes CUDA (``torch.cuda.current_device()`` as an allocation device,
CUDA streams/events, the CUDA RNG for its model-parallel RNG tracker). CPU mode rebinds the
name ``torch`` *inside megatron modules only* to a proxy whose ``cuda`` namespace answers for
the CPU, and whose tensor factories turn a CUDA device into ``cpu``. torch itself, and every
module outside ``megatron.*``, is left untouched, so a run on a GPU never sees any of this.

Two traps this module exists to avoid (see ../shared/notes/megatron-core-0.19.2.md):
* ``torch.cuda.manual_seed`` must seed the CPU generator, otherwise every RNG-tracker state
  is identical and tests still pass;
* modules imported after enabling (e.g. the checkpoint writer) need the proxy too, hence the
  import hook.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

_CPU = torch.device("cpu")
_ENABLED = False


def _to_cpu_device(device: Any) -> Any:
    """Map any CUDA device spelling (int ordinal, "cuda", "cuda:0", torch.device) to cpu."""
    if device is None:
        return None
    if isinstance(device, int):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


class _NullStream:
    """Stands in for torch.cuda.Stream/Event: every operation is a no-op on CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def record_event(self, *args: Any, **kwargs: Any) -> _NullStream:
        return _NullStream()

    def elapsed_time(self, other: Any) -> float:
        return 0.0

    def query(self) -> bool:
        return True


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


class _CudaOnCpu(types.ModuleType):
    """The ``torch.cuda`` namespace as seen by megatron modules in CPU mode."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        self.current_device = lambda: _CPU
        self.device_count = lambda: 0
        self.set_device = _noop
        self.synchronize = _noop
        self.empty_cache = _noop
        self.current_stream = lambda *a, **k: _NullStream()
        self.default_stream = lambda *a, **k: _NullStream()
        self.Stream = _NullStream
        self.Event = _NullStream
        self.stream = lambda *a, **k: contextlib.nullcontext()
        self.device = lambda *a, **k: contextlib.nullcontext()
        self.nvtx = types.SimpleNamespace(range_push=_noop, range_pop=_noop)
        self.is_current_stream_capturing = lambda: False
        # The RNG calls must reach the CPU generator (see module docstring).
        self.manual_seed = torch.manual_seed
        self.manual_seed_all = torch.manual_seed
        self.get_rng_state = lambda *a, **k: torch.get_rng_state()
        self.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        self.random = types.SimpleNamespace(get_rng_state=self.get_rng_state, set_rng_state=self.set_rng_state)
        self.FloatTensor = torch.FloatTensor
        self.HalfTensor = torch.HalfTensor
        self.BFloat16Tensor = torch.BFloat16Tensor

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "as_tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "randperm",
    "empty_strided",
    "linspace",
    "eye",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "rand_like",
    "randn_like",
)


def _cpu_factory(factory: Any) -> Any:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)  # pinning needs a CUDA driver
        return factory(*args, **kwargs)

    return wrapper


def _cpu_device(*args: Any) -> torch.device:
    if args and isinstance(args[0], str) and args[0].startswith("cuda"):
        return _CPU
    return torch.device(*args)


class _TorchOnCpu(types.ModuleType):
    """The ``torch`` module as seen by megatron modules in CPU mode."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaOnCpu()
        self.device = _cpu_device
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_TORCH_PROXY = _TorchOnCpu()


def _patch_module(module: types.ModuleType) -> None:
    if getattr(module, "torch", None) is torch:
        vars(module)["torch"] = _TORCH_PROXY


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        _patch_module(module)
        _patch_known_cuda_paths(module)


class _MegatronFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of every ``megatron.*`` module imported after CPU mode is on."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not fullname.startswith("megatron."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


# megatron functions that check or move tensors through tensor methods (``t.type() ==
# 'torch.cuda.FloatTensor'``, ``t.cuda()``), which the proxy cannot reach. During these calls, and
# only these, CPU tensors answer ``type()`` with the CUDA name and ``cuda()`` returns the tensor.
_USES_CUDA_TENSOR_METHODS = {
    "megatron.core.models.common.language_module.language_module": (
        "LanguageModule.setup_embeddings_and_output_layer",
    ),
    "megatron.core.optimizer.clip_grads": ("clip_grad_by_total_norm_fp32",),
    "megatron.core.optimizer.optimizer": ("Float16OptimizerWithFloat16Params.__init__",),
    "megatron.core.optimizer.distrib_optimizer": (
        "DistributedOptimizer.__init__",
        "DistributedOptimizer._build_model_and_main_param_groups",
        "DistributedOptimizer.get_parameter_state_dp_zero",
    ),
    "megatron.core.tensor_parallel.data": ("broadcast_data",),
}


def _cuda_style_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if args or kwargs:
        return _ORIGINAL_TENSOR_TYPE(self, *args, **kwargs)
    return _ORIGINAL_TENSOR_TYPE(self).replace("torch.", "torch.cuda.", 1)


_ORIGINAL_TENSOR_TYPE = torch.Tensor.type


def _tensors_look_like_cuda(func: Any) -> Any:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _tensor_methods(cuda=lambda t, *a, **k: t, type=_cuda_style_type):
            return func(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def _tensor_methods(**methods: Any) -> Iterator[None]:
    """Temporarily give ``torch.Tensor`` these attributes (all inherited from the C base class);
    nested uses restore the enclosing one's."""
    enclosing = {attr: torch.Tensor.__dict__.get(attr) for attr in methods}
    for attr, value in methods.items():
        setattr(torch.Tensor, attr, value)
    try:
        yield
    finally:
        for attr, previous in enclosing.items():
            if previous is None:
                delattr(torch.Tensor, attr)
            else:
                setattr(torch.Tensor, attr, previous)


def _hybrid_split_on_cpu(split: Any) -> Any:
    """``HybridDeviceOptimizer`` splits the parameters it is given by ``is_cuda``, copies the share it
    offloads with ``.cpu().pin_memory()`` and makes fp32 copies of the rest beside them. In CPU mode
    the parameters it was given, and copies made from them, stand for device tensors; ``.cpu()``
    makes a host copy; pinning is a no-op. So the split, the copies and the copy-back run as on a GPU."""
    clone, to_float = torch.Tensor.clone, torch.Tensor.float

    @functools.wraps(split)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        # The given parameters by storage (they stay alive), copies by a mark on the copy (the
        # storage of a freed temporary can be reused by a host copy).
        given = {p.untyped_storage().data_ptr() for group in self.param_groups for p in group["params"]}

        def on_device(t: torch.Tensor) -> bool:
            return getattr(t, "_cpu_mode_on_device", False) or t.untyped_storage().data_ptr() in given

        def same_place(make: Any) -> Any:
            def copy(t: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
                result = make(t, *a, **k)
                if on_device(t):
                    result._cpu_mode_on_device = True
                return result

            return copy

        with _tensor_methods(
            is_cuda=property(on_device),
            clone=same_place(clone),
            float=same_place(to_float),
            cpu=lambda t: clone(t),
            pin_memory=lambda t, *a, **k: t,
        ):
            return split(self, *args, **kwargs)

    return wrapper


def _device_moves_stay_on_cpu(func: Any) -> Any:
    """``tensor.to("cuda")`` -> the tensor on the CPU, during ``func``."""
    original_to = torch.Tensor.to

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        def to(t: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
            return original_to(t, *(_to_cpu_device(x) if isinstance(x, (str, int)) else x for x in a), **k)

        with _tensor_methods(to=to):
            return func(*args, **kwargs)

    return wrapper


def _patch_known_cuda_paths(module: types.ModuleType) -> None:
    """Narrow fixes for megatron code that calls CUDA through tensor methods or ``torch._C``."""
    name = module.__name__
    if name == "megatron.core.tensor_parallel.random":
        vars(module).update(
            _get_cuda_rng_state=lambda *a, **k: torch.get_rng_state(),
            _set_cuda_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
        )
    if name == "megatron.core.optimizer.cpu_offloading.hybrid_optimizer":
        hdo = module.HybridDeviceOptimizer
        hdo._get_sub_optimizer_param_groups = _hybrid_split_on_cpu(hdo._get_sub_optimizer_param_groups)
        hdo._move_new_state_to_right_device = _device_moves_stay_on_cpu(hdo._move_new_state_to_right_device)
    for qualified in _USES_CUDA_TENSOR_METHODS.get(name, ()):
        *owner_path, attr = qualified.split(".")
        owner = getattr(module, owner_path[0]) if owner_path else module
        raw = inspect.getattr_static(owner, attr)
        if isinstance(raw, (staticmethod, classmethod)):
            setattr(owner, attr, type(raw)(_tensors_look_like_cuda(raw.__func__)))
            continue
        wrapped = _tensors_look_like_cuda(raw)
        setattr(owner, attr, wrapped)
        if not owner_path:
            # A module-level function may already have been imported by name elsewhere (modules
            # imported later pick up the wrapped one by themselves).
            for other in list(sys.modules.values()):
                if getattr(other, "__name__", "").startswith("megatron.") and getattr(other, attr, None) is raw:
                    setattr(other, attr, wrapped)


def enable_cpu_mode() -> None:
    """Turn CPU mode on for this process (idempotent). Never called when running on a GPU."""
    global _ENABLED
    if _ENABLED:
        return
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.") and module is not None:
            _patch_module(module)
            _patch_known_cuda_paths(module)
    sys.meta_path.insert(0, _MegatronFinder())
    _ENABLED = True


def cpu_mode_enabled() -> bool:
    return _ENABLED
