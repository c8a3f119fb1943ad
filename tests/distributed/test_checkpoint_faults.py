"""Checkpoint faults as a user meets them (CPU, CLI subprocesses): a run whose every update so far
was skipped still saves, and the run resumed from that checkpoint continues bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rlhf.training.train import TEST_NAN_ENV
from tests.distributed.test_lifecycle import _deterministic, _records, _run
from tests.distributed.test_sft_rm import _sft_rows, _write_jsonl
from tests.helpers import load_all_tensors


@pytest.mark.distributed
def test_a_save_before_any_update_resumes_exactly(tmp_path: Path) -> None:
    """NaN gradients in steps 1-2 (fewer than max_bad_steps): the run ends after step 2 with no
    update made, and its final checkpoint holds empty Adam state (megatron asserted on it, leaving
    step_2.tmp). Started again for 4 steps it resumes at step 2 and ends like an uninterrupted
    4-step run with the same skipped steps."""
    train = _write_jsonl(tmp_path / "train.jsonl", _sft_rows(64, 0))
    args = ("sft", "--config", "sft-tiny", f"data.train=[{train}]", "log_every=1", "save_every=1")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    first = _run(1, (*args, "max_steps=2", f"output_dir={resumed}"), **{TEST_NAN_ENV: "0:0:2"})
    assert first.returncode == 0, first.stderr[-6000:]
    assert (resumed / "checkpoints" / "latest").read_text().strip() == "step_2"
    # Without the hook: the resumed model has made no update either, and would get the NaNs again.
    again = _run(1, (*args, "max_steps=4", f"output_dir={resumed}"))
    assert again.returncode == 0, again.stderr[-6000:]
    assert f"resumed from {resumed / 'checkpoints' / 'step_2'} at step 2" in again.stdout
    whole = _run(1, (*args, "max_steps=4", f"output_dir={straight}"), **{TEST_NAN_ENV: "0:0:2"})
    assert whole.returncode == 0, whole.stderr[-6000:]
    records = [_deterministic(r) for r in _records(resumed)]
    assert [r["update_skipped"] for r in records if r["split"] == "train"] == [1.0, 1.0, 0.0, 0.0]
    assert records == [_deterministic(r) for r in _records(straight)]
    a, b = load_all_tensors(straight / "hf"), load_all_tensors(resumed / "hf")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
