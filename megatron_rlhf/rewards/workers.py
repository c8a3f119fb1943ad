"""Reward code in processes of its own (``scoring.workers``), beside the trainer's.

Why: rules and reward functions are Python. On a thread of the trainer's process they share the
interpreter lock with the thread that launches the GPU passes meant to run meanwhile, and Python
hands the lock back only every ``sys.getswitchinterval()`` (5 ms): while a pure-Python rule runs,
the trainer launches about one kernel per 5 ms (docs/benchmarks.md, "Host overheads"). In worker
processes both run at once, and a rank's share of the samples is split over its workers.

Each worker is spawned at set-up (never forked: the trainer holds CUDA and threads), loads the rules
and the function from the config as the trainer did, and decodes with its own copy of the run's
decoder. It runs its part as the thread does (``calls.Watched``): the same errors, naming the rule or
function, the sample and, for a call past ``scoring.timeout_s``, the line it is at. After an error a
worker exits; the trainer ends the run, as it does on the thread's error.

A worker ignores SIGINT and SIGTERM: stop signals are the trainer's (``trainer/stop.py``), which stops
waiting for its workers on a stop request and ends them. A worker whose trainer is gone exits at its
next read. What a worker needs must load in a fresh process: registered rules, ``module:function``
rules importable from the trainer's ``sys.path``, a function file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from megatron_rlhf.rollout.engine import Completion

from .calls import INTERRUPT_POLL_S, RewardFunctionError, ScoringInterrupted, formatted
from .config import ScoringConfig, scoring_errors
from .custom import CustomScores
from .samples import Decoder, Share, watched_share


class ScoringWorkers:
    """``count`` worker processes that score parts of a rank's share (``start``)."""

    def __init__(self, count: int, cfg: ScoringConfig, texts: Decoder, stop_ids: Sequence[int]) -> None:
        context = multiprocessing.get_context("spawn")
        self._workers: list[tuple[BaseProcess, Connection]] = []
        self._closed: str | None = None
        for index in range(count):
            mine, theirs = context.Pipe()
            process = context.Process(
                target=_serve, args=(theirs, cfg, texts, tuple(stop_ids)), name=f"scoring-{index}", daemon=True
            )
            with _stop_signals_ignored():
                process.start()
            theirs.close()
            self._workers.append((process, mine))
        self._ready = False

    def wait_ready(self) -> None:
        """Wait until every worker has loaded the reward code (at once after the first call); a
        worker that could not is this call's error. ``start`` waits too: a run that calls this at
        set-up pays the workers' start-up there, not in its first step."""
        if self._ready:
            return
        try:
            for process, connection in self._workers:
                _Part(process, connection, []).reply("while loading the reward code")
        except BaseException as error:
            self.close(f"a worker failed to start ({type(error).__name__})")
            raise
        self._ready = True

    @property
    def processes(self) -> list[BaseProcess]:
        return [process for process, _ in self._workers]

    def start(
        self, completions: Sequence[Completion], rows: Sequence[int], extras: Sequence[dict[str, Any]]
    ) -> WorkerShare:
        """Send each worker a contiguous part of ``completions`` (rows ``rows`` of the rollout),
        without the per-token figures no reward reads (log-probs, the policy mask): a third of the
        bytes, pickled on the trainer's thread."""
        if self._closed is not None:
            raise RuntimeError(f"the scoring workers were stopped ({self._closed})")
        self.wait_ready()
        count = len(self._workers)
        bounds = [len(completions) * i // count for i in range(count + 1)]
        parts = []
        for (process, connection), low, high in zip(self._workers, bounds, bounds[1:], strict=False):
            if low < high:
                part = _Part(process, connection, list(rows[low:high]))
                try:
                    lean = [dataclasses.replace(c, logprobs=[], policy_mask=None) for c in completions[low:high]]
                    connection.send((lean, list(rows[low:high]), list(extras)))
                except OSError:  # it ended since its last part
                    self.close(f"worker {process.name} ended")
                    raise part.died(f"before it was sent rows {rows[low]}..{rows[high - 1]} of the rollout") from None
                parts.append(part)
        return WorkerShare(self, parts)

    def close(self, reason: str = "the run ended") -> None:
        """End every worker: asked first, then killed (one stuck in reward code does not listen, and
        workers ignore SIGTERM)."""
        if self._closed is not None:
            return
        self._closed = reason
        for _, connection in self._workers:
            with contextlib.suppress(OSError):  # it has exited already
                connection.send(None)
        for process, connection in self._workers:
            process.join(timeout=2)
            if process.is_alive():
                process.kill()
                process.join()
            connection.close()


@contextlib.contextmanager
def _stop_signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored while a worker is spawned: an ignored signal stays ignored through
    exec, and Python then installs no handler of its own, so a Ctrl-C meant for the trainer cannot
    end a worker still importing. (Only the main thread may set handlers; ``_serve`` sets the same.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, signal.SIG_IGN) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


class _Part:
    def __init__(self, process: BaseProcess, connection: Connection, rows: list[int]) -> None:
        self.process, self.connection, self.rows = process, connection, rows

    def reply(self, doing: str | None = None) -> Any:
        """The worker's next message's value; what it raised, raised here; ``died(doing)`` when it
        ended without a message."""
        try:
            kind, value = self.connection.recv()
        except (EOFError, OSError):  # closed, or reset by a worker that ended mid-reply
            raise self.died(doing) from None
        if kind == "error":
            raise value
        return value

    def died(self, doing: str | None = None) -> RewardFunctionError:
        """The error for a worker found ended ``doing`` (default: while scoring this part's rows)."""
        self.process.join(timeout=5)
        doing = doing or f"while scoring rows {self.rows[0]}..{self.rows[-1]} of the rollout"
        return RewardFunctionError(
            f"scoring worker {self.process.name} (pid {self.process.pid}) ended with exit code "
            f"{self.process.exitcode} {doing} (reward code that ends its process, or a crash in a library it calls)"
        )


class WorkerShare:
    """A rank's share, begun in the workers; ``result`` gathers the parts in order."""

    def __init__(self, workers: ScoringWorkers, parts: list[_Part]) -> None:
        self.workers, self.parts = workers, parts

    def result(self, interrupted: Callable[[], bool] | None = None) -> Share:
        """Every part's scores, joined in row order; what a worker raised; ``ScoringInterrupted``
        when ``interrupted()`` turns true while a part is pending (looked at every
        ``INTERRUPT_POLL_S``). Any of these but a result stops the workers."""
        try:
            return self._gather(interrupted)
        except BaseException as error:
            self.workers.close(f"scoring ended with {type(error).__name__}")
            raise

    def _gather(self, interrupted: Callable[[], bool] | None) -> Share:
        replies: dict[int, Share] = {}
        pending = {part.connection: index for index, part in enumerate(self.parts)}
        while pending:
            for ready in wait(list(pending), timeout=INTERRUPT_POLL_S if interrupted is not None else None):
                part_index = pending.pop(ready)  # type: ignore[call-overload]
                replies[part_index] = self.parts[part_index].reply()
            if pending and interrupted is not None and interrupted():
                raise ScoringInterrupted("a stop was requested while reward code ran (it had not returned)")
        return _joined([replies[index] for index in range(len(self.parts))])


def _joined(parts: list[Share]) -> Share:
    """Consecutive parts' scores as one share's."""
    scores: dict[str, list[float]] = {}
    customs = [custom for _, custom in parts if custom is not None]
    for part, _ in parts:
        for name, values in part.items():
            scores.setdefault(name, []).extend(values)
    if not customs:
        return scores, None
    metrics: dict[str, list[float]] = {}
    for custom in customs:
        for key, values in custom.metrics.items():
            metrics.setdefault(key, []).extend(values)
    return scores, CustomScores([s for custom in customs for s in custom.scores], metrics)


def _serve(connection: Connection, cfg: ScoringConfig, texts: Decoder, stop_ids: tuple[int, ...]) -> None:
    """A worker's life: load the reward code, then score each part it is sent until told to stop
    (None), its trainer is gone, or a part fails."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    errors, rules, function = scoring_errors(cfg)
    if errors:  # it loaded in the trainer: something differs in a fresh process
        message = "a scoring worker could not load the reward code: " + "; ".join(errors)
        connection.send(("error", RewardFunctionError(message)))
        return
    connection.send(("ready", None))
    while True:
        try:
            task = connection.recv()
        except EOFError:
            return
        if task is None:
            return
        completions, rows, extras = task
        try:
            share = watched_share(rules, function, completions, rows, extras, texts, stop_ids, cfg.timeout_s).result()
        except BaseException as error:  # handed to the trainer; this worker's job thread may be stuck
            connection.send(("error", _sendable(error)))
            return
        connection.send(("scores", share))


def _sendable(error: BaseException) -> BaseException:
    """``error`` as the trainer can receive it: the errors of reward code as they are (their
    messages carry the user's traceback), anything else with its traceback in its message."""
    if type(error) in (RewardFunctionError, ValueError):  # messages only: they pickle
        return error
    return RewardFunctionError(f"a scoring worker failed:\n{formatted(error)}")
