"""A whole run's checkpoint: every trained model's train state, other weights that change during the
run, the trainer's own state, the loop's position and summary, RNG states and the resolved config.

Layout under ``<output_dir>/checkpoints/``::

    step_N/                 one complete checkpoint (written as step_N.tmp/, renamed when complete)
      models/<name>/        train_state.py's format (weights + optimizer + LR schedule), per trained model
      weights/<name>/       mcore.py's model checkpoint, per model whose weights change without an optimizer
      rng/rankXXXXX.pt      python, numpy, torch and megatron tracker RNG states of each rank, as
                            tensors and plain values (``torch.load(weights_only=True)``: no pickle)
      config.yaml           the resolved config of the run that wrote it
      metrics.jsonl         the run's metrics.jsonl as it was at this step (its history travels with
                            the checkpoint, to a node that lacks it); absent without the jsonl logger
      run_state.json        step, loop summary, the trainer's state
      manifest.json         SHA-256 of every file above, written last, inside the .tmp dir
    latest                  ``step_N``: the newest complete checkpoint (written to latest.tmp, renamed)

A crash at any point leaves the previous checkpoint and ``latest`` intact: a ``.tmp`` directory is
never read, and older checkpoints are deleted only after a newer one is complete and ``latest``
names it (each renamed to ``step_N.removing.tmp`` first, so a kill while deleting leaves a ``.tmp``
that the next start removes). A failed write (a full disk) raises an error naming the file, and leaves the same.

Every file is covered by the manifest: the small files by their hash in ``manifest.json``, each
model's dist_checkpointing files by megatron's ``integrity.json`` in their directory (hashed as
they were written, checked when they load), whose own hash is in ``manifest.json``. Loading checks
the manifest first, before anything is read: a changed, missing or unexpected file, or a missing
manifest, makes the checkpoint unusable (``UnusableCheckpoint``, naming the file), and
``resume=auto`` falls back to the previous one. dist_checkpointing unpickles ``.metadata`` and the
shards' non-tensor items, so a checkpoint without a manifest (written before manifests were kept)
is loaded only with ``trust_unverified_checkpoint=true``.

Saves are synchronous, or written in the background by a forked process while training continues
(``RunCheckpointWriter``, ``async_save``); either way ``step_N.tmp`` is renamed only after every
rank's files are complete.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import pickle
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
from megatron.core.dist_checkpointing.core import CONFIG_FNAME, CheckpointingException
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from megatron.core.dist_checkpointing.validation import INTEGRITY_FNAME
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from torch.distributed.checkpoint.api import CheckpointException

from megatron_rlhf.checkpoint.mcore import (
    load_mcore_checkpoint,
    mcore_save_request,
    results_in_this_process,
    write_bytes,
)
from megatron_rlhf.checkpoint.train_state import load_train_state, train_state_save_request
from megatron_rlhf.debug import faults
from megatron_rlhf.metrics.log import log
from megatron_rlhf.models.roles import RoleModel
from megatron_rlhf.training.optim import TrainState

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
RUN_STATE_FILE = "run_state.json"
METRICS_FILE = "metrics.jsonl"
MANIFEST_FILE = "manifest.json"
REMOVING_SUFFIX = ".removing.tmp"
"""A checkpoint being deleted (``delete_checkpoint``)."""
_STEP_DIR = re.compile(r"step_(\d+)")


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR


def step_of(name: str) -> int | None:
    """The step of a checkpoint directory's name ``step_N``; None for any other name (``step_N.tmp``)."""
    match = _STEP_DIR.fullmatch(name)
    return None if match is None else int(match.group(1))


def is_complete(ckpt: Path) -> bool:
    """A finished checkpoint: a ``step_N`` directory (not ``.tmp``) holding ``run_state.json``."""
    return step_of(ckpt.name) is not None and (ckpt / RUN_STATE_FILE).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest step first."""
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir() if path.is_dir() and is_complete(path)]
    return sorted(found, key=lambda path: int(path.name.removeprefix("step_")))


def incomplete_checkpoints(root: Path) -> list[Path]:
    """The ``step_N`` directories under ``root`` without ``run_state.json``, by name: never resumed."""
    if not root.is_dir():
        return []
    return sorted(path for path in root.iterdir() if step_of(path.name) is not None and not is_complete(path))


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


def remove_beyond(root: Path, step: int) -> list[Path]:
    """Rank 0: delete the complete checkpoints of steps after ``step``, those of a run that this one
    replaces (a fresh start: ``step`` 0) or continues from an earlier point (a resume from an older
    checkpoint, a rollback): left, they would be pruned in place of the new ones, and a resume
    would take the newest of them. ``latest`` then names ``step_<step>``, or nothing."""
    beyond = [path for path in complete_checkpoints(root) if int(path.name.removeprefix("step_")) > step]
    for path in beyond:
        delete_checkpoint(path)
    pointer = root / LATEST_FILE
    if beyond and pointer.is_file():
        kept = root / f"step_{step}"
        if is_complete(kept):
            write_atomically(pointer, kept.name + "\n")
        else:
            pointer.unlink()
    return beyond


def delete_checkpoint(path: Path) -> None:
    """Rank 0: delete a checkpoint directory, renamed first to ``<name>.removing.tmp``: a kill
    midway leaves a ``.tmp`` that the next start deletes (``remove_partial``), never a half-deleted
    ``step_N`` that nothing would read or report again."""
    doomed = path.with_name(f"{path.name}{REMOVING_SUFFIX}")
    if doomed.exists():
        shutil.rmtree(doomed)
    os.replace(path, doomed)
    shutil.rmtree(doomed)


def remove_partial(root: Path) -> list[Path]:
    """Rank 0: delete ``.tmp`` leftovers of interrupted saves, and of interrupted deletions
    (``REMOVING_SUFFIX``); returns what it deleted."""
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

    def __init__(
        self,
        root: Path,
        *,
        keep_last: int,
        background: bool,
        on_complete: Callable[[Path, str | None], None] | None = None,
    ) -> None:
        self.root = root
        self.keep_last = keep_last
        self.on_complete = on_complete
        """Rank 0, once a checkpoint is complete and ``latest`` names it: called with its directory
        and ``pinned`` (``remote.RemoteMirror`` starts its upload)."""
        self.pinned: str | None = None
        """A checkpoint's name (``step_N``) that pruning keeps whatever ``keep_last`` says: the health
        watch's best evaluation, which a rollback goes back to."""
        self._in_flight = AsyncCallsQueue(persistent=False) if background else None

    def save(
        self,
        step: int,
        *,
        train_states: dict[str, TrainState],
        weights: dict[str, RoleModel],
        run_state: dict[str, Any],
        config_yaml: str,
        history: str = "",
    ) -> None:
        """Writes ``root/step_<step>`` (through ``step_<step>.tmp``), points ``latest`` at it, then
        deletes all but the newest ``keep_last`` complete checkpoints; in the background, returns once
        the writer has started. ``history``: metrics.jsonl's text so far ("": none)."""
        self.wait()
        tmp = self.root / f"step_{step}.tmp"
        rank = dist.get_rank()
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / "rng").mkdir(parents=True)
        dist.barrier()
        buffer = io.BytesIO()
        torch.save(_rng_states(), buffer)
        write_bytes(tmp / "rng" / f"rank{rank:05d}.pt", buffer.getvalue())
        # As JSON now: the caller's objects change while a background save is written.
        run_state_json = json.dumps({"step": step, **run_state}, indent=2) + "\n"
        requests = _save_requests(tmp, train_states, weights)
        if self._in_flight is None:
            with _failed_writes_named(), results_in_this_process():
                for request in requests:
                    request.execute_sync()
            faults.on_checkpoint_written(step)
            self._complete(step, run_state_json, config_yaml, history, started=None)
            return
        started = time.perf_counter()
        complete = functools.partial(self._complete, step, run_state_json, config_yaml, history, started)
        self._in_flight.schedule_async_request(_one_writer(list(requests), complete, step))
        log(f"step {step}: writing checkpoint {tmp} in the background")

    def poll(self) -> None:
        """Completes the checkpoint in flight if every rank's writer is done; never waits."""
        if self._in_flight is not None:
            with _failed_writes_named():
                self._in_flight.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        """Waits for the checkpoint in flight and completes it."""
        if self._in_flight is not None:
            with _failed_writes_named():
                self._in_flight.maybe_finalize_async_calls(blocking=True)

    def _complete(self, step: int, run_state_json: str, config_yaml: str, history: str, started: float | None) -> None:
        """After every model's files are complete on every rank. ``started``: when a background
        write began."""
        tmp, final = self.root / f"step_{step}.tmp", self.root / f"step_{step}"
        dist.barrier()  # every rank's files are written before rank 0 hashes them
        if dist.get_rank() == 0:
            write_bytes(tmp / "config.yaml", config_yaml.encode())
            if history:
                write_bytes(tmp / METRICS_FILE, history.encode())
            write_bytes(tmp / RUN_STATE_FILE, run_state_json.encode())
            _write_manifest(tmp)
            if final.exists():  # a checkpoint of the same step from an earlier run, or an incomplete one
                delete_checkpoint(final)
                log(f"removed {final}: replaced by this run's checkpoint of step {step}")
            os.replace(tmp, final)
            write_atomically(self.root / LATEST_FILE, final.name + "\n")
            for old in complete_checkpoints(self.root)[: -self.keep_last] if self.keep_last else []:
                if old.name != self.pinned:
                    delete_checkpoint(old)
            if self.on_complete is not None:
                self.on_complete(final, self.pinned)
        dist.barrier()
        background = "" if started is None else f" (written in the background in {time.perf_counter() - started:.1f} s)"
        log(f"step {step}: saved checkpoint {final}{background}")


@contextlib.contextmanager
def _failed_writes_named() -> Iterator[None]:
    """A shard write that failed (in megatron's writer, in this process or the background one)
    reaches the save's finalize as torch's ``CheckpointException``: a ``BaseException``, which
    passes every ``except Exception``, whose text is a traceback per rank. Raised instead as a
    ``RuntimeError`` with each rank's error (the file and the cause: ``mcore._write_error``)."""
    try:
        yield
    except CheckpointException as err:
        causes = "; ".join(f"rank {rank}: {failure[0]}" for rank, failure in sorted(err.failures.items()))
        raise RuntimeError(
            f"a checkpoint could not be written ({causes}); latest still names the previous one, and "
            "the next start deletes the partial step_N.tmp"
        ) from err


def _save_requests(
    tmp: Path, train_states: dict[str, TrainState], weights: dict[str, RoleModel]
) -> Iterator[AsyncRequest]:
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
        faults.on_checkpoint_written(step)

    return AsyncRequest(write_all, (), [fn for request in requests for fn in request.finalize_fns] + [complete])


class UnusableCheckpoint(Exception):
    """A complete checkpoint that cannot be read: a file changed, missing or not part of it (named),
    no manifest (without ``trust_unverified_checkpoint``), unreadable contents. Raised on every rank
    alike (the checks are made by one rank and shared, or read the same files)."""


def load_run_checkpoint(
    ckpt: Path, *, train_states: dict[str, TrainState], weights: dict[str, RoleModel], trust_unverified: bool = False
) -> dict[str, Any]:
    """Collective. Checks the checkpoint against its manifest (``trust_unverified``: one without a
    manifest is loaded unchecked), fills the models (any layout) and restores this rank's RNG states
    when the checkpoint has them (same world size); returns the saved ``run_state`` (with ``step``)."""
    if not is_complete(ckpt):
        raise FileNotFoundError(f"{ckpt / RUN_STATE_FILE}: missing; {ckpt} is not a complete run checkpoint")
    verified = _verify_manifest(ckpt, trust_unverified=trust_unverified)
    run_state = _read(ckpt, ckpt / RUN_STATE_FILE, lambda path: json.loads(path.read_bytes()))
    rng_file = ckpt / "rng" / f"rank{dist.get_rank():05d}.pt"
    # Unverified means trusted by the user: it may hold the pickled RNG states of the format before.
    rng = _read(ckpt, rng_file, functools.partial(torch.load, weights_only=verified)) if rng_file.is_file() else None
    try:
        for name, state in train_states.items():
            load_train_state(state, ckpt / "models" / name)
        for name, role in weights.items():
            load_mcore_checkpoint(role.model, role.groups, ckpt / "weights" / name)
    except (CheckpointingException, FileNotFoundError, ValueError) as err:  # ValueError: bytes that do not decode
        raise UnusableCheckpoint(f"checkpoint {ckpt} is unusable: {err}") from err
    if rng is not None:
        _set_rng_states(rng)
    return run_state


def _read(ckpt: Path, path: Path, read: Callable[[Path], Any]) -> Any:
    """``read(path)``; a file that does not parse (or, read weights-only, holds more than tensors
    and plain values) makes ``ckpt`` unusable, naming the file."""
    try:
        return read(path)
    except (ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as err:
        raise UnusableCheckpoint(f"checkpoint {ckpt} is unusable: {path}: {err}") from err


def _write_manifest(ckpt: Path) -> None:
    """Rank 0, once every other file of ``ckpt`` is written: ``manifest.json``, the SHA-256 of each
    file, except those a dist_checkpointing directory's ``integrity.json`` lists (megatron hashed
    them as it wrote them; that ``integrity.json`` is hashed here)."""
    dist_manifests = [rel for rel in files_under(ckpt) if Path(rel).name == INTEGRITY_FNAME]
    covered = _listed_in(ckpt, dist_manifests)
    files = {rel: file_sha256(ckpt / rel) for rel in files_under(ckpt) if rel not in covered}
    write_bytes(ckpt / MANIFEST_FILE, (json.dumps({"algorithm": "sha256", "files": files}, indent=2) + "\n").encode())


def _verify_manifest(ckpt: Path, *, trust_unverified: bool) -> bool:
    """Collective: checks every file of ``ckpt`` against ``manifest.json`` (rank 0 hashes, every
    rank gets the verdict) before anything in it is read. Returns False for a checkpoint without a
    manifest, loaded unverified because ``trust_unverified``; raises ``UnusableCheckpoint`` naming
    each changed, missing or unexpected file, or the missing manifest."""
    verdict: list[list[str] | None] = [None]
    if dist.get_rank() == 0 and (ckpt / MANIFEST_FILE).is_file():
        verdict = [_manifest_problems(ckpt)]
    dist.broadcast_object_list(verdict, src=0)
    problems = verdict[0]
    if problems is None:
        if not trust_unverified:
            raise UnusableCheckpoint(
                f"checkpoint {ckpt} is unusable: {ckpt / MANIFEST_FILE} is missing, so no file of it can be checked "
                "before it is read (dist_checkpointing unpickles its metadata, which can run code); if you trust "
                "this checkpoint (e.g. one written before manifests were kept), set trust_unverified_checkpoint=true"
            )
        log(f"warning: {ckpt} has no {MANIFEST_FILE}: loading it unverified (trust_unverified_checkpoint=true)")
        return False
    if problems:
        raise UnusableCheckpoint(f"checkpoint {ckpt} is unusable: " + "; ".join(problems))
    return True


def manifest_problems(ckpt: Path) -> list[str] | None:
    """Each file of ``ckpt`` that differs from its manifest: changed, missing, or in neither
    ``manifest.json`` nor a (verified) ``integrity.json``; None without a manifest. One process's
    check (``load_run_checkpoint`` shares rank 0's with the others)."""
    return _manifest_problems(ckpt) if (ckpt / MANIFEST_FILE).is_file() else None


def copy_problems(ckpt: Path) -> list[str] | None:
    """``manifest_problems``, and then each shard file that differs from the (verified)
    ``integrity.json`` listing it: a whole check, by one process, of a checkpoint copied from
    elsewhere (``remote.py``), whose shards megatron would otherwise check only as they load."""
    problems = manifest_problems(ckpt)
    if problems is None or problems:
        return problems
    for rel in files_under(ckpt):
        if Path(rel).name != INTEGRITY_FNAME:
            continue
        folder = (ckpt / rel).parent
        for name, expected in json.loads((ckpt / rel).read_bytes())["files"].items():
            path = folder / name
            if not path.is_file():
                problems.append(f"{path}: missing (listed in {ckpt / rel})")
            elif file_sha256(path) != expected:
                problems.append(f"{path}: changed since the save (listed in {ckpt / rel})")
    return problems


def _manifest_problems(ckpt: Path) -> list[str]:
    manifest = ckpt / MANIFEST_FILE
    try:
        listed = json.loads(manifest.read_bytes())["files"]
    except (ValueError, KeyError, TypeError) as err:
        return [f"{manifest}: unreadable ({err!r})"]
    problems = []
    for rel, expected in listed.items():
        path = ckpt / rel
        if not path.is_file():
            problems.append(f"{path}: missing (listed in {MANIFEST_FILE})")
        elif (actual := file_sha256(path)) != expected:
            problems.append(f"{path}: changed since the save (SHA-256 {actual[:16]}..., expected {expected[:16]}...)")
    if problems:  # the dist directories' integrity.json are trusted only once they are unchanged
        return problems
    covered = _listed_in(ckpt, [rel for rel in listed if Path(rel).name == INTEGRITY_FNAME])
    return [
        f"{ckpt / rel}: not part of the checkpoint (listed in neither {MANIFEST_FILE} nor an {INTEGRITY_FNAME})"
        for rel in files_under(ckpt)
        if rel not in listed and rel not in covered and rel != MANIFEST_FILE
    ]


def files_under(ckpt: Path) -> list[str]:
    """Every file under ``ckpt``, as a path relative to it (sorted)."""
    return sorted(path.relative_to(ckpt).as_posix() for path in ckpt.rglob("*") if path.is_file())


def _listed_in(ckpt: Path, dist_manifests: list[str]) -> set[str]:
    """The files (relative to ``ckpt``) that the dist_checkpointing ``integrity.json`` files list and
    check before they are read: all but ``metadata.json``, which dist_checkpointing reads first (to
    recognise the directory) and ``manifest.json`` therefore hashes too."""
    listed: set[str] = set()
    for rel in dist_manifests:
        folder = Path(rel).parent
        listed.update(
            (folder / name).as_posix()
            for name in json.loads((ckpt / rel).read_bytes())["files"]
            if name != CONFIG_FNAME
        )
    return listed


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, hex, read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _rng_states() -> dict[str, Any]:
    """This rank's generators, as tensors and plain values that ``torch.load(weights_only=True)``
    reads back: python's state is a tuple of ints, numpy's key array a tensor."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    states: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "numpy": (name, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, gauss),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    name, key, *rest = states["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), *rest))  # a tensor, or a checkpoint's older array
    torch.set_rng_state(states["torch"])
    get_cuda_rng_tracker().set_states(states["tracker"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def write_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text`` once complete, never part of it (written beside it, renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    write_bytes(tmp, text.encode())
    os.replace(tmp, path)
