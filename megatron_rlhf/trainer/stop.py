"""Stopping a run early. On request: a scheduler's SIGTERM (or SIGUSR1 sent ahead of a preemption) and
Ctrl-C (SIGINT) end the run at the next step boundary, after a checkpoint, so that the same command
started again continues where it stopped. A second signal ends the process at once, unless it comes
within ``SAME_REQUEST_S`` of the first: one request delivered twice (Slurm signals every process of
a job step, and a signal to a process group reaches a worker directly and through
launch/torchrun.sh).

Signals reach ranks at different times (or only one rank): at every step boundary the ranks agree
(one small all-reduce) so that all of them stop after the same step. A step that waits on reward
code when a stop arrives (a hung function) is abandoned instead (``stop_requested`` is what that
wait watches): the run saves the step before it and stops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlhf.metrics.log import log

SAME_REQUEST_S = 1.0
"""A second signal this soon after the first is the same request, delivered by another route."""

EXIT_CODES = {signal.SIGTERM: 0, signal.SIGUSR1: 0, signal.SIGINT: 130}
"""The exit code of a run stopped by each signal after its checkpoint (130: interrupted, as shells report Ctrl-C)."""


class RunStopped(Exception):
    """A run ending early on purpose: after a requested stop's checkpoint, or when training
    diverged beyond repair (exit 3). ``code`` is the process's exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class StopSignals:
    """A context manager: while it is active the signals of ``EXIT_CODES`` are recorded instead of
    ending the process (the first one) or end it at once (a second one, exit 128 + signal number)."""

    active: StopSignals | None = None
    """The one in force: signal handlers are the process's, so at most one is."""

    def __init__(self) -> None:
        self.code: int | None = None
        self._first_at = 0.0
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopSignals:
        for sig in EXIT_CODES:
            self._previous[sig] = signal.signal(sig, self._handle)
        StopSignals.active = self
        return self

    def __exit__(self, *exc: object) -> None:
        StopSignals.active = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.code is not None:
            if time.monotonic() - self._first_at < SAME_REQUEST_S:
                return
            log(f"{sig.name} again: exiting now, without a checkpoint")
            os._exit(128 + signum)
        self.code, self._first_at = EXIT_CODES[sig], time.monotonic()
        log(
            f"{sig.name} received: stopping at the next step boundary, after its checkpoint (before the first "
            f"step: at once, with nothing to save); {sig.name} again: exit now"
        )

    def stop_before_training(self) -> None:
        """Collective, before the first step: raises ``RunStopped`` if a stop was requested while
        the run started (nothing new to save)."""
        code = self.agreed()
        if code is not None:
            raise RunStopped(
                "stopped on request during start-up, before a step was trained; the same command runs it again", code
            )

    def agreed(self) -> int | None:
        """Collective: the exit code if any rank was asked to stop (the highest code), else None."""
        flag = torch.tensor(
            [-1 if self.code is None else self.code],
            dtype=torch.int64,
            device="cuda" if dist.get_backend() == "nccl" else "cpu",
        )
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        code = int(flag.item())
        return None if code < 0 else code


@contextlib.contextmanager
def stop_signals() -> Iterator[StopSignals]:
    """The ``StopSignals`` in force, entered here if none is: a trainer enters one before its
    start-up (``commands/trainers.run_trainer``), so that a signal while models load is a stop
    request too, which the loop honours before its first step."""
    if StopSignals.active is not None:
        yield StopSignals.active
    else:
        with StopSignals() as signals:
            yield signals


def stop_requested() -> bool:
    """Whether this process has been asked to stop during the run (its first signal recorded)."""
    return StopSignals.active is not None and StopSignals.active.code is not None
