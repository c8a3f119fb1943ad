"""Benchmark: the training step's SwiGLU kernel (``models/swiglu.py``) against megatron's compiled
one, at the 1.5B GRPO update's micro-batch shape, and against the memory copy rate measured in the
same run.

    python scripts/bench_swiglu.py [--tokens 16128] [--out swiglu.json]

For each of forward and backward: time per call (``--repeat`` calls back to back, best of three), the bytes it
must move at least (read each input once, write each output once) and that over the time, as a
fraction of the copy rate. GPU only.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch


def time_ms(fn: Callable[[], object], repeat: int) -> float:
    """Milliseconds per call of ``repeat`` calls queued back to back (CUDA events around all of
    them, so that the host's launch overhead overlaps the kernels); best of three such runs."""
    fn()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / repeat)
    return best


def copy_rate(repeat: int) -> float:
    """Bytes per ms of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_ms(lambda: dst.copy_(src), repeat)


class KernelReport:
    """A kernel benchmark's printed lines and JSON: each kernel's time per call, the bytes it must
    move at least, and that over the time as a fraction of the copy rate measured first."""

    def __init__(self, shape: dict, repeat: int) -> None:
        self.rate = copy_rate(repeat)
        self.result: dict = {
            "device": torch.cuda.get_device_name(),
            "copy_TBps": self.rate / 1e9,
            "shape": shape,
            "kernels": {},
        }
        print(f"{self.result['device']}: copy {self.rate / 1e9:.3f} TB/s")

    def add(self, name: str, ms: float, nbytes: int) -> None:
        self.result["kernels"][name] = {"ms": ms, "bytes": nbytes, "of_copy_rate": nbytes / ms / self.rate}
        print(
            f"  {name:<40} {ms * 1e3:9.1f} us  {nbytes / ms / 1e9:7.2f} TB/s  {100 * nbytes / ms / self.rate:5.1f}% of copy"
        )

    def write(self, out: Path | None) -> None:
        if out is not None:
            out.write_text(json.dumps(self.result, indent=2) + "\n")


def forward_backward(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, repeat: int) -> tuple[float, float]:
    """(forward ms, backward ms) of ``fn`` on x; the backward is timed alone, from a kept graph."""
    leaf = x.detach().requires_grad_()
    forward = time_ms(lambda: fn(leaf), repeat)
    out = fn(leaf)
    upstream = torch.randn_like(out)
    backward = time_ms(lambda: torch.autograd.grad(out, leaf, upstream, retain_graph=True), repeat)
    return forward, backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16128, help="tokens per micro-batch")
    parser.add_argument("--ffn", type=int, default=8960, help="SwiGLU width (Qwen2.5-1.5B)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_swiglu.py needs a GPU")

    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    from megatron_rlhf.models.swiglu import swiglu_impl

    torch.manual_seed(0)
    report = KernelReport({"tokens": args.tokens, "ffn": args.ffn}, args.repeat)

    bf16 = torch.bfloat16
    y = torch.randn(args.tokens, 2 * args.ffn, device="cuda", dtype=bf16)
    size = y.numel() * y.element_size()
    print(
        "SwiGLU (tokens x 2f -> tokens x f): forward reads y, writes half; backward reads y and the gradient, writes dy"
    )
    for name, fn in (
        ("ours", lambda x: swiglu_impl(x, None)),
        ("megatron compiled", lambda x: bias_swiglu_impl(x, None)),
    ):
        forward, backward = forward_backward(fn, y, args.repeat)
        report.add(f"swiglu forward, {name}", forward, size + size // 2)
        report.add(f"swiglu backward, {name}", backward, 2 * size + size // 2)
    report.write(args.out)


if __name__ == "__main__":
    main()
