"""Benchmark: the host-side work of one RL step, which the GPU waits for.

    python scripts/bench/host.py --model builtin:llama-1.5b --sequences 256 --prompt-len 128 --new-tokens 256

On a synthetic rollout of this shape (random token ids and log-probs; ``--samples`` per prompt), the
trainer's own functions: the engine's history read into completions at the end of a rollout
(``_History.of_slots``, every slot at once), ``rollout_batch`` (completions -> padded batch
tensors), ``_rollout_logprobs`` (the engine's log-probs in the batch layout), the scorer with a rule
reward (decode every prompt and response with the model's tokenizer, apply ``lowercase_fraction``),
and a pass's micro-batches over the rollout (``micro_batches``: the packing plan, then the first
piece laid out, as the GPU waits for it before a pass's first kernel). Best of ``--repeat`` runs
each, milliseconds. Then what one full collection of the cyclic garbage collector costs on this
process's heap, and after ``gc.freeze()`` (as the trainer's loop does before its first step).

Last, the rule scoring beside the launches of a GPU pass, which the trainer overlaps with it: the
main thread queues small torch ops (a pass's kernel launches, each a few microseconds of host work)
while the scorer scores the rollout, on its thread (``scoring.workers=0``) and in 1 and 2 worker
processes, with ``lowercase_fraction`` and with ``python_heavy_rule`` (pure Python, as answer
checkers are). Per mode: the main thread's op rate meanwhile against its rate alone, and the wall time
of start, as many ops as the main thread does alone in the scoring's own time, and the result:
one scoring time where the two overlap fully, two where they run one after the other. CPU only:
no model is built.
"""

from __future__ import annotations

import argparse
import gc
import random
from collections.abc import Callable
from typing import Any

from common import sample_seconds, write_report


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of ``repeat`` calls, in milliseconds: the host work alone, without other processes' noise."""
    return 1e3 * min(sample_seconds(fn, repeat=repeat))


def python_heavy_rule(sample: Any) -> float:
    """A stand-in for answer checking in pure Python (verl's math rules normalise and parse the
    response's text): twenty passes over the characters, about 0.2 ms for 256 characters."""
    text = sample.response_text
    found = sum(sum(1 for c in text if c.isalnum()) for _ in range(20))
    return found / (20 * max(len(text), 1))


def op_loop(ops: int) -> None:
    """``ops`` small in-place torch ops on a 16-element tensor: host work per op, as a launch is."""
    import torch

    x = torch.zeros(16)
    for _ in range(ops):
        x.add_(1.0)


def scoring_beside_launches(
    cfg: Any, rules: dict[str, Any], tokenizer: Any, start: Callable[[Any], Any]
) -> dict[str, dict[str, float]]:
    """Per mode (the scorer's thread, 1 and 2 workers): the main thread's op rate while the rollout is
    scored against alone, and the wall time of scoring with the ops the main thread does alone in the
    scoring's own time queued meanwhile (``start(scorer)`` begins a scoring)."""
    import dataclasses
    import time

    from megatron_rlhf.rewards.samples import reward_texts
    from megatron_rlhf.rewards.scoring import Scorer

    probe = 200_000
    rate_alone = probe / min(sample_seconds(lambda: op_loop(probe), repeat=3))
    found: dict[str, dict[str, float]] = {}
    for workers in (0, 1, 2):
        scorer = Scorer(
            dataclasses.replace(cfg, workers=workers),
            rules,
            None,
            None,
            stop_ids=tokenizer.stop_ids,
            max_new_tokens=0,
            max_tokens_per_micro_batch=16384,
            texts=reward_texts(tokenizer),
        )
        try:
            start(scorer).result()  # the workers' start-up (imports) outside the timings
            scoring_s = min(sample_seconds(lambda scorer=scorer: start(scorer).result(), repeat=3))
            ops = int(rate_alone * scoring_s)

            def overlapped(ops: int = ops, scorer: Any = scorer) -> tuple[float, float]:
                began = time.perf_counter()
                pending = start(scorer)
                queued = time.perf_counter()
                op_loop(ops)
                looped = time.perf_counter()
                pending.result()
                return ops / (looped - queued), time.perf_counter() - began

            runs = [overlapped() for _ in range(3)]
            rate, wall = max(r for r, _ in runs), min(w for _, w in runs)
        finally:
            scorer.close()
        name = f"workers={workers}" + (" (the scorer's thread)" if workers == 0 else "")
        found[name] = {
            "scoring_alone_ms": 1e3 * scoring_s,
            "op_rate_meanwhile_of_alone": rate / rate_alone,
            "scoring_with_ops_meanwhile_ms": 1e3 * wall,
            "of_scoring_alone": wall / scoring_s,
        }
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:llama-1.5b", help="whose tokenizer decodes the rollout")
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--samples", type=int, default=4, help="responses per prompt")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()

    import torch

    from megatron_rlhf.checkpoint.sources import local_dir
    from megatron_rlhf.data.tokenizer import load_tokenizer
    from megatron_rlhf.parallel.distributed import init_distributed
    from megatron_rlhf.parallel.layout import Layout, parallel_groups
    from megatron_rlhf.rewards.config import ScoringConfig, scoring_errors
    from megatron_rlhf.rewards.samples import reward_texts
    from megatron_rlhf.rewards.scoring import Scorer
    from megatron_rlhf.rollout.engine import Completion
    from megatron_rlhf.rollout.native import _History
    from megatron_rlhf.trainer.ppo import _rollout_logprobs, rollout_batch
    from megatron_rlhf.training.schedule import logits_only_at, micro_batches

    init_distributed("cpu")  # the scorer gathers rule scores over the (one-rank) world
    tokenizer = load_tokenizer(local_dir(args.model))
    rng = random.Random(0)
    token = lambda: rng.randrange(3, 30_000)  # noqa: E731  (ids of ordinary tokens)
    completions = []
    for prompt_index in range(args.sequences // args.samples):
        prompt = [token() for _ in range(args.prompt_len)]
        for sample in range(args.samples):
            response = [token() for _ in range(args.new_tokens)]
            completions.append(
                Completion(prompt_index, sample, prompt, response, [-4 * rng.random() for _ in response])
            )
    cfg = ScoringConfig(rules=["lowercase_fraction"])
    _, rules, function = scoring_errors(cfg)
    scorer = Scorer(
        cfg,
        rules,
        function,
        None,
        stop_ids=tokenizer.stop_ids,
        max_new_tokens=args.new_tokens,
        max_tokens_per_micro_batch=16384,
    )
    batch = rollout_batch(completions, tokenizer.pad_id)
    extras = [{}] * (args.sequences // args.samples)
    history = _History(len(completions))  # one row per decode step, one column per slot
    for step in range(args.new_tokens):
        history.append(
            torch.tensor([c.token_ids[step] for c in completions]),
            torch.tensor([c.logprobs[step] for c in completions]),
        )
    slots = list(range(len(completions)))
    # The actor update's batch: the rollout's tensors, its response as the LM head's positions.
    update_batch = {**logits_only_at(batch, "response_mask"), "advantages": torch.randn(batch["response_mask"].shape)}
    groups = parallel_groups(Layout(1, 1, 1))

    def first_piece() -> None:
        pieces, _ = micro_batches(update_batch, 16384, groups, torch.device("cpu"))
        pieces[0]

    result = {
        "shape": f"{len(completions)} sequences of {args.prompt_len} + {args.new_tokens} tokens",
        "history_of_slots_ms": best_ms(lambda: history.of_slots(slots, [0] * len(slots)), args.repeat),
        "rollout_batch_ms": best_ms(lambda: rollout_batch(completions, tokenizer.pad_id), args.repeat),
        "rollout_logprobs_ms": best_ms(lambda: _rollout_logprobs(completions, batch["response_mask"]), args.repeat),
        "score_rule_ms": best_ms(lambda: scorer.score(batch, completions, extras, tokenizer.decode_batch), args.repeat),
        "micro_batches_and_first_piece_ms": best_ms(first_piece, args.repeat),
    }
    # The cyclic GC walks every tracked object in a full collection, which it may start inside any
    # phase of a step; the trainer freezes what set-up leaves (trainer/loop.py). This heap holds the
    # imports and the rollout, not the models.
    result["gc_tracked_objects"] = len(gc.get_objects())
    result["full_gc_ms"] = best_ms(gc.collect, 3)
    gc.freeze()
    result["full_gc_after_freeze_ms"] = best_ms(gc.collect, 3)
    gc.unfreeze()
    result["scoring_beside_launches"] = {}
    for rule in ("lowercase_fraction", "host:python_heavy_rule"):
        rule_cfg = ScoringConfig(rules=[rule])
        _, rule_functions, _ = scoring_errors(rule_cfg)
        result["scoring_beside_launches"][rule] = scoring_beside_launches(
            rule_cfg,
            rule_functions,
            tokenizer,
            lambda scorer: scorer.start(batch, completions, extras, reward_texts(tokenizer)),
        )
    write_report(result, None)


if __name__ == "__main__":
    main()
