"""Rank-aware logging, phase timers and memory figures.

Only global rank 0 prints (other ranks would repeat it); errors are printed by every rank that
hits them. Memory figures come from the CUDA allocator on GPU and from the process RSS in CPU mode.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import logging
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def log(message: str) -> None:
    if is_rank0():
        print(message, file=sys.stdout, flush=True)


def environment_report() -> str:
    """One line for a run's log saying what it ran on: package and git commit, torch, CUDA,
    megatron-core, whether apex and Transformer Engine are importable (without them megatron
    falls back to torch kernels: slower, and other numerics), and torch's intra-op threads."""
    import megatron_rlhf

    def version(module: str) -> str:
        try:
            return importlib.metadata.version(module)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    here = Path(megatron_rlhf.__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    present = {
        name: importlib.util.find_spec(module) is not None
        for name, module in (("apex", "apex"), ("transformer-engine", "transformer_engine"))
    }
    return (
        f"megatron-rlhf {megatron_rlhf.__version__} (git {commit or 'unknown'}), torch {torch.__version__}, "
        f"CUDA {torch.version.cuda or 'none'}, megatron-core {version('megatron-core')}, "
        + ", ".join(f"{name} {'present' if ok else 'absent'}" for name, ok in present.items())
        + f"; {torch.get_num_threads()} host threads"
    )


def memory_summary(device: torch.device) -> str:
    gib = 1024**3
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device) / gib
        peak = torch.cuda.max_memory_allocated(device) / gib
        return f"gpu allocated {allocated:.2f} GiB, peak {peak:.2f} GiB"
    return f"cpu rss {psutil.Process().memory_info().rss / gib:.2f} GiB"


def format_eta(seconds: float) -> str:
    """H:MM:SS."""
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """A progress line for long work, at most every ``every_s`` seconds and at the end (rank 0):
    ``label: done/total (rate/s, eta)``. Call it with the count done so far."""

    def __init__(
        self, label: str, total: int, unit: str, every_s: float = 10.0, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.label, self.total, self.unit, self.every_s, self.clock = label, total, unit, every_s, clock
        self.start = self.last = clock()

    def __call__(self, done: int) -> None:
        now = self.clock()
        if done < self.total and now - self.last < self.every_s:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        eta = f", eta {format_eta((self.total - done) / rate)}" if 0 < done < self.total else ""
        log(f"{self.label}: {done}/{self.total} {self.unit} ({rate:,.1f}/s{eta})")


def snake_case(text: str) -> str:
    """A name (a phase, a reward rule's import path) as one part of a metric key: lowercase, each
    run of other characters than letters and digits one ``_`` (``generation weights (reshard)`` ->
    ``generation_weights_reshard``)."""
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


PHASE_MARK = "phase/"


def phase_range(phase: str) -> contextlib.AbstractContextManager[Any]:
    """A named range around a phase for the profiler (``profile_steps``: ``metrics/kernels.py``
    reports each ``phase/...`` range it finds); next to free when no profiler runs."""
    return torch.profiler.record_function(PHASE_MARK + phase)


@contextlib.contextmanager
def timed(
    phase: str,
    device: torch.device,
    times: dict[str, float] | None = None,
    *,
    quiet: bool = False,
    peaks: dict[str, float] | None = None,
) -> Iterator[None]:
    """Time a phase across all ranks (barrier at both ends), add it to ``times[phase]`` and log it
    with memory use (unless quiet). On a GPU, ``peaks`` gets the phase's peak allocated and reserved
    GiB of this rank (``peak_allocated_gib/<phase>``, ``peak_reserved_gib/<phase>``; the largest when
    a phase runs more than once): the allocator's peak counters are reset when the phase starts and
    read after the synchronize that ends it."""
    measure = peaks is not None and device.type == "cuda"
    if dist.is_initialized():
        dist.barrier()
    if measure:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    with phase_range(phase):
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if peaks is not None and measure:
        for kind, value in (
            ("allocated", torch.cuda.max_memory_allocated(device)),
            ("reserved", torch.cuda.max_memory_reserved(device)),
        ):
            key = f"peak_{kind}_gib/{phase}"
            peaks[key] = max(peaks.get(key, 0.0), value / 1024**3)
    if dist.is_initialized():
        dist.barrier()
    elapsed = time.perf_counter() - start
    if times is not None:  # a phase run more than once in a step (extra rollout batches) adds up
        times[phase] = times.get(phase, 0.0) + elapsed
    if not quiet:
        log(f"[{phase}] {elapsed:.2f}s, {memory_summary(device)}")


def quiet_known_warnings() -> None:
    """Silence megatron-core's expected notices on machines without apex/Transformer Engine.

    They repeat on every rank and every model build (torch fallbacks in use, GPTModel deprecation;
    the model class choice lives in models/builder.py) and would bury the run's own output. Call it
    before megatron is imported.
    """
    for message in (
        "Transformer Engine and Apex are not installed",
        "Apex is not installed",
        "full scope is deprecated",
    ):
        warnings.filterwarnings("ignore", message=message)
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
