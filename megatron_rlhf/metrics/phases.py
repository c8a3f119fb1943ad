"""The phase timer of a training step: each phase's seconds and memory peak, the parts a phase
reports from inside (generation's weight refresh, its memory switches), and the spread of each
phase's time over recent steps.

A step times its phases with ``phase`` (all ranks together: a barrier at both ends) and collects
them once, at its end, with ``step_metrics``, which also starts the next step. Code that runs inside
a phase on behalf of the trainer (the hybrid engine) reports its own parts with ``part`` or ``add``;
they are filed under the phase open at the time.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import time
from collections.abc import Iterator

import torch

from megatron_rlhf.metrics.log import phase_range, snake_case, timed

WINDOW_STEPS = 20
"""Steps whose phase times make up each ``timing_s/<phase>/std``."""


class PhaseTimer:
    """Times the phases of one step after another on ``device``.

    Metrics of a step (``step_metrics``): ``timing_s/<phase>`` (the seconds of each phase, in the order
    the phases ran, summed when a phase ran more than once), ``timing_s/<phase>/<part>`` (the parts
    reported inside it), ``timing_s/<phase>/std`` (the population std of that phase's seconds over
    the last ``window`` steps that ran it, this one included) and, on a GPU,
    ``memory/peak_{allocated,reserved}_gib/<phase>`` (this rank's allocator peaks in the phase).
    """

    def __init__(self, device: torch.device, *, window: int = WINDOW_STEPS) -> None:
        self.device = device
        self.window = window
        self._seconds: dict[str, float] = {}
        self._parts: dict[str, float] = {}
        self._peaks: dict[str, float] = {}
        self._open: list[str] = []
        self._recent: dict[str, collections.deque[float]] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A phase of the step, timed across all ranks with its memory peaks (``log.timed``)."""
        self._open.append(name)
        try:
            with timed(name, self.device, self._seconds, quiet=True, peaks=self._peaks):
                yield
        finally:
            self._open.pop()

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """A part of the open phase, on this rank: its time up to the device's last kernel. No barrier,
        and the phase's memory peak is left to the phase."""
        key = self._part_key(name)
        start = time.perf_counter()
        with phase_range(key):
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        self._parts[key] = self._parts.get(key, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        """Seconds of a part of the open phase measured elsewhere (e.g. inside another part)."""
        key = self._part_key(name)
        self._parts[key] = self._parts.get(key, 0.0) + seconds

    def _part_key(self, name: str) -> str:
        return "/".join([*self._open[-1:], snake_case(name)])

    def step_metrics(self) -> dict[str, float]:
        """The step's figures (see the class docstring); the timer then starts on the next step."""
        metrics = {f"timing_s/{name}": seconds for name, seconds in (self._seconds | self._parts).items()}
        for name, seconds in self._seconds.items():
            recent = self._recent.setdefault(name, collections.deque(maxlen=self.window))
            recent.append(seconds)
            metrics[f"timing_s/{name}/std"] = statistics.pstdev(recent)
        metrics |= {f"memory/{key}": gib for key, gib in self._peaks.items()}
        self._seconds, self._parts, self._peaks = {}, {}, {}
        return metrics
