"""What every benchmark shares: timing, the device's ceilings, and the JSON report.

The benchmarks in this folder import it as a sibling module (``from common import ...``): running a
script by its path puts this folder first on ``sys.path``.

* Timing. ``clock`` waits for the device's queued work (and, with ``barrier``, for every rank) before
  it reads the wall clock, so that a difference of two readings covers the work launched between
  them. ``wall_seconds`` times one call, ``loop_seconds`` a run of calls queued back to back after a
  warm-up, ``sample_seconds`` each of several calls (for a median or a minimum);
  ``cuda_ms_per_call`` and ``graph_seconds`` time GPU work with CUDA events, the latter as one
  captured CUDA graph (no launch overhead, as the rollout engine replays it).
* Ceilings. ``matmul_peak`` (dense matmul FLOP/s: bf16 ``8192^3`` products on a GPU, fp32 ``1024^3``
  on a CPU), ``copy_bandwidth`` (a device-to-device copy: bytes read + bytes written per second) and
  ``host_bandwidth`` (pinned host <-> GPU copies), each measured in the same run as the figure it
  bounds. ``KernelReport`` sets a kernel's bytes against the copy rate.
* Reports. ``write_report`` prints a result as JSON on rank 0 and writes it to ``--out``.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

DATASHEET_BF16_FLOPS = 989e12
"""Dense bf16 FLOP/s of an H100 / H200 SXM by the datasheet (the MFU convention's denominator)."""


# -------------------------------------------------------------------------------------------------
# Timing


def clock(device: torch.device | None = None, *, barrier: bool = False) -> float:
    """``time.perf_counter()`` once ``device``'s queued work is done (and every rank is here, with ``barrier``)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    if barrier and dist.is_initialized():
        dist.barrier()
    return time.perf_counter()


def wall_seconds(fn: Callable[[], object], device: torch.device | None = None, *, barrier: bool = False) -> float:
    """Seconds of one call of ``fn``, the device's work included."""
    start = clock(device, barrier=barrier)
    fn()
    return clock(device, barrier=barrier) - start


def loop_seconds(
    fn: Callable[[], object],
    *,
    calls: int,
    warmup: int = 0,
    device: torch.device | None = None,
    barrier: bool = False,
) -> float:
    """Seconds per call of ``calls`` calls queued back to back, after ``warmup`` untimed ones: the
    host's launches overlap the device's work, as in a run."""
    for _ in range(warmup):
        fn()
    start = clock(device, barrier=barrier)
    for _ in range(calls):
        fn()
    return (clock(device, barrier=barrier) - start) / calls


def sample_seconds(
    fn: Callable[[], object], *, repeat: int, warmup: int = 0, device: torch.device | None = None
) -> list[float]:
    """Seconds of each of ``repeat`` calls (after ``warmup`` untimed ones), each waited for."""
    for _ in range(warmup):
        fn()
    return [wall_seconds(fn, device) for _ in range(repeat)]


def median(values: list[float]) -> float | None:
    """The median, or None for no values (a run that stopped before its steady steps)."""
    return statistics.median(values) if values else None


def cuda_ms_per_call(fn: Callable[[], object], *, calls: int, runs: int = 3) -> float:
    """Milliseconds per call of ``calls`` calls queued back to back, CUDA events around all of them
    (the host's launch overhead overlaps the kernels); the best of ``runs`` such runs, after one
    warm-up call."""
    fn()
    best = float("inf")
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / calls)
    return best


def graph_seconds(fn: Callable[[], object], *, replays: int = 20) -> float:
    """Seconds per call of ``fn``, warmed up on a side stream, captured once as a CUDA graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / replays


# -------------------------------------------------------------------------------------------------
# Device ceilings


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype the trainer's ``dtype=auto`` picks: bf16 on a GPU, fp32 on a CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def matmul_peak(
    device: torch.device, dtype: torch.dtype | None = None, *, size: int | None = None, reps: int = 20
) -> float:
    """FLOP/s of ``size``^3 matmuls in ``dtype`` (default: the device's compute dtype; 8192 on a GPU,
    1024 on a CPU): the practical ceiling of the device's dense math, below the datasheet's."""
    dtype = dtype or compute_dtype(device)
    size = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return 2 * size**3 / loop_seconds(lambda: a @ b, calls=reps, warmup=3, device=device)


def copy_bandwidth(device: torch.device, num_bytes: int | None = None, *, reps: int = 10) -> float:
    """Bytes read + bytes written per second of a device-to-device copy of ``num_bytes`` (default
    2 GiB on a GPU, 256 MiB on a CPU): the rate a read-dominated step (a decode step streaming its
    weights and KV cache, an optimizer step) can at best reach."""
    num_bytes = num_bytes or (2 * 1024**3 if device.type == "cuda" else 256 * 1024**2)
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * num_bytes / loop_seconds(lambda: target.copy_(source), calls=reps, warmup=1, device=device)


def host_bandwidth(device: torch.device, num_bytes: int = 1024**3, *, round_trips: int = 3) -> float:
    """Bytes per second of pinned host -> GPU and GPU -> host copies of ``num_bytes``, alternated."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty_like(host, device=device)

    def round_trip() -> None:
        on_device.copy_(host, non_blocking=True)
        host.copy_(on_device, non_blocking=True)

    return 2 * num_bytes / loop_seconds(round_trip, calls=round_trips, warmup=1, device=device)


class KernelReport:
    """A kernel benchmark's printed lines and JSON: each kernel's time per call, the bytes it must
    move at least (each input read once, each output written once), and that over the time as a
    fraction of the copy rate, measured first."""

    def __init__(self, shape: dict[str, int]) -> None:
        device = torch.device("cuda")
        self.bytes_per_ms = copy_bandwidth(device) / 1e3
        self.result: dict[str, Any] = {
            "device": device_name(device),
            "copy_TBps": self.bytes_per_ms / 1e9,
            "shape": shape,
            "kernels": {},
        }
        print(f"{self.result['device']}: copy {self.bytes_per_ms / 1e9:.3f} TB/s")

    def add(self, name: str, ms: float, nbytes: int) -> None:
        fraction = nbytes / ms / self.bytes_per_ms
        self.result["kernels"][name] = {"ms": ms, "bytes": nbytes, "of_copy_rate": fraction}
        print(f"  {name:<40} {ms * 1e3:9.1f} us  {nbytes / ms / 1e9:7.2f} TB/s  {100 * fraction:5.1f}% of copy")


def forward_backward_ms(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor, calls: int) -> tuple[float, float]:
    """(forward ms, backward ms) of ``fn`` on ``inputs``; the backward (the gradients to every input)
    is timed alone, from a kept graph."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    forward = cuda_ms_per_call(lambda: fn(*leaves), calls=calls)
    out = fn(*leaves)
    upstream = torch.randn_like(out)
    backward = cuda_ms_per_call(
        lambda: torch.autograd.grad(out, leaves, upstream, retain_graph=True),
        calls=calls,
    )
    return forward, backward


# -------------------------------------------------------------------------------------------------
# Reports


def is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def write_report(result: Mapping[str, Any], out: Path | None, *, show: bool = True) -> None:
    """Print ``result`` as JSON (``show``) and write it to ``out`` when given; rank 0 only."""
    if not is_rank_zero():
        return
    if show:
        print(json.dumps(result, indent=1), flush=True)
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")


class RunningReport:
    """Figures reported as they are measured: after each ``add``, rank 0 prints all of them so far as
    one JSON line (and rewrites ``out``), so that a run cut short keeps what it measured."""

    def __init__(self, out: Path | None = None, **figures: object) -> None:
        self.out = out
        self.figures: dict[str, object] = dict(figures)

    def add(self, **figures: object) -> None:
        self.figures.update(figures)
        if not is_rank_zero():
            return
        print(json.dumps(self.figures), flush=True)
        if self.out is not None:
            self.out.write_text(json.dumps(self.figures, indent=2) + "\n")
