"""GPU tier: log-probs and PPO actor/critic updates on GPUs (nccl, fp32) equal a 1-GPU run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, run_torchrun


@pytest.mark.gpu
def test_engine_layouts_on_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRON_RLHF_TEST_DEVICE", "cuda")
    worker = REPO / "tests" / "distributed" / "engine_worker.py"
    reference, compare = tmp_path / "reference", tmp_path / "compare"
    reference.mkdir()
    compare.mkdir()
    proc = run_torchrun(worker, 1, str(reference), "reference")
    assert proc.returncode == 0, proc.stderr[-6000:]
    nproc = min(2, torch.cuda.device_count())
    proc = run_torchrun(worker, nproc, str(compare), "compare", str(reference))
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = json.loads((compare / "results.json").read_text())
    print(json.dumps(results, indent=1))
    assert all(v < 1e-5 for k, v in results.items() if k.endswith(("_max_abs_diff", "_max_rel_diff")))
