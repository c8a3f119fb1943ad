"""Where a profiled region's time goes, for the benchmarks' ``--profile`` and the trainers'
``profile_steps``: time and launches per GPU kernel, or per CPU operator in CPU mode (no kernels
there), and a coarse split by kind, to say whether a step is bound by matmuls, attention,
elementwise work, the optimizer or the host."""

from __future__ import annotations

import bisect
import contextlib
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


def phase_report(prof: profile, top: int = 20) -> list[str]:
    """Lines for each phase range in ``prof`` (outermost first in time order, sub-phases indented):
    wall time, GPU busy time (the union of its kernels, copies and fills: the rest is the GPU
    waiting on the host), launches, time by kind and the costliest kernels. A kernel belongs to the
    range its GPU start falls in: each phase ends with a device synchronize, so its kernels cannot
    spill into the next. In CPU mode the same for the CPU operators' self time."""
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
    lines = [
        f"{len(ranges)} phase ranges; "
        + ("GPU kernels, copies and fills" if on_gpu else "CPU operators (no GPU kernels ran)")
    ]
    open_ends: list[float] = []
    for name, start, end in ranges:
        while open_ends and open_ends[-1] <= start:
            open_ends.pop()
        indent = "  " * len(open_ends)
        open_ends.append(end)
        inside = work[bisect.bisect_left(starts, start) : bisect.bisect_right(starts, end)]
        wall_ms = (end - start) / 1e3
        spans = [(s, e) for _, s, e in inside]
        busy_ms = (_merged_length(spans) if on_gpu else sum(e - s for s, e in spans)) / 1e3
        per_name: dict[str, tuple[float, int]] = {}
        for kernel, s, e in inside:
            us, n = per_name.get(kernel, (0.0, 0))
            per_name[kernel] = (us + e - s, n + 1)
        what = "GPU busy" if on_gpu else "in operators"
        lines.append(
            f"{indent}{name}: {wall_ms:.1f} ms wall, {what} {busy_ms:.1f} ms "
            f"({100 * busy_ms / max(wall_ms, 1e-9):.0f}%), "
            f"{len(inside)} {'launches' if on_gpu else 'operator calls'}"
        )
        if per_name:
            kinds = by_kind(per_name)
            lines.append(
                f"{indent}  by kind (ms): " + ", ".join(f"{kind} {us / 1e3:.1f}" for kind, us in kinds.items())
            )
        lines += [f"{indent}  {line}" for line in costliest(per_name, top)]
    return lines


@contextlib.contextmanager
def profiled(stem: Path) -> Iterator[None]:
    """Profile the block (CPU, and CUDA when present, with shapes): ``STEM.txt`` gets
    ``phase_report`` and ``STEM.trace.json.gz`` the trace (Perfetto, chrome://tracing)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(
        activities=activities, record_shapes=True, acc_events=True
    ) as prof:  # one cycle: acc_events only quiets a warning
        yield
    lines = phase_report(prof)
    stem.parent.mkdir(parents=True, exist_ok=True)
    text_file, trace_file = stem.with_name(stem.name + ".txt"), stem.with_name(stem.name + ".trace.json.gz")
    text_file.write_text("\n".join(lines) + "\n")
    prof.export_chrome_trace(str(trace_file))
    log(
        "\n".join(
            [
                f"profile: {text_file} (trace: {trace_file.name}); per phase:",
                *(line for line in lines[1:] if line.rstrip().endswith(("launches", "operator calls"))),
            ]
        )
    )
