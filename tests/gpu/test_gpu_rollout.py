"""GPU tier: the native engine on a GPU (HF greedy parity, log-prob parity, fp32) and the hybrid
train -> generate -> train round trip (bf16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import REPO, run_torchrun


@pytest.mark.gpu
def test_engine_on_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRON_RLHF_TEST_DEVICE", "cuda")
    proc = run_torchrun(REPO / "tests" / "distributed" / "generate_worker.py", 1, str(tmp_path), "1")
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = json.loads((tmp_path / "results.json").read_text())
    print(json.dumps(results, indent=1))
    assert all(v == 0 for k, v in results.items() if k.endswith("greedy_mismatches"))


@pytest.mark.gpu
def test_hybrid_round_trip_is_bit_exact(tmp_path: Path) -> None:
    proc = run_torchrun(Path(__file__).with_name("hybrid_worker.py"), 1, str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = json.loads((tmp_path / "results.json").read_text())
    print(json.dumps(results, indent=1))
    assert results["tensors_different"] == 0
