"""Benchmark: the training step's vocabulary and norm kernels against the torch paths they replace,
at the 1.5B GRPO step's micro-batch shapes, and against the memory copy rate measured in the same run.

    python scripts/bench_train_kernels.py [--scored-tokens 10900] [--tokens 16128] [--out kernels.json]

* log-probs and entropy over Qwen2.5's vocabulary (``engine/logprobs_kernel.py``) against the
  compiled torch passes (``engine/logprobs.py``), forward and backward;
* the layers' RMSNorm backward (``models/rms_norm.py``) against torch's. At this size a call's host
  side (autograd, and Triton's Python launcher for ours) takes longer than its kernel, so these
  figures are launch-bound: the kernels' own times come from a profiled step (``bench_e2e.py
  --profile``), where the GEMMs around them hide the launches.

Per kernel: time per call (``--repeat`` calls back to back, best of three), the bytes it must move at
least (read each input once, write each output once), and that over the time as a fraction of the
copy rate. GPU only. (The SwiGLU kernel has its own script, ``bench_swiglu.py``, whose timing helpers
this one uses.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_swiglu import copy_rate, forward_backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scored-tokens", type=int, default=10900, help="response tokens per micro-batch (LM head rows)")
    parser.add_argument("--vocab", type=int, default=151936, help="padded vocabulary (Qwen2.5)")
    parser.add_argument("--tokens", type=int, default=16128, help="tokens per micro-batch (norm rows)")
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_train_kernels.py needs a GPU")

    from megatron_rlhf.engine import logprobs_kernel
    from megatron_rlhf.engine.logprobs import token_logprobs_and_entropy
    from megatron_rlhf.models.rms_norm import _RMSNormFunction

    torch.manual_seed(0)
    rate = copy_rate(args.repeat)
    result: dict = {"device": torch.cuda.get_device_name(), "copy_TBps": rate / 1e9, "kernels": {},
                    "shape": {"scored_tokens": args.scored_tokens, "vocab": args.vocab, "tokens": args.tokens, "hidden": args.hidden}}  # fmt: skip
    print(f"{result['device']}: copy {rate / 1e9:.3f} TB/s")

    def report(name: str, ms: float, nbytes: int) -> None:
        result["kernels"][name] = {"ms": ms, "bytes": nbytes, "of_copy_rate": nbytes / ms / rate}
        print(f"  {name:<40} {ms * 1e3:9.1f} us  {nbytes / ms / 1e9:7.2f} TB/s  {100 * nbytes / ms / rate:5.1f}% of copy")

    logits = torch.randn(1, args.scored_tokens, args.vocab, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(0, args.vocab, (1, args.scored_tokens), device="cuda")
    size = logits.numel() * logits.element_size()
    print("log-probs and entropy: forward reads the logits; backward reads them and writes their gradient")
    kernel_available = logprobs_kernel.available
    for name, available in (("ours", kernel_available), ("torch compiled", lambda t: False)):
        logprobs_kernel.available = available
        fn = lambda x: torch.stack(token_logprobs_and_entropy(x, targets, tp_group=None, vocab_size=args.vocab))  # noqa: E731
        forward, backward = forward_backward(fn, logits, args.repeat)
        report(f"log-probs forward, {name}", forward, size)
        report(f"log-probs backward, {name}", backward, 2 * size)
    logprobs_kernel.available = kernel_available

    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(args.hidden, device="cuda")).to(torch.bfloat16).requires_grad_()
    size = x.numel() * x.element_size()
    print("RMSNorm: backward reads x and the gradient, writes dx (the weight's gradient is small)")
    for name, fn in (("ours", lambda t: _RMSNormFunction.apply(t, weight, 1e-6)),
                     ("torch", lambda t: torch.nn.functional.rms_norm(t, (args.hidden,), weight, 1e-6))):  # fmt: skip
        _, backward = forward_backward(fn, x, args.repeat)
        report(f"rms_norm backward, {name}", backward, 3 * size)

    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
