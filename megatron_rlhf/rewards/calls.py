"""Calling the user's reward code (rules, a verl ``compute_score``): whatever it does, the run ends
with an error that names it, and a call that runs past ``scoring.timeout_s`` cannot hang the run.

Reward code may leave by any exception, ``except Exception`` lets some through: ``SystemExit`` (a
``sys.exit(0)`` in a reward would end the trainer with exit 0, no message and no model),
``GeneratorExit``, a ``KeyboardInterrupt`` it raises itself. ``RewardCalls`` reports each as the
function's error. One exception is left alone: on the main thread Python raises a real Ctrl-C as
``KeyboardInterrupt`` in whatever code runs, so there it may be the user's interrupt, not the
function's failure. The trainer runs reward code on a thread of its own (``Watched``), where no
signal is ever raised (Python runs signal handlers on the main thread only; during a run
``trainer/stop.py``'s handler records a stop instead of raising), so there every exception is the
function's.

Python cannot stop a thread. A call that overruns is found by whoever waits for the thread
(``Watched.result``: every ``timeout_s`` it looks at the call in progress) or by the thread when the
call returns late; the run then ends with an error naming the call and where it was, and the stuck
thread (a daemon) is left to end with the process. Code that holds the interpreter lock for good (a
C extension's loop, a pathological ``re`` match) blocks the waiter too: only a second stop signal
or SIGKILL ends such a process.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")
Where = Callable[[], str]
"""Describes a call for an error message (made only when one is needed): function, file, sample."""

TIMEOUT_SETTING = "scoring.timeout_s"
_ADVICE = f"(raise {TIMEOUT_SETTING}, or set it to 0 for no limit)"


class ScoringInterrupted(Exception):
    """A stop was requested while this step waited on reward code (``Watched.result``'s
    ``interrupted``): the step is abandoned on every rank, and the run saves the step before it."""


class RewardFunctionError(ValueError, RuntimeError):
    """The user's reward code failed: it raised, overran ``scoring.timeout_s``, or returned no usable
    score. The message names the function, its file and the sample (and has the traceback). A
    ValueError, so that the command line reports it as one paragraph as it does a bad setting; a
    RuntimeError, as it always was, for callers that catch that."""


def users_own(exc: BaseException) -> bool:
    """Whether ``exc``, raised out of user code, is that code's failure (see the module docstring):
    all but a ``KeyboardInterrupt`` on the main thread, which may be a Ctrl-C."""
    return not (isinstance(exc, KeyboardInterrupt) and threading.current_thread() is threading.main_thread())


def formatted(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def origin(function: Callable[..., Any]) -> str:
    """The file defining ``function`` (its module's name where Python cannot tell), for messages."""
    try:
        return inspect.getsourcefile(function) or inspect.getfile(function)
    except TypeError:
        return str(getattr(function, "__module__", None) or type(function).__qualname__)


class RewardCalls:
    """Calls user reward code, one call at a time, turning every way out of it into a
    ``RewardFunctionError`` and keeping the call in progress for ``overdue``."""

    def __init__(self, timeout_s: float = 0.0) -> None:
        self.timeout_s = timeout_s
        self._current: tuple[Where, float, int] | None = None  # (where, start, thread id), swapped whole

    def __call__(self, where: Where, function: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        start = time.monotonic()
        self._current = (where, start, threading.get_ident())
        try:
            result = function(*args, **kwargs)
        except BaseException as exc:  # SystemExit, GeneratorExit... are the function's failures too
            if not users_own(exc):
                raise
            trace = exc.__traceback__  # its first frame is this one: the user's begin after it
            raise RewardFunctionError(
                f"{where()} raised:\n{formatted(exc.with_traceback(trace and trace.tb_next))}"
            ) from exc
        finally:
            self._current = None
        took = time.monotonic() - start
        if self.timeout_s and took > self.timeout_s:
            raise RewardFunctionError(
                f"{where()} took {took:.1f} s, longer than {TIMEOUT_SETTING}={self.timeout_s:g} {_ADVICE}"
            )
        return result

    def time_left(self) -> float | None:
        """Seconds until the call in progress overruns (a full ``timeout_s`` between calls); None:
        no limit."""
        if not self.timeout_s:
            return None
        current = self._current
        return self.timeout_s if current is None else max(current[1] + self.timeout_s - time.monotonic(), 0.0)

    def overdue(self) -> str | None:
        """The error for the call in progress if it has run past ``timeout_s`` (with where it is
        now: the user's frames of the thread running it), else None."""
        current = self._current
        if not self.timeout_s or current is None:
            return None
        where, start, thread = current
        running = time.monotonic() - start
        if running <= self.timeout_s:
            return None
        frame = sys._current_frames().get(thread)
        stack = "".join(traceback.format_list(_frames_below(frame, _CALL_CODE))) if frame else "(finished)\n"
        return (
            f"{where()} has run {running:.1f} s, longer than {TIMEOUT_SETTING}={self.timeout_s:g} "
            f"{_ADVICE}; the run ends. It is at:\n{stack}"
        )


_CALL_CODE = RewardCalls.__call__.__code__


def _frames_below(frame: FrameType | None, stop: Any) -> traceback.StackSummary:
    """The stack from ``frame`` outwards up to (not including) the frame running code ``stop``,
    outermost first: the user's frames of a call made through ``RewardCalls``."""
    frames = []
    while frame is not None and frame.f_code is not stop:
        frames.append((frame, frame.f_lineno))
        frame = frame.f_back
    return traceback.StackSummary.extract(reversed(frames))


class Watched[T]:
    """``job`` (which calls reward code through ``calls``) on a daemon thread of its own, begun at
    once; ``result`` waits for it, and raises instead of waiting on past ``calls.timeout_s``."""

    def __init__(self, job: Callable[[], T], calls: RewardCalls) -> None:
        self.calls = calls
        self._done = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        # A daemon: a thread stuck in reward code must not keep the process from exiting.
        threading.Thread(target=self._run, args=(job,), name="scoring", daemon=True).start()

    def _run(self, job: Callable[[], T]) -> None:
        try:
            self._value = job()
        except BaseException as exc:  # handed to the waiter, which raises it
            self._error = exc
        finally:
            self._done.set()

    def result(self, interrupted: Callable[[], bool] | None = None) -> T:
        """The job's value, or what it raised; a ``RewardFunctionError`` when a call overruns, a
        ``ScoringInterrupted`` when ``interrupted()`` turns true while the job runs (looked at every
        ``INTERRUPT_POLL_S``). Signals are handled meanwhile (the wait is interruptible)."""
        while not self._done.wait(_wait_slice(self.calls.time_left(), interrupted)):
            late = self.calls.overdue()
            if late is not None:
                raise RewardFunctionError(late)
            if interrupted is not None and interrupted():
                raise ScoringInterrupted("a stop was requested while reward code ran (it had not returned)")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


INTERRUPT_POLL_S = 1.0
"""How often a wait on reward code looks for a stop request."""


def _wait_slice(time_left: float | None, interrupted: Callable[[], bool] | None) -> float | None:
    """How long one wait for the job may block: until the call in progress overruns, and at most
    ``INTERRUPT_POLL_S`` when a stop request is watched (None: no bound)."""
    if interrupted is None:
        return time_left
    return INTERRUPT_POLL_S if time_left is None else min(time_left, INTERRUPT_POLL_S)
