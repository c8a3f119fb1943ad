"""GPU tier: log-probs and PPO actor/critic updates on GPUs (nccl, fp32) equal a 1-GPU run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO
from tests.launch import DEVICE_ENV, run_worker


@pytest.mark.gpu
def test_engine_layouts_on_gpu(tmp_path: Path) -> None:
    worker = REPO / "tests" / "distributed" / "engine_worker.py"
    reference, compare = tmp_path / "reference", tmp_path / "compare"
    run_worker(worker, 1, reference, "reference", env={DEVICE_ENV: "cuda"})
    nproc = min(2, torch.cuda.device_count())
    results = run_worker(worker, nproc, compare, "compare", str(reference), env={DEVICE_ENV: "cuda"})
    print(json.dumps(results, indent=1))
    assert all(v < 1e-5 for k, v in results.items() if k.endswith(("_max_abs_diff", "_max_rel_diff")))
