"""Benchmark: the training step's log-prob and entropy kernels over Qwen2.5's vocabulary
(``training/logprobs_kernel.py``) against the compiled torch passes they replace
(``training/logprobs.py``), forward and backward, at the 1.5B GRPO step's micro-batch shape, and
against the memory copy rate measured in the same run.

    python scripts/bench/train_kernels.py [--scored-tokens 10900] [--out kernels.json]

Per kernel: time per call (``--repeat`` calls back to back, best of three), the bytes it must move at
least (read each input once, write each output once), and that over the time as a fraction of the
copy rate. GPU only. (The SwiGLU kernel has its own script, ``swiglu.py``.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import KernelReport, forward_backward_ms, write_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--scored-tokens", type=int, default=10900, help="response tokens per micro-batch (LM head rows)"
    )
    parser.add_argument("--vocab", type=int, default=151936, help="padded vocabulary (Qwen2.5)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("scripts/bench/train_kernels.py needs a GPU")

    from megatron_rlhf.training import logprobs_kernel
    from megatron_rlhf.training.logprobs import token_logprobs_and_entropy

    torch.manual_seed(0)
    report = KernelReport({"scored_tokens": args.scored_tokens, "vocab": args.vocab})

    logits = torch.randn(1, args.scored_tokens, args.vocab, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(0, args.vocab, (1, args.scored_tokens), device="cuda")
    size = logits.numel() * logits.element_size()
    print("log-probs and entropy: forward reads the logits; backward reads them and writes their gradient")
    kernel_available = logprobs_kernel.available

    def both(x: torch.Tensor) -> torch.Tensor:
        return torch.stack(token_logprobs_and_entropy(x, targets, tp_group=None, vocab_size=args.vocab))

    for name, available in (("ours", kernel_available), ("torch compiled", lambda _tensor: False)):
        logprobs_kernel.available = available  # the switch token_logprobs_and_entropy reads at each call
        forward, backward = forward_backward_ms(both, logits, calls=args.repeat)
        report.add(f"log-probs forward, {name}", forward, size)
        report.add(f"log-probs backward, {name}", backward, 2 * size)
    logprobs_kernel.available = kernel_available
    write_report(report.result, args.out, show=False)


if __name__ == "__main__":
    main()
