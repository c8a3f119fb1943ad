"""LoRA at TP2 and PP2 equals LoRA at TP1: logits, loss, adapter gradients (gathered), merged weights,
and checkpoints saved in each layout loaded at TP1 (2 gloo ranks; the float64 parity with PEFT is in
tests/unit/test_lora.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import run_worker

WORKER = Path(__file__).with_name("lora_worker.py")


@pytest.mark.distributed
def test_lora_tp2_and_pp2_equal_tp1(tmp_path: Path) -> None:
    results = run_worker(WORKER, 2, tmp_path, timeout=600)
    for layout in ("tp2pp1", "tp1pp2"):
        assert results[f"{layout}/logits"] < 1e-5
        assert results[f"{layout}/loss"] < 1e-5
        assert results[f"{layout}/grad_norm_rel"] < 1e-5
        assert results[f"{layout}/grads_rel"] < 1e-5
    for layout in ("tp1pp1", "tp2pp1", "tp1pp2"):
        assert results[f"{layout}/merged_vs_adapters"] < 1e-4
        assert results[f"{layout}/checkpoint_to_tp1_exact"] == 1.0
        assert results[f"{layout}/initial_equals_tp1"] == 1.0
        assert results[f"{layout}/planned_trained_params_exact"] == 1.0
