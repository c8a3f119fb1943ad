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

Saves are synchronous, or written in the background by a forked process while training continues
(``RunCheckpointWriter``, ``async_save``); either way ``step_N.tmp`` is renamed only after every
rank's files are complete.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from megatron_rlhf.checkpoint.mcore import load_mcore_checkpoint, mcore_save_request
from megatron_rlhf.checkpoint.train_state import load_train_state, train_state_save_request
from megatron_rlhf.engine.optim import TrainState
from megatron_rlhf.metrics.log import log
from megatron_rlhf.models.roles import RoleModel

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
RUN_STATE_FILE = "run_state.json"
_STEP_DIR = re.compile(r"step_(\d+)")

TEST_SLOW_SAVE_ENV = "MEGATRON_RLHF_TEST_SLOW_SAVE"
"""Test hook, ``STEP:SECONDS``: the save of step STEP sleeps SECONDS after the models' files are
written (in the training process, or in the background writer), so that a test's SIGKILL lands
inside a save. Never set outside tests."""


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


class RunCheckpointWriter:
    """Collective, every method: writes a run's checkpoints under ``root``.

    Synchronous (``background=False``): ``save`` returns when the checkpoint is complete.
    In the background: ``save`` stages every model's shards in host memory (megatron's preload),
    forks one process that writes them, model after model, and returns; training continues. Once
    every rank's writer is done, ``poll`` (non-blocking, at each step boundary) or ``wait``
    completes the checkpoint in the training process: each model's ``.metadata`` and manifest,
    the run's small files, the rename of ``step_N.tmp`` and ``latest``. One checkpoint is in flight
    at most: ``save`` first waits for the previous one.

    One writer process per checkpoint, writing in order, is what makes this correct: megatron-core
    0.19.2 returns every save's write results through ONE process-wide queue
    (``filesystem_async.get_write_results_queue``), and a request's finalize takes the first result
    in it (``FileSystemWriterAsync.retrieve_write_results``: ``get_nowait()``), not its own. With
    two requests in flight (one per model) a finalize can take the other model's results, and its
    ``.metadata`` then points into the wrong files: ``common_state`` does not unpickle ("invalid
    load key"), a shard does not load. Seen at one rank with a large and a small save (the small
    one finished first), and in a 2-rank run (actor TP2 + critic PP2, one request per model: resume
    failed with "Duplicate non-dict and non-list values"); with one writer, both resume bit-exactly."""

    def __init__(self, root: Path, *, keep_last: int, background: bool) -> None:
        self.root = root
        self.keep_last = keep_last
        self._in_flight = AsyncCallsQueue(persistent=False) if background else None

    def save(
        self, step: int, *, train_states: dict[str, TrainState], weights: dict[str, RoleModel],
        run_state: dict[str, Any], config_yaml: str,
    ) -> None:  # fmt: skip
        """Writes ``root/step_<step>`` (through ``step_<step>.tmp``), points ``latest`` at it, then
        deletes all but the newest ``keep_last`` complete checkpoints; in the background, returns once
        the writer has started."""
        self.wait()
        tmp = self.root / f"step_{step}.tmp"
        rank = dist.get_rank()
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / "rng").mkdir(parents=True)
        dist.barrier()
        torch.save(_rng_states(), tmp / "rng" / f"rank{rank:05d}.pt")
        # As JSON now: the caller's objects change while a background save is written.
        run_state_json = json.dumps({"step": step, **run_state}, indent=2) + "\n"
        requests = _save_requests(tmp, train_states, weights)
        if self._in_flight is None:
            for request in requests:
                request.execute_sync()
            _pause_for_test(step)
            self._complete(step, run_state_json, config_yaml, started=None)
            return
        started = time.perf_counter()
        complete = functools.partial(self._complete, step, run_state_json, config_yaml, started)
        self._in_flight.schedule_async_request(_one_writer(list(requests), complete, step))
        log(f"step {step}: writing checkpoint {tmp} in the background")

    def poll(self) -> None:
        """Completes the checkpoint in flight if every rank's writer is done; never waits."""
        if self._in_flight is not None:
            self._in_flight.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        """Waits for the checkpoint in flight and completes it."""
        if self._in_flight is not None:
            self._in_flight.maybe_finalize_async_calls(blocking=True)

    def _complete(self, step: int, run_state_json: str, config_yaml: str, started: float | None) -> None:
        """After every model's files are complete on every rank. ``started``: when a background
        write began."""
        tmp, final = self.root / f"step_{step}.tmp", self.root / f"step_{step}"
        if dist.get_rank() == 0:
            (tmp / "config.yaml").write_text(config_yaml)
            (tmp / RUN_STATE_FILE).write_text(run_state_json)
            if final.exists():  # a checkpoint of the same step from an earlier run (resume=never)
                shutil.rmtree(final)
            os.replace(tmp, final)
            _write_atomically(self.root / LATEST_FILE, final.name + "\n")
            for old in complete_checkpoints(self.root)[:-self.keep_last]:
                shutil.rmtree(old)
        dist.barrier()
        background = "" if started is None else f" (written in the background in {time.perf_counter() - started:.1f} s)"
        log(f"step {step}: saved checkpoint {final}{background}")


def _save_requests(tmp: Path, train_states: dict[str, TrainState], weights: dict[str, RoleModel]) -> Iterator[AsyncRequest]:
    """Every model's save, planned one at a time (collective), so that a synchronous save writes
    each before the next is planned and staged."""
    for name, state in train_states.items():
        yield train_state_save_request(state, tmp / "models" / name)
    for name, role in weights.items():
        yield mcore_save_request(role.model, role.arch, role.groups, tmp / "weights" / name)


def _one_writer(requests: list[AsyncRequest], complete: Callable[[], None], step: int) -> AsyncRequest:
    """One request for one background process that writes the requests' files in their order;
    their finalize functions run in the same order, then ``complete``. The shards are staged in
    host memory here, before the fork (on CPU the fork's copy-on-write memory is the snapshot)."""
    writes = []
    for request in requests:
        args = list(request.async_fn_args)
        if request.preload_fn is not None:
            args[1] = request.preload_fn()  # the (path, key, (bytes, tensors)) buckets, staged on the host
        if request.async_fn is not None:
            writes.append(functools.partial(request.async_fn, *args, **request.async_fn_kwargs))

    def write_all() -> None:
        for write in writes:
            write()
        _pause_for_test(step)

    return AsyncRequest(write_all, (), [fn for request in requests for fn in request.finalize_fns] + [complete])


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
