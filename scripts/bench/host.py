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
process's heap, and after ``gc.freeze()`` (as the trainer's loop does before its first step). CPU
only: no model is built.
"""

from __future__ import annotations

import argparse
import gc
import random
from collections.abc import Callable

from common import sample_seconds, write_report


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of ``repeat`` calls, in milliseconds: the host work alone, without other processes' noise."""
    return 1e3 * min(sample_seconds(fn, repeat=repeat))


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
    write_report(result, None)


if __name__ == "__main__":
    main()
