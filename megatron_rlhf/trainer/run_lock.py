"""One run per output_dir: ``output_dir/run.lock`` names the run that holds it (host, pid, start).

Two runs writing one output_dir corrupt each other (the second resumes from the first's
checkpoint; both append to metrics.jsonl). The lock file is created by a hard link of a written
file (atomic, never empty), so of two runs started together exactly one gets it. A lock whose
holder is a dead process on this host is taken over (with a message); one held by a live process
is refused with ``OutputDirLocked``. Runs that take over one stale lock together take turns (a
``run.lock.takeover`` file, made the same way), and each deletes it only if it still names the
holder it judged: exactly one of them gets it. Under torchrun only rank 0 takes it (``loop.write_run_files``).
The holder deletes it at the end of the run and at exit (an error, a stop signal); a killed run
leaves it behind, and the next run on the same host takes it over. Process ids are compared with
their start time, so a reused pid is not taken for the holder.

Another host's processes cannot be checked from here, so the holder also refreshes the file's
modification time every ``HEARTBEAT_S`` (a thread of its own): another host's lock is refused while
it is fresh and taken over once it has not been refreshed for ``STALE_AFTER_S``, as when a Slurm job
is requeued onto another node after its first node died.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from megatron_rlhf.config.loader import ConfigError
from megatron_rlhf.metrics.log import log

LOCK_FILE = "run.lock"
HEARTBEAT_S = 30.0
"""How often the holder refreshes its lock file's modification time."""
STALE_AFTER_S = 300.0
"""Another host's lock not refreshed for this long is taken over (ten heartbeats: clocks of a
shared file system's hosts may differ by some seconds)."""
TAKEOVER_WAIT_S = 10.0
"""How long a run waits while another takes over a stale lock (which takes microseconds)."""
_heartbeats: dict[Path, threading.Event] = {}
"""Lock file -> the event that stops its holder's heartbeat (this process's locks)."""


class OutputDirLocked(ConfigError):
    """Another run holds the output_dir's lock."""


def _me() -> dict[str, object]:
    started = psutil.Process().create_time()
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_started": started,
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
    }


def _alive(holder: dict[str, Any]) -> bool:
    """Whether the holder (a process of this host) still runs: same pid, same start time."""
    try:
        return abs(psutil.Process(int(holder["pid"])).create_time() - float(holder["process_started"])) < 1.0
    except (psutil.NoSuchProcess, KeyError, TypeError, ValueError):
        return False


def acquire(out_dir: Path) -> Path:
    """Take ``out_dir/run.lock`` for this process (creating ``out_dir``); returns its path. A lock this
    process holds already is kept. Raises ``OutputDirLocked`` naming the holder and the file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_FILE
    me = _me()
    deadline = time.monotonic() + TAKEOVER_WAIT_S
    while True:
        if _create(path, me):
            atexit.register(release, path)
            _start_heartbeat(path)
            return path
        holder = _read(path)
        if holder is None:
            continue  # deleted by its holder meanwhile
        if holder.get("host") == me["host"] and holder.get("pid") == me["pid"]:
            return path
        stale = _why_stale(path, out_dir, holder, me)
        if stale is None:
            continue  # deleted by its holder meanwhile
        if _take_over(path, holder, me):
            log(f"taking over {path}: {stale}")
        elif time.monotonic() > deadline:
            raise OutputDirLocked(
                f"output_dir={str(out_dir)!r}: another run has been taking over the stale {path} for "
                f"{TAKEOVER_WAIT_S:.0f} s; start again (a {path.name}.takeover left by a run that died "
                f"taking over goes after {STALE_AFTER_S:.0f} s, or delete it)"
            )
        else:
            time.sleep(0.05)  # another run is taking it over: its lock is judged next


def _why_stale(path: Path, out_dir: Path, holder: dict[str, Any], me: dict[str, object]) -> str | None:
    """Why ``holder``'s lock may be taken over; raises ``OutputDirLocked`` while it may not (a live
    process of this host, another host's lock refreshed lately). None: the file went meanwhile."""
    if holder.get("host") != me["host"]:
        quiet = _seconds_since_refreshed(path)
        if quiet is None:
            return None
        if quiet < STALE_AFTER_S:
            raise OutputDirLocked(
                f"output_dir={str(out_dir)!r} is in use by a run on host {holder.get('host')} (pid "
                f"{holder.get('pid')}, started {holder.get('started')}): {path}, refreshed {quiet:.0f} s ago. Its "
                f"process cannot be checked from {me['host']}; a lock not refreshed for {STALE_AFTER_S:.0f} s is "
                f"taken over, or, if you are sure that run has ended, delete {path} and start again"
            )
        return (
            f"its holder, pid {holder.get('pid')} on {holder.get('host')}, has not refreshed it for {quiet:.0f} s "
            f"(a run refreshes its lock every {HEARTBEAT_S:.0f} s)"
        )
    if _alive(holder):
        raise OutputDirLocked(
            f"output_dir={str(out_dir)!r} is in use by another run: pid {holder['pid']} on {holder['host']}, "
            f"started {holder.get('started')} ({path}); wait for it to end, stop it, or choose another output_dir"
        )
    return (
        f"its holder, pid {holder.get('pid')} on {holder.get('host')} (started {holder.get('started')}), is no "
        "longer running"
    )


def _take_over(path: Path, stale: dict[str, Any], me: dict[str, object]) -> bool:
    """Delete the lock file judged stale, if it still names ``stale``; True if it is gone. Runs that
    take over one stale lock together take turns (``run.lock.takeover``, made like the lock):
    without them, a slower one deleted the lock a faster one had just made, and both held it."""
    turn = path.with_name(f"{path.name}.takeover")
    if not _create(turn, me):
        held_for = _seconds_since_refreshed(turn)
        # Its taker died in the microseconds it holds it. Judged as a lock is (the clocks of a shared
        # file system's hosts may differ by some seconds): a live turn is never taken for a dead one.
        if held_for is not None and held_for > STALE_AFTER_S:
            turn.unlink(missing_ok=True)
        return False
    try:
        now = _read(path)
        if now == stale:
            path.unlink()
        return now is None or now == stale
    finally:
        turn.unlink(missing_ok=True)


def _create(path: Path, holder: dict[str, object]) -> bool:
    """Create the lock file with its content in one step (a hard link of a written file: never seen
    empty); False if it exists."""
    tmp = path.with_name(f"{path.name}.{holder['host']}.{holder['pid']}.tmp")  # unique on a shared file system
    tmp.write_text(json.dumps(holder) + "\n")
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def _seconds_since_refreshed(path: Path) -> float | None:
    try:
        return max(time.time() - path.stat().st_mtime, 0.0)
    except FileNotFoundError:
        return None


def _start_heartbeat(path: Path) -> None:
    """Refresh ``path``'s modification time every ``HEARTBEAT_S`` until ``release`` (a daemon thread:
    it never keeps the process alive)."""
    stop = _heartbeats[path] = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            try:
                os.utime(path)
            except OSError:  # deleted or taken over: nothing left to refresh
                return

    threading.Thread(target=beat, name="run-lock-heartbeat", daemon=True).start()


def release(path: Path) -> None:
    """Delete the lock if this process holds it (a lock another run has taken over stays)."""
    beat = _heartbeats.pop(path, None)
    if beat is not None:
        beat.set()
    holder = _read(path)
    if holder is not None and holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid():
        path.unlink(missing_ok=True)


def _read(path: Path) -> dict[str, Any] | None:
    """The holder a lock file names (None: no lock file); an unreadable one names an unknown host, which
    is refused with the hint to delete it. Its values are whatever the file holds: ``_alive`` checks them."""
    try:
        holder = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        holder = None
    return holder if isinstance(holder, dict) else {"host": "unknown (unreadable lock file)"}
