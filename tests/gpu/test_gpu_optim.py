"""GPU tier: the actor's Adam runs as torch's fused kernel, computes AdamW, and resumes exactly; the
warm-up's reads of the gradients leave an fp16 loss scaler as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import run_worker


@pytest.mark.gpu
def test_fused_adam_matches_float64_adamw_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    results = run_worker(Path(__file__).with_name("optim_worker.py"), 1, tmp_path)
    print(results)
    assert results["fused"] and all(results["fused"]) and all(results["fused_after_load"])
    # fp32 main parameters against float64 after three steps of lr 1e-2: float32 rounding of the update.
    assert results["max_error_vs_float64"] < 1e-5
    assert results["steps"] == [3.0] and results["steps_on_device"] and results["steps_unshared"]
    assert results["resumed_equal"] and results["resumed_steps"] == [3.0] and results["resumed_steps_on_device"]
    # The warm-up's gradient reads left the fp16 loss scaler's scale and trackers as they were.
    before, after = results["fp16_scaler"]
    assert after == before
    assert results["fp16_scaler_after_prepare_grads"][1] == before[1] + 1  # what the warm-up undid
