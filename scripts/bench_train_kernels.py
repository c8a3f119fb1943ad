"""Benchmark: the training step's log-prob and entropy kernels over Qwen2.5's vocabulary
(``engine/logprobs_kernel.py``) against the compiled torch passes they replace
(``engine/logprobs.py``), forward and backward, at the 1.5B GRPO step's micro-batch shape, and
against the memory copy rate measured in the same run.

    python scripts/bench_train_kernels.py [--scored-tokens 10900] [--out kernels.json]

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
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_train_kernels.py needs a GPU")

    from megatron_rlhf.engine import logprobs_kernel
    from megatron_rlhf.engine.logprobs import token_logprobs_and_entropy

    torch.manual_seed(0)
    rate = copy_rate(args.repeat)
    result: dict = {"device": torch.cuda.get_device_name(), "copy_TBps": rate / 1e9, "kernels": {},
                    "shape": {"scored_tokens": args.scored_tokens, "vocab": args.vocab}}  # fmt: skip
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

    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
