"""Running a policy turn's tool calls on host threads, each with a timeout, without blocking the engine.

A call runs on a thread of its own, at most ``tool_workers`` at once (``ToolWorkers``). Its timeout
starts when it starts (a call queued behind others is not penalised); past it the call's slot is
answered with a timeout error and its place goes to the next call: the thread, which Python cannot
stop, finishes in the background, is ignored, and as a daemon does not hold up the process's exit
(give slow tools their own limit, as ``PythonTool`` does with its subprocess). Before, a call that
hung kept its worker, and once every worker held one, the calls queued behind them waited with no
timer: the step stalled. The turn's Future resolves once every slot is answered, in the thread that
answered last.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from megatron_rlhf.agent.parsers import ErrorKind

__all__ = ["CallOutcome", "ToolWorkers", "gather_calls", "truncate_middle"]

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


class ToolWorkers:
    """Calls on daemon threads, at most ``workers`` running at once; one past its timeout gives its
    place to the next queued call (see the module docstring)."""

    def __init__(self, workers: int, name: str) -> None:
        self.workers, self.name = workers, name
        self._lock = threading.Lock()
        self._queued: deque[Callable[[], None]] = deque()
        self._running = 0
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
                        return
                    freed.set()
                    self._running -= 1
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
) -> Future[T]:
    """Run ``calls`` on ``workers``; the Future of ``finish(outcomes)``, outcomes in call order, a call
    past ``timeout_s`` answered by ``timed_out(its index)``. Each call returns its outcome and never
    raises (``calls`` turn failures into outcomes); ``finish`` raising fails the Future."""
    result: Future[T] = Future()
    outcomes: list[CallOutcome | None] = [None] * len(calls)
    lock = threading.Lock()

    def answer(index: int, outcome: CallOutcome) -> None:
        with lock:
            if outcomes[index] is not None:
                return  # the later of the call and its timeout
            outcomes[index] = outcome
            complete = all(o is not None for o in outcomes)
        if complete:
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

    for index in range(len(calls)):
        call = workers.submit(functools.partial(run, index), timeout_s, functools.partial(late, index))
        call.add_done_callback(functools.partial(returned, index))
    if not calls:
        result.set_result(finish([]))
    return result
