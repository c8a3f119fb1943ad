"""Faults that tests arm through environment variables, so that failure paths run inside real launches.

Production code calls one hook per place a fault can strike; with no variable set each hook returns at
once and changes nothing. Tests set a variable on the launched process (by the constants below) to make
a rank produce NaN gradients or to stretch a checkpoint save until a SIGKILL can land inside it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

NAN_GRADIENTS_ENV = "MEGATRON_RLHF_FAULT_NAN_GRADIENTS"
"""``RANK:UPDATES:TIMES``: global rank RANK fills its gradients with NaN in TIMES train steps (counted
per process), each taken when the model has made UPDATES successful updates."""

SLOW_SAVE_ENV = "MEGATRON_RLHF_FAULT_SLOW_SAVE"
"""``STEP:SECONDS``: the save of step STEP sleeps SECONDS after the models' files are written (in the
training process, or in the background writer)."""

SLOW_UPLOAD_ENV = "MEGATRON_RLHF_FAULT_SLOW_UPLOAD"
"""``STEP:SECONDS``: the upload of step STEP to ``remote_dir`` sleeps SECONDS once its models' files are
uploaded (under the temporary name, before the files that complete it)."""

_nan_steps_injected = 0


def on_gradients_reduced(gradient_buffers: Sequence[torch.Tensor], updates_done: int) -> None:
    """Called by ``train_step`` before its finiteness check: fills the buffers with NaN when armed."""
    global _nan_steps_injected
    spec = os.environ.get(NAN_GRADIENTS_ENV)
    if not spec:
        return
    rank, updates, times = (int(part) for part in spec.split(":"))
    if dist.get_rank() == rank and updates_done == updates and _nan_steps_injected < times:
        _nan_steps_injected += 1
        for buffer in gradient_buffers:
            buffer.fill_(float("nan"))


def on_checkpoint_written(step: int) -> None:
    """Called once a checkpoint's files are written, before it is marked complete: sleeps when armed."""
    _sleep_if_armed(SLOW_SAVE_ENV, step)


def on_remote_files_uploaded(step: int) -> None:
    """Called by ``remote.RemoteDir.upload`` once the bulk of step ``step`` is uploaded: sleeps when armed."""
    _sleep_if_armed(SLOW_UPLOAD_ENV, step)


def _sleep_if_armed(variable: str, step: int) -> None:
    """Sleeps the seconds ``variable`` (``STEP:SECONDS``) names when ``step`` is its step."""
    spec = os.environ.get(variable)
    if spec:
        slow_step, seconds = spec.split(":")
        if int(slow_step) == step:
            time.sleep(float(seconds))
