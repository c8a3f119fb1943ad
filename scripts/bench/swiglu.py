"""Benchmark: the training step's SwiGLU kernel (``models/swiglu.py``) against megatron's compiled
one, at the 1.5B GRPO update's micro-batch shape, and against the memory copy rate measured in the
same run.

    python scripts/bench/swiglu.py [--tokens 16128] [--out swiglu.json]

For each of forward and backward: time per call (``--repeat`` calls back to back, best of three), the
bytes it must move at least (read each input once, write each output once) and that over the time, as
a fraction of the copy rate. GPU only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import KernelReport, forward_backward_ms, write_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16128, help="tokens per micro-batch")
    parser.add_argument("--ffn", type=int, default=8960, help="SwiGLU width (Qwen2.5-1.5B)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("scripts/bench/swiglu.py needs a GPU")

    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    from megatron_rlhf.models.swiglu import swiglu_impl

    torch.manual_seed(0)
    report = KernelReport({"tokens": args.tokens, "ffn": args.ffn})

    y = torch.randn(args.tokens, 2 * args.ffn, device="cuda", dtype=torch.bfloat16)
    size = y.numel() * y.element_size()
    print(
        "SwiGLU (tokens x 2f -> tokens x f): forward reads y, writes half; backward reads y and the gradient, writes dy"
    )
    for name, fn in (
        ("ours", lambda x: swiglu_impl(x, None)),
        ("megatron compiled", lambda x: bias_swiglu_impl(x, None)),
    ):
        forward, backward = forward_backward_ms(fn, y, calls=args.repeat)
        report.add(f"swiglu forward, {name}", forward, size + size // 2)
        report.add(f"swiglu backward, {name}", backward, 2 * size + size // 2)
    write_report(report.result, args.out, show=False)


if __name__ == "__main__":
    main()
