"""Process start-up from torchrun's environment: backend, device, seeds.

nccl on GPU, gloo in CPU mode. A plain ``python -m megatron_rlhf ...`` (no torchrun) runs as a
world of one, so single-process tools (conversion, smoke runs) need no launcher.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import random
import socket
import sys
from pathlib import Path
from typing import Literal, get_args

import numpy as np
import torch
import torch.distributed as dist

from megatron_rlhf.parallel.cpu_mode import enable_cpu_mode

Device = Literal["auto", "cuda", "cpu"]
DEVICES = get_args(Device)


@dataclasses.dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"


NVIDIA_DEVICE = Path("/dev/nvidia0")
"""The first NVIDIA GPU's device file: present when the machine has one and its driver is loaded."""


def resolve_device(requested: str) -> str:
    """'auto' picks cuda when a GPU is visible, else cpu (warning once when the machine has a GPU
    torch cannot use); 'cuda' without a GPU is an error."""
    if requested not in DEVICES:
        raise ValueError(f"device={requested!r} is not valid; expected one of {list(DEVICES)}")
    if requested == "auto":
        if torch.cuda.is_available():
            return "cuda"
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1")  # hidden on purpose
        if NVIDIA_DEVICE.exists() and not hidden:
            _warn_unusable_gpu()
        return "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda was requested but no CUDA device is visible; use device=cpu")
    return requested


@functools.cache
def _warn_unusable_gpu() -> None:
    if os.environ.get("RANK", "0") == "0":
        print(
            f"warning: device=auto: this machine has an NVIDIA GPU ({NVIDIA_DEVICE}) that torch {torch.__version__} "
            f"(CUDA {torch.version.cuda}) cannot use, so the run goes to the CPU, far slower. Usually the driver is "
            "older than that CUDA needs (nvidia-smi shows its version): update it or install a torch built for it. "
            "device=cpu runs on the CPU without this warning; device=cuda makes it an error.",
            file=sys.stderr,
            flush=True,
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


DEFAULT_TIMEOUT_S = 600.0
_TIMEOUT = [datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)]


def dist_timeout() -> datetime.timedelta:
    """The collective timeout ``init_distributed`` was given: every process group made later must
    use it too (torch gives a new group its own 30-minute default otherwise)."""
    return _TIMEOUT[0]


def init_distributed(device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> DistEnv:
    """Initialise torch.distributed once per process (idempotent). A collective that waits longer
    than ``timeout_s`` for another rank (hung, stopped, dead) fails, so the job ends non-zero
    instead of hanging."""
    kind = resolve_device(device)
    if kind == "cpu":
        enable_cpu_mode()
    under_torchrun = "RANK" in os.environ
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        torch_device = torch.device("cuda", local_rank)
    else:
        torch_device = torch.device("cpu")
    if not dist.is_initialized():
        _TIMEOUT[0] = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend="nccl" if kind == "cuda" else "gloo",
            # Not under torchrun: a world of one on a private port. The environment is left alone
            # so that child processes (e.g. a torchrun this process starts) are not misled.
            init_method="env://" if under_torchrun else f"tcp://127.0.0.1:{_free_port()}",
            rank=rank,
            world_size=world,
            timeout=dist_timeout(),
            device_id=torch_device if kind == "cuda" else None,
        )
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=torch_device)


def shutdown_distributed() -> None:
    """Destroy every process group, each backend shut down in turn while every rank still runs
    (``cli.exit_before_teardown`` then exits before the interpreter's teardown)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every GPU) identically on all ranks."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
