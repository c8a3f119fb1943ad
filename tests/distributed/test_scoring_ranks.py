"""Rule scores over 2 ranks (torchrun, gloo): gathered in row order (on the scorer's thread and in
worker processes), and a share that fails on one
rank (a rule raising, or hanging past scoring.timeout_s) fails every rank with that rule's message
instead of leaving the other rank waiting in the gather."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import run_worker

WORKER = Path(__file__).with_name("scoring_worker.py")


@pytest.mark.distributed
def test_a_failed_share_fails_every_rank_with_its_message(tmp_path: Path) -> None:
    ranks = run_worker(WORKER, 2, tmp_path, timeout=300)["ranks"]
    for results in ranks:
        assert results["ok"]["scores"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # row i's response has i + 1 tokens
        assert results["ok_in_workers"]["scores"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]

    own, other = ranks[1]["raises_on_rank_1"], ranks[0]["raises_on_rank_1"]
    assert own["error"] == other["error"] == "RewardFunctionError"
    assert own["message"].startswith(f"reward rule 'rule' ({WORKER}) on sample 3 (response 'r4') raised:\nTraceback")
    assert own["message"].rstrip().endswith("KeyError: 'answer'")
    assert other["message"] == f"scoring failed on rank 1: {own['message']}"

    own, other = ranks[0]["hangs_on_rank_0"], ranks[1]["hangs_on_rank_0"]
    assert own["error"] == other["error"] == "RewardFunctionError"
    assert own["message"].startswith(f"reward rule 'rule' ({WORKER}) on sample 2 (response 'r3') has run 1.")
    assert "longer than scoring.timeout_s=1 " in own["message"] and "RELEASE.wait(120)" in own["message"]
    assert other["message"] == f"scoring failed on rank 0: {own['message']}"
    assert max(own["seconds"], other["seconds"]) < 30  # the timeout, not the rule's 120 s wait
