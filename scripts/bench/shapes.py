"""Benchmark (CPU): how often a run's micro-batches bring attention a shape it has not seen.

    python scripts/bench/shapes.py [--steps 50] [--sequences 256] [--budget 16384]

On a GPU, SDPA's cuDNN backend builds a plan the first time it sees a shape (rows, width): 71-73 ms
forward and 69-83 ms backward on an H200 for a 1.5B model's layer shapes (docs/benchmarks.md, "One
GRPO step"). Micro-batches whose rows hold one sequence each go through SDPA; a row holding several
goes to flash attention's variable-length kernel, which has no plan (``models/attention.py``). For
each length distribution below, the trainer's own micro-batching (``micro_batches``, packed) of
``--steps`` rollouts of ``--sequences`` sequences: the share of micro-batches that go through SDPA
and the number of SDPA shapes each step brings that no earlier step had. No model is built.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable

import torch
from common import write_report

from megatron_rlhf.parallel.distributed import init_distributed
from megatron_rlhf.parallel.layout import Layout, parallel_groups
from megatron_rlhf.training.schedule import micro_batches


def exposure(lengths_of_step: Callable[[], list[int]], steps: int, budget: int) -> dict[str, object]:
    """Micro-batches through SDPA out of all, and the new SDPA shapes of each step."""
    groups = parallel_groups(Layout(1, 1, 1))
    seen: set[tuple[int, ...]] = set()
    new_per_step, on_sdpa, total = [], 0, 0
    for _ in range(steps):
        lengths = lengths_of_step()
        mask = (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).long()
        pieces, _ = micro_batches(
            {"input_ids": torch.zeros_like(mask), "attention_mask": mask}, budget, groups, torch.device("cpu")
        )
        new = 0
        for index in range(len(pieces)):
            piece = pieces[index]
            total += 1
            if "cu_seqlens" in piece:  # a row holds several sequences: the variable-length kernel
                continue
            on_sdpa += 1
            shape = tuple(piece["input_ids"].shape)
            new += shape not in seen
            seen.add(shape)
        new_per_step.append(new)
    tail = new_per_step[steps // 2 :]
    return {
        "micro_batches_on_sdpa": f"{on_sdpa}/{total}",
        "new_sdpa_shapes_first_steps": new_per_step[:5],
        "new_sdpa_shapes_per_step_second_half": sum(tail) / len(tail),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--budget", type=int, default=16384, help="max_tokens_per_micro_batch")
    args = parser.parse_args()
    init_distributed("cpu")
    rng = random.Random(0)

    def step_of(length: Callable[[], int]) -> Callable[[], list[int]]:
        return lambda: [length() for _ in range(args.sequences)]

    distributions = {
        "128 + 256 tokens, every response full (the e2e bench)": step_of(lambda: 384),
        "128-token prompts, responses U(50, 256)": step_of(lambda: 128 + rng.randint(50, 256)),
        "150-token prompts, responses U(100, 1024)": step_of(lambda: 150 + rng.randint(100, 1024)),
        "150-token prompts, 70% of responses cut at 1024, the rest U(100, 1024)": step_of(
            lambda: 150 + (1024 if rng.random() < 0.7 else rng.randint(100, 1024))
        ),
    }
    result = {name: exposure(lengths, args.steps, args.budget) for name, lengths in distributions.items()}
    write_report(result, None)


if __name__ == "__main__":
    main()
