"""Running a policy turn's tool calls on host threads, each with a timeout, without blocking the engine.

A call is a job on a shared thread pool. Its timeout starts when a worker picks it up (a call queued
behind others is not penalised); past it the call's slot is answered with a timeout error, and the
worker, which Python cannot stop, finishes in the background and is ignored (give slow tools their
own limit, as ``PythonTool`` does with its subprocess). The turn's Future resolves once every slot is
answered, in the thread that answered last.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from megatron_rlhf.agent.parsers import ErrorKind

__all__ = ["CallOutcome", "gather_calls", "truncate_middle"]

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


def gather_calls[T](
    pool: ThreadPoolExecutor,
    calls: Sequence[Callable[[], CallOutcome]],
    timeout_s: float,
    timed_out: Callable[[int], CallOutcome],
    finish: Callable[[list[CallOutcome]], T],
) -> Future[T]:
    """Run ``calls`` on ``pool``; the Future of ``finish(outcomes)``, outcomes in call order, a call
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

    def run(index: int) -> None:
        timer = threading.Timer(timeout_s, lambda: answer(index, timed_out(index)))
        timer.daemon = True
        timer.start()
        started = time.perf_counter()
        outcome = calls[index]()
        timer.cancel()
        answer(index, dataclasses.replace(outcome, seconds=time.perf_counter() - started))

    for index in range(len(calls)):
        pool.submit(run, index)
    if not calls:
        result.set_result(finish([]))
    return result
