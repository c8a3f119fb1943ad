"""A whole run's checkpoint: every trained model's train state, other weights that change during the
run, the trainer's own state, the loop's position and summary, RNG states and the resolved config.

Layout under ``<output_dir>/checkpoints/``::

    step_N/                 one complete checkpoint (written as step_N.tmp/, renamed when complete)
      models/<name>/        train_state.py's format (weights + optimizer + LR schedule), per trained model
      weights/<name>/       mcore.py's model checkpoint, per model whose weights change without an optimizer
      rng/rankXXXXX.pt      python, numpy, torch and megatron tracker RNG states of each rank
      config.yaml           the resolved config of the run that wrote it
      run_state.json        step, loop summary, the trainer's state; written last, inside the .tmp dir
    latest                  ``step_N``: the newest complete checkpoint (written to latest.tmp, renamed)

A crash at any point leaves the previous checkpoint and ``latest`` intact: a ``.tmp`` directory is
never read, and older checkpoints are deleted only after a newer one is complete and ``latest``
names it.

Saves are synchronous. megatron-core 0.19.2's async save (``async_sharded_save=True``, the "mcore"
strategy; "nvrx" is not installed) was tried on CPU/gloo: one model at 2 ranks round-tripped, but a
run checkpoint (actor TP2 + critic PP2, two requests in flight) wrote a ``common_state`` object
that does not unpickle (``UnpicklingError: invalid load key``; ``load`` then fails with "Duplicate
non-dict and non-list values: None and {}"). An unloadable checkpoint is worse than a slower one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from megatron_rlhf.checkpoint.mcore import load_mcore_checkpoint, save_mcore_checkpoint
from megatron_rlhf.checkpoint.train_state import load_train_state, save_train_state
from megatron_rlhf.engine.optim import TrainState
from megatron_rlhf.models.roles import RoleModel

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
RUN_STATE_FILE = "run_state.json"
_STEP_DIR = re.compile(r"step_(\d+)")

TEST_SLOW_SAVE_ENV = "MEGATRON_RLHF_TEST_SLOW_SAVE"
"""Test hook, ``STEP:SECONDS``: the save of step STEP sleeps SECONDS after the models' files are
written, so that a test's SIGKILL lands inside a save. Never set outside tests."""


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR


def is_complete(ckpt: Path) -> bool:
    """A finished checkpoint: a ``step_N`` directory (not ``.tmp``) holding ``run_state.json``."""
    return _STEP_DIR.fullmatch(ckpt.name) is not None and (ckpt / RUN_STATE_FILE).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest step first."""
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir() if path.is_dir() and is_complete(path)]
    return sorted(found, key=lambda path: int(path.name.removeprefix("step_")))


def newest_checkpoint(root: Path) -> Path | None:
    """What ``latest`` names if it is complete, else the highest complete step (``latest`` is written
    after the rename, so a crash in between leaves it one checkpoint behind)."""
    found = complete_checkpoints(root)
    pointer = root / LATEST_FILE
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if is_complete(named) and (not found or int(named.name[5:]) >= int(found[-1].name[5:])):
            return named
    return found[-1] if found else None


def remove_partial(root: Path) -> list[Path]:
    """Rank 0: delete ``.tmp`` leftovers of interrupted saves; returns what it deleted."""
    if not root.is_dir():
        return []
    partial = [path for path in root.iterdir() if path.name.endswith(".tmp")]
    for path in partial:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return partial


def save_run_checkpoint(
    root: Path, step: int, *, train_states: dict[str, TrainState], weights: dict[str, RoleModel],
    run_state: dict[str, Any], config_yaml: str, keep_last: int,
) -> Path:  # fmt: skip
    """Collective. Writes ``root/step_<step>`` atomically, points ``latest`` at it, then deletes all
    but the newest ``keep_last`` complete checkpoints. Returns the checkpoint's directory."""
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "rng").mkdir(parents=True)
    dist.barrier()
    for name, state in train_states.items():
        save_train_state(state, tmp / "models" / name)
    _pause_for_test(step)
    for name, role in weights.items():
        save_mcore_checkpoint(role.model, role.arch, role.groups, tmp / "weights" / name)
    torch.save(_rng_states(), tmp / "rng" / f"rank{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        (tmp / "config.yaml").write_text(config_yaml)
        (tmp / RUN_STATE_FILE).write_text(json.dumps({"step": step, **run_state}, indent=2) + "\n")
        if final.exists():  # a checkpoint of the same step from an earlier run (resume=never)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomically(root / LATEST_FILE, final.name + "\n")
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old)
    dist.barrier()
    return final


class UnusableCheckpoint(Exception):
    """A complete checkpoint that cannot be read: changed bytes (its integrity manifest names the
    file), a missing file, unreadable JSON. Raised on every rank alike (the checks are made by one
    rank and shared, or read the same files)."""


def load_run_checkpoint(ckpt: Path, *, train_states: dict[str, TrainState], weights: dict[str, RoleModel]) -> dict[str, Any]:
    """Collective. Fills the models (any layout) and restores this rank's RNG states when the
    checkpoint has them (same world size); returns the saved ``run_state`` (with ``step``)."""
    if not is_complete(ckpt):
        raise FileNotFoundError(f"{ckpt / RUN_STATE_FILE}: missing; {ckpt} is not a complete run checkpoint")
    try:
        run_state = json.loads((ckpt / RUN_STATE_FILE).read_text())
        for name, state in train_states.items():
            load_train_state(state, ckpt / "models" / name)
        for name, role in weights.items():
            load_mcore_checkpoint(role.model, role.groups, ckpt / "weights" / name)
    except (CheckpointingException, FileNotFoundError, json.JSONDecodeError) as err:
        raise UnusableCheckpoint(f"checkpoint {ckpt} is unusable: {err}") from err
    rng_file = ckpt / "rng" / f"rank{dist.get_rank():05d}.pt"
    if rng_file.is_file():
        _set_rng_states(torch.load(rng_file, weights_only=False))
    return run_state


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                              "tracker": get_cuda_rng_tracker().get_states()}  # fmt: skip
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    get_cuda_rng_tracker().set_states(states["tracker"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def _pause_for_test(step: int) -> None:
    spec = os.environ.get(TEST_SLOW_SAVE_ENV)
    if spec:
        slow_step, seconds = spec.split(":")
        if int(slow_step) == step:
            time.sleep(float(seconds))


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
