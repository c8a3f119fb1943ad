"""A run's checkpoints mirrored to remote storage (``remote_dir``: any fsspec URL), so that a job
requeued onto another node, which does not see the first node's disk, resumes from them.

Layout under ``remote_dir`` (``s3://bucket/prefix`` and ``s3://bucket/prefix/`` are the same place)::

    step_N/         a copy of the local ``checkpoints/step_N`` (its manifest included)
    step_N.tmp/     an upload in progress: never read, deleted by the next upload
    latest          ``step_N``: written last, once step_N is complete

Upload (rank 0, in a background thread: ``RemoteMirror``), after each local checkpoint is complete:
leftovers of an interrupted upload are deleted; every file goes to ``step_N.tmp/``,
``run_state.json`` and ``manifest.json`` last; the directory is renamed to ``step_N`` (a rename on a
file system; on an object store, which has none, a server-side copy of each object, those two last,
then the ``.tmp`` objects are deleted); ``latest`` is written (one PUT, atomic on an object store;
written beside and renamed on a file system); then the step directories after ``step_N`` (another
branch of the run: it continues from an earlier step) and all but the newest ``keep_last`` complete
checkpoints are deleted. Only the steps up to the one ``latest`` names count as complete: a crash
at any point leaves the previous remote checkpoint in use.

Going back (a resume from an older checkpoint, a rollback, a fresh start with overwrite=true): as
locally, the later checkpoints go at once, ``latest`` first (``RemoteDir.remove_beyond``).

Download (``resume=auto``): when the remote is further along than the newest local checkpoint (there
is none, or it is a stale copy: fewer rollbacks behind it, or an earlier step), the newest complete
remote checkpoint is copied to ``checkpoints/step_N.tmp``, checked against its manifest and the
shards' ``integrity.json`` (a changed or missing file: the previous remote one is tried), renamed
to ``step_N`` and named by the local ``latest`` (local checkpoints after it go: stale, or another
branch's); the run then resumes from it as from any local checkpoint. Whole step directories after
``latest`` (an upload stopped between its copy and ``latest``) count too, unless fewer rollbacks are
behind them than behind ``latest``'s (a branch a rollback left). A local checkpoint found unusable as
it loads is replaced by the remote copy of its step where there is one (``RemoteMirror.restore``). A
run refuses to start where it would delete remote checkpoints it cannot account for: newer ones all
unusable with no local one to continue, a ``latest`` that names no step, and, with resume=never, any
without overwrite=true.

fsspec (and the package of a protocol: s3fs for ``s3://``, gcsfs for ``gs://``) is imported only
when a run uses ``remote_dir``. Credentials and endpoints come from the environment the way each
package reads them (s3fs: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``,
``AWS_PROFILE``, ...), or from fsspec's ``FSSPEC_<PROTOCOL>_<OPTION>`` variables. ``hdfs://`` goes
through pyarrow's ``HadoopFileSystem`` (libhdfs, a JVM and ``CLASSPATH``): untested here.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_rlhf.checkpoint.run_checkpoint import (
    LATEST_FILE,
    MANIFEST_FILE,
    RUN_STATE_FILE,
    copy_problems,
    files_under,
    step_of,
    write_atomically,
)
from megatron_rlhf.debug import faults
from megatron_rlhf.metrics.log import log

OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"})
"""Protocols without directories or a rename: nothing is created before a write (a bucket is
never created), and a rename is a copy of each object."""
LAST_FILES = (RUN_STATE_FILE, MANIFEST_FILE)
"""Uploaded after every other file of a checkpoint (on an object store copied to the final name
manifest first, run_state.json last: a step directory holding run_state.json is whole)."""


class RemoteStorageError(Exception):
    """``remote_dir`` cannot be used: fsspec or the protocol's package is missing, the bucket or
    directory does not exist, it cannot be written, libhdfs is absent. The message names the URL."""


class RemoteDir:
    """The checkpoints under one ``remote_dir`` (one process uses it: rank 0)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = _filesystem(self.url)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.object_store = bool(OBJECT_STORES.intersection(protocols))

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def check_writable(self) -> None:
        """Writes and deletes a probe file, so that a missing bucket, a wrong endpoint or missing
        write permission stops the run at start-up, named, instead of at its first save."""
        probe = self.path(f".write-probe-{os.uname().nodename}-{os.getpid()}")
        try:
            if not self.object_store:
                self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(probe, b"megatron-rlhf write probe\n")
            self.fs.rm_file(probe)
        except FileNotFoundError as err:
            what = "the bucket does not exist" if self.object_store else "it does not exist"
            raise RemoteStorageError(
                f"remote_dir={self.url!r} cannot be used: {what} ({err}); create it first"
                + (" (a bucket is never created by a run)" if self.object_store else "")
            ) from err
        except PermissionError as err:
            raise RemoteStorageError(
                f"remote_dir={self.url!r} cannot be written: permission denied ({err}); check the credentials "
                "in the environment (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE) and the "
                "bucket's policy"
            ) from err
        except OSError as err:
            raise RemoteStorageError(f"remote_dir={self.url!r} cannot be written: {err!r}") from err

    def latest(self) -> int | None:
        """The step ``latest`` names (None: no upload completed). ``RemoteStorageError`` when it
        holds anything but ``step_N``: which checkpoints are complete is then unknown."""
        try:
            text = self.fs.cat_file(self.path(LATEST_FILE)).decode(errors="replace").strip()
        except FileNotFoundError:
            return None
        step = step_of(text)
        if step is None:
            raise RemoteStorageError(
                f"{self.url}/{LATEST_FILE} holds {text[:60]!r}, expected 'step_N' (the checkpoint uploaded "
                f"last): write the newest complete step_N into it, or remove it"
            )
        return step

    def complete_steps(self) -> list[int]:
        """The complete remote checkpoints' steps, oldest first: those up to the one ``latest``
        names that hold ``run_state.json`` (a copy beyond it may be partial)."""
        latest = self.latest()
        return [] if latest is None else [step for step in self.held_steps() if step <= latest]

    def held_steps(self) -> list[int]:
        """The steps of every ``step_N`` directory holding ``run_state.json``, oldest first, whatever
        ``latest`` says: each holds a whole checkpoint's files (they are uploaded, and copied to
        their name, before it), complete unless an upload stopped between that copy and ``latest``."""
        return sorted(step for step, name in self._step_dirs() if self.fs.exists(self.path(name, RUN_STATE_FILE)))

    def lineage(self, step: int) -> tuple[int, int] | None:
        """``lineage`` of the remote ``step_N``; None when its run_state.json does not parse."""
        try:
            run_state = json.loads(self.fs.cat_file(self.path(f"step_{step}", RUN_STATE_FILE)))
        except ValueError:
            return None
        return lineage(run_state, f"step_{step}")

    def _entries(self) -> list[str]:
        """The names directly under the root (none before the first upload)."""
        try:
            return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []

    def _step_dirs(self) -> list[tuple[int, str]]:
        """(step, name) of each ``step_N`` entry (not ``.tmp``) under the root."""
        return [(step, name) for name in self._entries() if (step := step_of(name)) is not None]

    def _remove_partial(self) -> None:
        """Leftovers of interrupted uploads and removals: ``*.tmp`` entries, step directories beyond
        ``latest`` (a copy interrupted before ``latest`` named it), and step directories up to it
        without ``run_state.json`` (a removal interrupted: an object store deletes in any order)."""
        latest = self.latest()
        for name in self._entries():
            step = step_of(name)
            if name.endswith(".tmp"):
                why = "an interrupted upload"
            elif step is not None and (latest is None or step > latest):
                why = f"beyond latest (step_{latest})"
            elif step is not None and not self.fs.exists(self.path(name, RUN_STATE_FILE)):
                why = f"no {RUN_STATE_FILE}: an interrupted removal"
            else:
                continue
            self.fs.rm(self.path(name), recursive=True)
            log(f"removed {self.url}/{name}: {why}")

    def remove_beyond(self, step: int) -> list[str]:
        """The remote side of ``run_checkpoint.remove_beyond``, for a run that continues from
        ``step`` (a resume from an older checkpoint, a rollback; 0: a fresh start): ``latest`` first
        names the newest checkpoint up to ``step`` (or goes, with none), then the step directories
        after it are deleted, so that a job requeued meanwhile does not download one of them.
        Returns their names."""
        kept = [held for held in self.held_steps() if held <= step]
        if kept:
            self._write_latest(f"step_{kept[-1]}")
        elif self.fs.exists(self.path(LATEST_FILE)):
            self.fs.rm_file(self.path(LATEST_FILE))
        removed = [name for held, name in self._step_dirs() if held > step]
        for name in removed:
            self.fs.rm(self.path(name), recursive=True)
        return removed

    def upload(self, ckpt: Path, keep_last: int, pinned: str | None = None) -> None:
        """Copies the complete local checkpoint ``ckpt`` (``.../step_N``) to ``step_N`` through
        ``step_N.tmp``, writes ``latest``, then keeps the newest ``keep_last`` (0: all) and
        ``pinned`` (the health watch's best evaluation, as locally)."""
        name, step = ckpt.name, int(ckpt.name.removeprefix("step_"))
        tmp, final = self.path(f"{name}.tmp"), self.path(name)
        self._remove_partial()
        rels = files_under(ckpt)
        bulk = [rel for rel in rels if rel not in LAST_FILES]
        last = [rel for rel in LAST_FILES if rel in rels]
        self._put(ckpt, tmp, bulk)
        faults.on_remote_files_uploaded(step)
        self._put(ckpt, tmp, last)
        if self.fs.exists(final):  # the same step from an earlier attempt (resume=never, a rollback)
            self.fs.rm(final, recursive=True)
        if not self.object_store:
            self.fs.mv(tmp, final)  # one rename (a file system, HDFS)
        else:  # run_state.json last, alone (a copy of many objects runs them concurrently)
            for group in (bulk, *([rel] for rel in reversed(last))):
                self.fs.copy([f"{tmp}/{rel}" for rel in group], [f"{final}/{rel}" for rel in group])
        self._write_latest(name)
        if self.object_store:  # after latest: deleting many objects is slow, and the next upload finishes it
            self.fs.rm(tmp, recursive=True)
        for later, later_name in self._step_dirs():  # not this run's: it continues from an earlier step
            if later > step:
                self.fs.rm(self.path(later_name), recursive=True)
                log(f"removed {self.url}/{later_name}: beyond {name}, which this run continues from")
        if keep_last:
            for old in self.complete_steps()[:-keep_last]:
                if f"step_{old}" != pinned:
                    self.fs.rm(self.path(f"step_{old}"), recursive=True)

    def _put(self, ckpt: Path, target: str, rels: list[str]) -> None:
        if not rels:
            return
        if not self.object_store:
            for folder in sorted({f"{target}/{rel}".rsplit("/", 1)[0] for rel in rels}):
                self.fs.makedirs(folder, exist_ok=True)
        self.fs.put([str(ckpt / rel) for rel in rels], [f"{target}/{rel}" for rel in rels])

    def _write_latest(self, name: str) -> None:
        if self.object_store:  # one PUT: readers see the old object or the new one
            self.fs.pipe_file(self.path(LATEST_FILE), f"{name}\n".encode())
        else:
            self.fs.pipe_file(self.path(f"{LATEST_FILE}.tmp"), f"{name}\n".encode())
            self.fs.mv(self.path(f"{LATEST_FILE}.tmp"), self.path(LATEST_FILE))

    def fetch_newer(self, root: Path, local: Path | None) -> Path | None:
        """Rank 0, at the start of a ``resume=auto`` run: downloads the newest usable remote
        checkpoint to ``root`` when the remote is further along than ``local`` (the newest local
        checkpoint; None: none), which is then a stale copy, e.g. on a node that a requeued job left
        and came back to. Returns it; None leaves the local one (or a fresh start). Further along:
        a later ``lineage``. Raises ``RemoteStorageError`` rather than start a run that would delete
        remote checkpoints it cannot tell are stale: newer ones all unusable with no local one.

        The candidates are the complete checkpoints, and the whole ones after ``latest`` (an upload
        stopped between its copy and ``latest``) unless fewer rollbacks are behind them than behind
        the one ``latest`` names (a branch a rollback left, whose removal stopped half-way)."""
        ours = None
        if local is not None:
            try:
                ours = lineage(json.loads((local / RUN_STATE_FILE).read_text()), local.name)
            except ValueError as err:  # unusable: the resume would fall back past it
                log(f"{local / RUN_STATE_FILE} does not parse ({err}); comparing {self.url} with no local checkpoint")
        latest = self.latest()
        # A remote run_state.json that does not parse (None) is left to the download's manifest check.
        lineages = {step: self.lineage(step) for step in self.held_steps()}
        named = lineages.get(latest) if latest is not None else None

        def candidate(step: int) -> bool:
            theirs = lineages[step]
            if latest is not None and step <= latest:
                return True
            return named is None or theirs is None or theirs >= named

        newer = [
            step
            for step, theirs in lineages.items()
            if candidate(step) and (ours is None or theirs is None or theirs > ours)
        ]
        got = self.download_newest(root, newer)
        if got is None and newer:
            if local is None:
                raise RemoteStorageError(
                    f"remote_dir={self.url!r} holds {_names(newer)}, none usable (each reason is logged above), "
                    "and output_dir holds no checkpoint: a fresh run would delete them. Repair them or move them "
                    "aside, or start over with resume=never overwrite=true"
                )
            log(f"warning: {self.url}'s checkpoints newer than {local} are unusable; continuing from {local}")
        return got

    def download_newest(self, root: Path, steps: list[int]) -> Path | None:
        """Copies the newest of the complete remote checkpoints ``steps`` whose files match its
        manifest to ``root/step_N`` and points the local ``latest`` at it; None when none does.
        The health watch's best checkpoint, which that one names and a rollback goes back to,
        comes with it."""
        for step in reversed(steps):
            final = self.download(step, root, "output_dir holds no checkpoint as far along")
            if final is None:
                continue
            write_atomically(root / LATEST_FILE, final.name + "\n")
            health = json.loads((final / RUN_STATE_FILE).read_text()).get("loop", {}).get("health") or {}
            best = health.get("best_step", -1)
            if 0 <= best != step and best in self.complete_steps():
                self.download(best, root, "the health watch's best evaluation, which a rollback goes back to")
            return final
        return None

    def download(self, step: int, root: Path, why: str) -> Path | None:
        """Copies the remote ``step_N`` to ``root/step_N`` through ``step_N.tmp``; None (logged)
        when its files do not match its manifest."""
        name = f"step_{step}"
        tmp, final = root / f"{name}.tmp", root / name
        if tmp.exists():
            shutil.rmtree(tmp)
        started = time.perf_counter()
        remote = self.path(name)
        sources = [path for path in self.fs.find(remote) if not path.endswith("/")]
        rels = [path[len(remote) + 1 :] for path in sources]
        for folder in {(tmp / rel).parent for rel in rels}:
            folder.mkdir(parents=True, exist_ok=True)
        self.fs.get(sources, [str(tmp / rel) for rel in rels])
        problems = copy_problems(tmp)
        if problems or problems is None:
            why = "; ".join(problems) if problems else f"no {MANIFEST_FILE}"
            log(f"{self.url}/{name} is unusable ({why}); trying the previous remote checkpoint")
            shutil.rmtree(tmp)
            return None
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        size = sum((final / rel).stat().st_size for rel in rels)
        log(
            f"downloaded {self.url}/{name} to {final} ({size / 2**20:.1f} MiB in "
            f"{time.perf_counter() - started:.1f} s): {why}"
        )
        return final


def lineage(run_state: dict[str, Any], name: str) -> tuple[int, int]:
    """How far along a run a checkpoint is, for comparing copies of one run in two places: the
    rollbacks behind it (each redoes steps on another branch, so a checkpoint after more of them is
    the later one whatever its step), then its step."""
    return len(run_state.get("loop", {}).get("reseeded", [])), int(name.removeprefix("step_"))


def _names(steps: list[int]) -> str:
    return ", ".join(f"step_{step}" for step in steps)


def _filesystem(url: str) -> tuple[Any, str]:
    """fsspec's file system for ``url`` and the path within it; errors named."""
    try:
        import fsspec
    except ImportError as err:
        raise RemoteStorageError(f"remote_dir={url!r} needs fsspec: pip install fsspec (and s3fs for s3://)") from err
    protocol = url.split("://", 1)[0]
    try:
        # A fresh instance: credentials are read from the environment now, not from a cached one's.
        return fsspec.core.url_to_fs(url, skip_instance_cache=True)
    except ImportError as err:  # fsspec names the package: "Install s3fs to access S3"
        raise RemoteStorageError(f"remote_dir={url!r}: {err}") from err
    except ValueError as err:  # "Protocol not known"
        raise RemoteStorageError(f"remote_dir={url!r}: {err}") from err
    except OSError as err:
        if protocol in ("hdfs", "viewfs"):
            raise RemoteStorageError(
                f"remote_dir={url!r}: pyarrow's HadoopFileSystem could not start ({str(err).splitlines()[0]}). "
                "It needs libhdfs "
                "(ARROW_LIBHDFS_DIR or HADOOP_HOME/lib/native), a Java runtime (JAVA_HOME) and the Hadoop jars "
                "on CLASSPATH (`hadoop classpath --glob`); hdfs:// is untested in this project's CI"
            ) from err
        raise RemoteStorageError(f"remote_dir={url!r}: {err!r}") from err


class RemoteMirror:
    """Uploads each complete local checkpoint to ``remote_dir`` in a background thread of rank 0,
    so that a step does not wait for it. One upload is in flight at most: ``wait`` (collective,
    called before each save, at a stop and at the end) returns once it is done. A failed upload is
    reported as a warning (the next checkpoint is uploaded anew); at the end, ``wait(required=True)``
    raises it."""

    def __init__(self, url: str, keep_last: int) -> None:
        """Collective. ``url``: ``remote_dir`` ("": no remote storage, every method returns at once)."""
        self.enabled = bool(url)
        self.remote = RemoteDir(url) if url and dist.get_rank() == 0 else None
        self.keep_last = keep_last
        self._thread: threading.Thread | None = None
        self._error: str | None = None

    def start(self, ckpt: Path, pinned: str | None) -> None:
        """Rank 0: upload ``ckpt`` in the background (``RunCheckpointWriter``'s ``on_complete``);
        remote pruning keeps ``pinned`` as the local one does."""
        if self.remote is None:
            return
        if self._thread is not None:  # not expected: every save waits first
            self._thread.join()
        self._error = None
        self._thread = threading.Thread(target=self._upload, args=(ckpt, pinned), name="remote-upload", daemon=True)
        self._thread.start()

    def catch_up(self, ckpt: Path, pinned: str | None) -> None:
        """Rank 0, after a resume from the local ``ckpt``: upload it unless the remote ``latest``
        names a copy of it already (remote_dir added to a run, a final upload that failed, or the
        same step on the branch a rollback left)."""
        if self.remote is None:
            return
        name = ckpt.name
        try:
            held = (
                self.remote.latest() == step_of(name)
                and self.remote.fs.cat_file(self.remote.path(name, MANIFEST_FILE))
                == (ckpt / MANIFEST_FILE).read_bytes()
            )
        except (OSError, RemoteStorageError) as err:
            log(f"warning: reading {self.remote.url}'s {name} failed ({err!r}); {name} is uploaded anew")
            held = False
        if not held:
            log(f"{self.remote.url} does not hold {name}, the checkpoint resumed: uploading it")
            self.start(ckpt, pinned)

    def restore(self, ckpt: Path) -> bool:
        """Collective, for a local checkpoint found unusable as it loaded (a changed shard, which
        only the load's hashing finds): rank 0 replaces it by the remote copy of its step, if
        remote_dir holds one whose files match its manifest. Whether it did (the load is then
        tried again, instead of falling back to an older checkpoint and removing the remote copy)."""
        if not self.enabled:
            return False
        restored: list[bool] = [False]
        if self.remote is not None:
            step = step_of(ckpt.name)
            try:
                if step is not None and step in self.remote.held_steps():
                    why = "in place of the local copy, whose files changed"
                    restored[0] = self.remote.download(step, ckpt.parent, why) is not None
            except Exception as err:  # the fallback to an older checkpoint follows
                log(f"warning: downloading {self.remote.url}/{ckpt.name} in place of {ckpt} failed ({err!r})")
        dist.broadcast_object_list(restored, src=0)
        return bool(restored[0])

    def remove_beyond(self, step: int, why: str) -> None:
        """Rank 0: ``RemoteDir.remove_beyond``, each removal logged with ``why``. A failure is a
        warning: the next upload removes them."""
        if self.remote is None:
            return
        try:
            for name in self.remote.remove_beyond(step):
                log(f"removed {self.remote.url}/{name}: {why}")
        except Exception as err:
            log(
                f"warning: removing {self.remote.url}'s checkpoints after step {step} failed ({err!r}); a job that "
                "restarts before the next upload takes one of them as further along than its local checkpoint and "
                "continues from it"
            )

    def _upload(self, ckpt: Path, pinned: str | None) -> None:
        assert self.remote is not None
        started = time.perf_counter()
        try:
            self.remote.upload(ckpt, self.keep_last, pinned)
        except Exception as err:  # reported by wait(), in the training thread
            self._error = f"uploading {ckpt} to {self.remote.url} failed: {err!r}"
            return
        size = sum(path.stat().st_size for path in ckpt.rglob("*") if path.is_file())
        seconds = time.perf_counter() - started
        log(
            f"uploaded {ckpt.name} to {self.remote.url}/{ckpt.name} ({size / 2**20:.1f} MiB in {seconds:.1f} s, "
            f"{size / 2**20 / max(seconds, 1e-9):.1f} MiB/s)"
        )

    def wait(self, *, required: bool = False) -> None:
        """Collective: returns on every rank once rank 0's upload in flight is done. The other ranks
        poll rank 0 every second (each poll a short collective, so that a long upload does not run
        into ``dist_timeout_s``)."""
        if not self.enabled:
            return
        while True:
            state: list[Any] = [None]
            if dist.get_rank() == 0:
                if self._thread is not None:
                    self._thread.join(timeout=1.0)
                    if not self._thread.is_alive():
                        self._thread = None
                state = [("busy" if self._thread is not None else "done", self._error)]
            dist.broadcast_object_list(state, src=0)
            status, error = state[0]
            if status == "done":
                break
        if error is None:
            return
        self._error = None
        if required:
            raise RuntimeError(f"{error}; the local checkpoint is complete, copy it by hand or run again")
        log(f"warning: {error}; the next checkpoint is uploaded anew")
