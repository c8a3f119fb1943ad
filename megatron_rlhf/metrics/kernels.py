"""Where a profiled region's time goes, for the benchmarks' ``--profile``: time and launches per
GPU kernel, or per CPU operator in CPU mode (no kernels there), and a coarse split by kind, to say
whether a step is bound by matmuls, attention, elementwise work, the optimizer or the host."""

from __future__ import annotations

from pathlib import Path

from torch.autograd import DeviceType
from torch.profiler import profile

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
    kernels = {e.key: (e.self_device_time_total, e.count) for e in events
               if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0}  # fmt: skip
    if kernels:
        return kernels
    return {e.key: (e.self_cpu_time_total, e.count) for e in events if e.key.startswith("aten::") and e.self_cpu_time_total > 0}


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


def costliest(times: dict[str, tuple[float, float]], count: int) -> list[str]:
    """Table lines (microseconds, launches, name) of the ``count`` costliest entries of ``times``."""
    ranked = sorted(times.items(), key=lambda kv: -kv[1][0])[:count]
    return [f"{us:12.1f} us {n:8.1f}x  {name[:110]}" for name, (us, n) in ranked]


def print_report(lines: list[str], out: Path | None) -> None:
    """Print a profile's lines, and write them beside ``out`` (the benchmark's JSON) as ``.profile.txt``."""
    text = "\n".join(lines)
    print(text)
    if out is not None:
        out.with_suffix(".profile.txt").write_text(text + "\n")
