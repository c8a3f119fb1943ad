"""GPU tier: the native engine on a GPU (HF greedy parity, log-prob parity, fp32) and the hybrid
train -> generate -> train round trip (bf16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.launch import DEVICE_ENV, run_worker


@pytest.mark.gpu
def test_engine_on_gpu(tmp_path: Path) -> None:
    worker = REPO / "tests" / "distributed" / "generate_worker.py"
    results = run_worker(worker, 1, tmp_path, "1", env={DEVICE_ENV: "cuda"})
    print(json.dumps(results, indent=1))
    assert all(v == 0 for k, v in results.items() if k.endswith("greedy_mismatches"))


@pytest.mark.gpu
def test_hybrid_round_trip_is_bit_exact(tmp_path: Path) -> None:
    results = run_worker(Path(__file__).with_name("hybrid_worker.py"), 1, tmp_path)
    print(json.dumps(results, indent=1))
    assert results["tensors_different"] == 0
