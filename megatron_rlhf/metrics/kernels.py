"""Where a profiled region's time goes, for the benchmarks' ``--profile`` and the trainers'
``profile_steps``: time and launches per GPU kernel, or per CPU operator in CPU mode (no kernels
there), and a coarse split by kind, to say whether a step is bound by matmuls, attention,
elementwise work, the optimizer or the host."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from megatron_rlhf.metrics.log import PHASE_MARK, log

KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # First match wins: attention kernels are CUTLASS-built too, so they come before the GEMMs.
    ("attention", ("flash", "fmha", "attention")),
    ("gemm", ("gemm", "nvjet", "xmma", "aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm")),
    ("compiled (triton)", ("triton",)),
    ("optimizer", ("multi_tensor", "adam")),
    ("communication", ("nccl", "gloo", "c10d")),
    ("copy / fill", ("memcpy", "memset", "copy", "fill")),
)
OTHER = "elementwise / reduction / other"


def op_times(prof: profile) -> dict[str, tuple[float, int]]:
    """name -> (self time in microseconds, count): the GPU kernels if any ran, else the CPU operators."""
    events = prof.key_averages()
    kernels = {
        e.key: (e.self_device_time_total, e.count)
        for e in events
        if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0
    }
    if kernels:
        return kernels
    return {
        e.key: (e.self_cpu_time_total, e.count)
        for e in events
        if e.key.startswith("aten::") and e.self_cpu_time_total > 0
    }


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, patterns in KINDS if any(p in lowered for p in patterns)), OTHER)


def by_kind(times: dict[str, tuple[float, int]]) -> dict[str, float]:
    """Microseconds per kind, largest first."""
    totals: dict[str, float] = {}
    for name, (us, _) in times.items():
        kind = kind_of(name)
        totals[kind] = totals.get(kind, 0.0) + us
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def costliest(times: Mapping[str, tuple[float, float]], count: int) -> list[str]:
    """Table lines (microseconds, launches, name) of the ``count`` costliest entries of ``times``."""
    ranked = sorted(times.items(), key=lambda kv: -kv[1][0])[:count]
    return [f"{us:12.1f} us {n:8.1f}x  {name[:110]}" for name, (us, n) in ranked]


def print_report(lines: list[str], out: Path | None) -> None:
    """Print a profile's lines, and write them beside ``out`` (the benchmark's JSON) as ``.profile.txt``."""
    text = "\n".join(lines)
    print(text)
    if out is not None:
        out.with_suffix(".profile.txt").write_text(text + "\n")


# -------------------------------------------------------------------------------------------------
# A profiled training step, phase by phase (``profile_steps``).


def _merged_length(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``intervals``: the time at least one of them runs."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


@dataclasses.dataclass(frozen=True)
class PhaseFigures:
    """One phase range of a profiled region: ``busy_ms`` is the union of its GPU kernels, copies and
    fills (in CPU mode, the sum of its operators' self time); the rest of ``wall_ms`` the device
    waited on the host. ``depth`` counts the ranges it lies inside."""

    name: str
    depth: int
    wall_ms: float
    busy_ms: float
    launches: int
    by_kind_ms: dict[str, float]
    top_kernels: dict[str, tuple[float, int]]  # kernel -> (microseconds, launches), the ``top`` costliest


def phase_figures(prof: profile, top: int = 20) -> tuple[bool, list[PhaseFigures]]:
    """(whether GPU kernels ran, each phase range in ``prof`` outermost first in time order). A
    kernel belongs to the range its GPU start falls in: each phase ends with a device synchronize,
    so its kernels cannot spill into the next."""
    events = prof.events()
    ranges = sorted(
        (
            (e.name.removeprefix(PHASE_MARK), e.time_range.start, e.time_range.end)
            for e in events
            if e.device_type == DeviceType.CPU and e.is_user_annotation and e.name.startswith(PHASE_MARK)
        ),
        key=lambda r: (r[1], -r[2]),
    )
    work = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == DeviceType.CUDA and not e.is_user_annotation
    ]
    on_gpu = bool(work)
    if not on_gpu:
        work = [
            (e.name, e.time_range.start, e.time_range.start + e.self_cpu_time_total)
            for e in events
            if e.device_type == DeviceType.CPU and e.name.startswith("aten::") and e.self_cpu_time_total > 0
        ]
    work.sort(key=lambda w: w[1])
    starts = [w[1] for w in work]
    figures = []
    open_ends: list[float] = []
    for name, start, end in ranges:
        while open_ends and open_ends[-1] <= start:
            open_ends.pop()
        depth = len(open_ends)
        open_ends.append(end)
        inside = work[bisect.bisect_left(starts, start) : bisect.bisect_right(starts, end)]
        spans = [(s, e) for _, s, e in inside]
        busy_us = _merged_length(spans) if on_gpu else sum(e - s for s, e in spans)
        per_name: dict[str, tuple[float, int]] = {}
        for kernel, s, e in inside:
            us, n = per_name.get(kernel, (0.0, 0))
            per_name[kernel] = (us + e - s, n + 1)
        figures.append(
            PhaseFigures(
                name=name,
                depth=depth,
                wall_ms=(end - start) / 1e3,
                busy_ms=busy_us / 1e3,
                launches=len(inside),
                by_kind_ms={kind: us / 1e3 for kind, us in by_kind(per_name).items()},
                top_kernels=dict(sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]),
            )
        )
    return on_gpu, figures


def phase_report(on_gpu: bool, figures: list[PhaseFigures]) -> list[str]:
    """Lines for ``phase_figures``' ranges (sub-phases indented): wall time, busy time, launches,
    time by kind and the costliest kernels."""
    lines = [
        f"{len(figures)} phase ranges; "
        + ("GPU kernels, copies and fills" if on_gpu else "CPU operators (no GPU kernels ran)")
    ]
    what = "GPU busy" if on_gpu else "in operators"
    for phase in figures:
        indent = "  " * phase.depth
        lines.append(
            f"{indent}{phase.name}: {phase.wall_ms:.1f} ms wall, {what} {phase.busy_ms:.1f} ms "
            f"({100 * phase.busy_ms / max(phase.wall_ms, 1e-9):.0f}%), "
            f"{phase.launches} {'launches' if on_gpu else 'operator calls'}"
        )
        if phase.by_kind_ms:
            lines.append(
                f"{indent}  by kind (ms): " + ", ".join(f"{kind} {ms:.1f}" for kind, ms in phase.by_kind_ms.items())
            )
        lines += [f"{indent}  {line}" for line in costliest(phase.top_kernels, len(phase.top_kernels))]
    return lines


@contextlib.contextmanager
def profiled(stem: Path) -> Iterator[None]:
    """Profile the block (CPU, and CUDA when present, with shapes): ``STEM.txt`` gets
    ``phase_report``, ``STEM.json`` the same figures less the kernel lists (for benchmarks to read)
    and ``STEM.trace.json.gz`` the trace (Perfetto, chrome://tracing)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(
        activities=activities, record_shapes=True, acc_events=True
    ) as prof:  # one cycle: acc_events only quiets a warning
        yield
    on_gpu, figures = phase_figures(prof)
    lines = phase_report(on_gpu, figures)
    stem.parent.mkdir(parents=True, exist_ok=True)
    text_file, trace_file = stem.with_name(stem.name + ".txt"), stem.with_name(stem.name + ".trace.json.gz")
    text_file.write_text("\n".join(lines) + "\n")
    phases = [{k: v for k, v in dataclasses.asdict(p).items() if k != "top_kernels"} for p in figures]
    stem.with_name(stem.name + ".json").write_text(json.dumps({"on_gpu": on_gpu, "phases": phases}, indent=1) + "\n")
    prof.export_chrome_trace(str(trace_file))
    log(
        "\n".join(
            [
                f"profile: {text_file} (trace: {trace_file.name}); per phase:",
                *(line for line in lines[1:] if line.rstrip().endswith(("launches", "operator calls"))),
            ]
        )
    )
