"""The hybrid engine: TP2 training -> TP1 x DP2 generation, equal to an independently built model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_torchrun

WORKER = Path(__file__).with_name("hybrid_worker.py")


@pytest.mark.distributed
def test_hybrid_generation_follows_training(tmp_path: Path) -> None:
    proc = run_torchrun(WORKER, 2, str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["round0_mismatches"] == 0 and results["round1_mismatches"] == 0
    assert results["tokens_changed_by_step"]
    assert results["round1_phases"][1] == "generation weights (reshard)"
    assert results["round0_copy_bytes_after"] == 0 and results["round1_copy_bytes_after"] == 0
