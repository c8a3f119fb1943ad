"""Checkpoint faults as a user meets them (CPU, CLI subprocesses): a run whose every update so far
was skipped still saves, and the run resumed from that checkpoint continues bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rlhf.debug.faults import NAN_GRADIENTS_ENV
from tests.distributed.test_lifecycle import _deterministic, _records
from tests.distributed.test_sft_rm import _sft_rows, _write_jsonl
from tests.helpers import load_all_tensors
from tests.launch import run_cli


@pytest.mark.distributed
def test_a_save_before_any_update_resumes_exactly(tmp_path: Path) -> None:
    """NaN gradients in steps 1-2 (fewer than max_bad_steps): the run ends after step 2 with no
    update made, and its final checkpoint holds empty Adam state (megatron asserted on it, leaving
    step_2.tmp). Started again for 4 steps it resumes at step 2 and ends like an uninterrupted
    4-step run with the same skipped steps."""
    train = _write_jsonl(tmp_path / "train.jsonl", _sft_rows(64, 0))
    args = ("sft", "--config", "sft-tiny", f"data.train=[{train}]", "log_every=1", "save_every=1")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_cli(*args, "max_steps=2", f"output_dir={resumed}", env={NAN_GRADIENTS_ENV: "0:0:2"})
    assert (resumed / "checkpoints" / "latest").read_text().strip() == "step_2"
    # Without the hook: the resumed model has made no update either, and would get the NaNs again.
    again = run_cli(*args, "max_steps=4", f"output_dir={resumed}")
    assert f"resumed from {resumed / 'checkpoints' / 'step_2'} at step 2" in again.stdout
    run_cli(*args, "max_steps=4", f"output_dir={straight}", env={NAN_GRADIENTS_ENV: "0:0:2"})
    records = [_deterministic(r) for r in _records(resumed)]
    assert [r["update_skipped"] for r in records if r["split"] == "train"] == [1.0, 1.0, 0.0, 0.0]
    assert records == [_deterministic(r) for r in _records(straight)]
    a, b = load_all_tensors(straight / "hf"), load_all_tensors(resumed / "hf")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
