"""Vocab-parallel log-probs / entropy and their gradients at TP2 (2 gloo ranks) vs TP1 and float64."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import run_worker

WORKER = Path(__file__).with_name("logprobs_worker.py")


@pytest.mark.distributed
def test_tp2_logprobs_entropy_and_grads_match_tp1(tmp_path: Path) -> None:
    results = run_worker(WORKER, 2, tmp_path, timeout=300)
    for key, value in results.items():  # the worker checks 1e-6 + 1e-6 |ref| (float32), 1e-10 (float64)
        assert value < (1e-10 if "float64" in key else 2e-5), key
    # Every case compared every quantity, and float64 also against the float64 reference.
    assert sum(key.endswith("/vs_tp1/grad") for key in results) == 7
    assert sum("vs_float64_ref" in key for key in results) == 9
