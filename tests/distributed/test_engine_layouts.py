"""Log-probs, entropy and PPO actor/critic updates at TP1xDP4, TP2, PP2, TP2xPP2 equal a TP1 run;
the update does not depend on the micro-batch split (torchrun, gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import run_worker

WORKER = Path(__file__).with_name("engine_worker.py")


@pytest.mark.distributed
def test_logprobs_and_updates_match_tp1_in_every_layout(tmp_path: Path) -> None:
    reference, compare = tmp_path / "reference", tmp_path / "compare"
    reference_results = run_worker(WORKER, 1, reference, "reference")
    results = run_worker(WORKER, 4, compare, "compare", str(reference))
    print(json.dumps(results, indent=1))
    for layout in ("tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2"):
        for label in ("logprobs_t1", "logprobs_t07", "entropy"):
            assert results[f"{layout}/{label}_max_abs_diff"] < 1e-5
        assert results[f"{layout}/actor_update_max_rel_diff"] < 1e-5
        assert results[f"{layout}/critic_update_max_rel_diff"] < 1e-5
    assert results["tp2pp2/split_independence_rel"] < 1e-5
    assert reference_results["split_independence_rel"] < 1e-5
