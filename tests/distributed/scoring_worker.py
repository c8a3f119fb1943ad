"""torchrun worker (gloo, 2 ranks): a rollout's rule scores gathered over the ranks, when every
share succeeds and when one rank's share fails (a rule raises there, or hangs past scoring.timeout_s);
and every share split again over two worker processes per rank (``scoring.workers``).

    scoring_worker.py OUT

Rows split over the ranks as the scorer splits them (row i on rank i % 2). OUT/results.json holds,
under "ranks", each rank's outcome of each case: the gathered scores or the error it raised (type,
message), and the seconds the case took.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megatron_rlhf.data.tokenizer import ByteTokenizer
from megatron_rlhf.rewards.samples import reward_texts
from megatron_rlhf.rewards.scoring import Scorer, ScoringConfig
from megatron_rlhf.rollout.engine import Completion
from megatron_rlhf.trainer.ppo import rollout_batch
from tests.launch import WorkerSession, worker_session

RELEASE = threading.Event()


def length(sample) -> float:
    return float(len(sample.response_ids))


def raises_on_row_3(sample) -> float:
    if len(sample.response_ids) == 4:  # row 3: rank 1's share
        return {"score": 1.0}["answer"]
    return 1.0


def hangs_on_row_2(sample) -> float:
    if len(sample.response_ids) == 3:  # row 2: rank 0's share
        RELEASE.wait(120)
    return 1.0


CASES = {"ok": (length, 60.0), "raises_on_rank_1": (raises_on_row_3, 60.0), "hangs_on_rank_0": (hangs_on_row_2, 1.0)}


def main(session: WorkerSession) -> None:
    completions = [
        Completion(
            prompt_index=i // 2, sample_index=i % 2, prompt_ids=[5], token_ids=[7] * (i + 1), logprobs=[0.0] * (i + 1)
        )
        for i in range(6)
    ]
    batch = rollout_batch(completions, 0)
    decode = lambda rows: [f"r{len(ids)}" for ids in rows]  # noqa: E731
    results: dict[str, dict] = {}
    for case, (rule, timeout_s) in CASES.items():
        scorer = Scorer(
            ScoringConfig(timeout_s=timeout_s),
            {"rule": rule},
            None,
            None,
            stop_ids=(),
            max_new_tokens=8,
            max_tokens_per_micro_batch=64,
        )
        start = time.monotonic()
        try:
            scores = scorer.score(batch, completions, [{}] * 3, decode)
            results[case] = {"scores": scores.raw.tolist()}
        except Exception as err:
            results[case] = {"error": type(err).__name__, "message": str(err)}
        results[case]["seconds"] = time.monotonic() - start
    # Each rank's 3 rows go to its 2 workers as 1 + 2 rows; the rule by its import path, as workers load it.
    scorer = Scorer(
        ScoringConfig(rules=["scoring_worker:length"], workers=2),
        {"scoring_worker:length": length},
        None,
        None,
        stop_ids=(),
        max_new_tokens=8,
        max_tokens_per_micro_batch=64,
        texts=reward_texts(ByteTokenizer(259)),
    )
    try:
        results["ok_in_workers"] = {"scores": scorer.score(batch, completions, [{}] * 3, decode).raw.tolist()}
    finally:
        scorer.close()
    RELEASE.set()
    ranks: list[dict[str, dict]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(ranks, results)  # the collectives still line up after the failed cases
    session.results["ranks"] = ranks


if __name__ == "__main__":
    with worker_session() as session:
        main(session)
