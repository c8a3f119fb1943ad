"""Running a policy turn's tool calls on host threads, each with a timeout, without blocking the engine.

A call runs on a thread of its own, at most ``tool_workers`` at once (``ToolWorkers``). Its timeout
starts when it starts (a call queued behind others is not penalised); past it the call's slot is
answered with a timeout error and its place goes to the next call: the thread, which Python cannot
stop, finishes in the background, is ignored, and as a daemon does not hold up the process's exit
(give slow tools their own limit, as ``PythonTool`` does with its subprocess). While
``HUNG_CALLS_PER_WORKER`` such threads per worker still run, new calls are refused (answered as an
exception, with one warning in the log) rather than grow the threads without bound. Before, a call that
hung kept its worker, and once every worker held one, the calls queued behind them waited with no
timer: the step stalled. The turn's Future resolves once every slot is answered, in the thread that
answered last.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from megatron_rlhf.agent.parsers import ErrorKind

__all__ = ["CallOutcome", "HungCallsError", "ToolWorkers", "gather_calls", "truncate_middle"]

TRUNCATION_MARK = "...(truncated)..."


@dataclasses.dataclass(frozen=True)
class CallOutcome:
    """What one tool call sends back to the model, and what the trajectory record counts of it."""

    text: str
    error: ErrorKind | None = None
    seconds: float = 0.0
    reward: float | None = None
    """The reward ``execute`` returned for this call, or the score an interaction gave its reply
    (None: none, or the call failed)."""
    truncated: bool = False
    ends: bool = False
    """An interaction's answer only: the trajectory ends here (its ``should_terminate_sequence``, or
    its failure)."""


def truncate_middle(text: str, limit: int) -> tuple[str, bool]:
    """``text`` cut to its first and last ``limit // 2`` characters around a mark (verl's default,
    middle truncation) when longer than ``limit``; and whether it was cut."""
    if len(text) <= limit:
        return text, False
    half = limit // 2
    return text[:half] + TRUNCATION_MARK + text[len(text) - half :], True


HUNG_CALLS_PER_WORKER = 8
"""Calls past their timeout whose threads still run, per worker, before new calls are refused:
Python cannot stop a thread, so a tool that always hangs would otherwise grow them without bound."""


class HungCallsError(RuntimeError):
    """A call not started because too many earlier ones still run past their timeout."""


class ToolWorkers:
    """Calls on daemon threads, at most ``workers`` running at once; one past its timeout gives its
    place to the next queued call (see the module docstring). While ``max_hung`` calls (default
    ``HUNG_CALLS_PER_WORKER`` per worker) still run past their timeout, new calls fail with
    ``HungCallsError`` instead of starting."""

    def __init__(self, workers: int, name: str, max_hung: int | None = None) -> None:
        self.workers, self.name = workers, name
        self.max_hung = HUNG_CALLS_PER_WORKER * workers if max_hung is None else max_hung
        self._lock = threading.Lock()
        self._queued: deque[Callable[[], None]] = deque()
        self._running = 0
        self._hung = 0
        self._warned = False
        self._closed = False

    def submit[T](
        self, fn: Callable[[], T], timeout_s: float, on_timeout: Callable[[], None] | None = None
    ) -> Future[T]:
        """Run ``fn`` once a place is free; its Future holds what it returns or raises, whenever it
        ends. ``timeout_s`` after it starts, if still running, its place is freed and ``on_timeout``
        called."""
        future: Future[T] = Future()

        def start() -> None:
            freed = threading.Event()

            def free(timed_out: bool) -> None:
                with self._lock:
                    if freed.is_set():
                        if not timed_out:  # returned after its timeout: its thread ends now
                            self._hung -= 1
                        return
                    freed.set()
                    self._running -= 1
                    if timed_out:
                        self._hung += 1
                try:
                    if timed_out and on_timeout is not None:
                        on_timeout()
                finally:
                    self._start_queued()

            timer = threading.Timer(timeout_s, free, (True,))
            timer.daemon = True

            def body() -> None:
                timer.start()
                try:
                    result = fn()
                except BaseException as exc:  # the caller's to read from the Future
                    future.set_exception(exc)
                else:
                    future.set_result(result)
                finally:
                    timer.cancel()
                    free(False)

            with self._lock:
                hung = self._hung
            if hung >= self.max_hung:
                refused = HungCallsError(
                    f"{self.name}: call not started: {hung} earlier calls still run past their timeout (at most "
                    f"{self.max_hung}, {HUNG_CALLS_PER_WORKER} per worker); a tool that hangs needs a time limit "
                    "of its own"
                )
                self._warn_once(refused)
                future.set_exception(refused)
                raise refused
            try:
                threading.Thread(target=body, name=f"{self.name}-call", daemon=True).start()
            except RuntimeError as exc:  # no thread for it (the host's limit): the call fails
                future.set_exception(exc)
                raise

        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: submitted after shutdown")
            self._queued.append(start)
        self._start_queued()
        return future

    def _start_queued(self) -> None:
        while True:
            with self._lock:
                if self._closed or not self._queued or self._running >= self.workers:
                    return
                start = self._queued.popleft()
                self._running += 1
            try:
                start()
            except RuntimeError:  # not started (its Future holds why): give its place back
                with self._lock:
                    self._running -= 1

    def _warn_once(self, refused: HungCallsError) -> None:
        with self._lock:
            warned, self._warned = self._warned, True
        if not warned:  # on whichever rank runs tools: the run's log, not only a tool error count
            print(f"WARNING: {refused} (further refusals are counted as tool errors)", file=sys.stderr, flush=True)

    def shutdown(self) -> None:
        """Drop the queued calls (their Futures never resolve) and refuse new ones; running ones
        finish in the background."""
        with self._lock:
            self._closed = True
            self._queued.clear()


def gather_calls[T](
    workers: ToolWorkers,
    calls: Sequence[Callable[[], CallOutcome]],
    timeout_s: float,
    timed_out: Callable[[int], CallOutcome],
    finish: Callable[[list[CallOutcome]], T],
    deadline_s: float | None = None,
) -> Future[T]:
    """Run ``calls`` on ``workers``; the Future of ``finish(outcomes)``, outcomes in call order, a call
    past ``timeout_s`` answered by ``timed_out(its index)``. Each call returns its outcome and never
    raises (``calls`` turn failures into outcomes); ``finish`` raising fails the Future.

    ``deadline_s``: every call still unanswered that long after this one (queued or running) is
    answered by ``timed_out`` too, so that the Future resolves within it however busy the workers are."""
    result: Future[T] = Future()
    outcomes: list[CallOutcome | None] = [None] * len(calls)
    lock = threading.Lock()
    deadline: threading.Timer | None = None

    def answer(index: int, outcome: CallOutcome) -> None:
        with lock:
            if outcomes[index] is not None:
                return  # the later of the call and its timeout
            outcomes[index] = outcome
            complete = all(o is not None for o in outcomes)
        if complete:
            if deadline is not None:
                deadline.cancel()
            try:
                result.set_result(finish([o for o in outcomes if o is not None]))
            except Exception as exc:  # the environment's own failure (e.g. the chat template): the engine's to raise
                result.set_exception(exc)

    def run(index: int) -> CallOutcome:
        started = time.perf_counter()
        return dataclasses.replace(calls[index](), seconds=time.perf_counter() - started)

    def late(index: int) -> None:
        answer(index, timed_out(index))

    def returned(index: int, done: Future[CallOutcome]) -> None:
        error = done.exception()  # a call's own bug: answered as one, or the turn would never resolve
        answer(index, done.result() if error is None else CallOutcome(f"Error: {error!r}", "exception"))

    if not calls:
        result.set_result(finish([]))
        return result
    if deadline_s is not None:

        def expire() -> None:
            for index in range(len(calls)):
                late(index)

        deadline = threading.Timer(deadline_s, expire)
        deadline.daemon = True
        deadline.start()
    for index in range(len(calls)):
        call = workers.submit(functools.partial(run, index), timeout_s, functools.partial(late, index))
        call.add_done_callback(functools.partial(returned, index))
    return result
