"""GPU tier: bf16 parity with HF transformers on the GPU(s) of this machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.launch import run_worker

WORKER = Path(__file__).with_name("gpu_parity_worker.py")


@pytest.mark.gpu
def test_bf16_parity_with_hf(tmp_path: Path) -> None:
    nproc = min(2, torch.cuda.device_count())
    results = run_worker(WORKER, nproc, tmp_path)
    print(json.dumps(results, indent=1))
    assert any(key.endswith("tp1pp1/bf16_max_abs_err") for key in results)
    if nproc == 2:
        assert any(key.endswith("tp2pp1/bf16_max_abs_err") for key in results)
