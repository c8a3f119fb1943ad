"""Checkpoints on remote storage as a user meets them (CLI subprocesses, 2 ranks, moto's S3 server on
localhost with authentication, the credentials and endpoint only in the environment): a run killed
while uploading leaves the previous remote checkpoint in use; its output_dir deleted (a requeue onto
a node that does not see the first one's disk), the same command downloads it and finishes bit for
bit like a run never interrupted; a stop signal waits for the upload in flight; a missing bucket
stops the run at start-up, named."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from megatron_rlhf.debug.faults import SLOW_UPLOAD_ENV
from tests import s3_server
from tests.distributed.test_lifecycle import _deterministic, _kill_tree, _records, _result
from tests.distributed.test_sft_rm import _sft_rows, _write_jsonl
from tests.helpers import load_all_tensors
from tests.launch import command, run_cli, subprocess_env

pytest.importorskip("s3fs", reason="s3fs is in the test extra")


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3_server.S3Server]:
    with s3_server.start(tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server


def _sft(train: Path) -> tuple[str, ...]:
    return (
        "sft",
        "--config",
        "sft-tiny",
        "log_every=1",
        f"data.train=[{train}]",
        "model.tp=2",
        "max_steps=6",
        "save_every=2",
    )


@pytest.mark.distributed
def test_killed_mid_upload_then_resumed_from_s3_after_output_dir_is_deleted(
    tmp_path: Path, s3: s3_server.S3Server
) -> None:
    args = _sft(_write_jsonl(tmp_path / "train.jsonl", _sft_rows(128, 0)))
    straight = tmp_path / "straight"
    run_cli(*args, f"output_dir={straight}", nproc=2)

    out, prefix = tmp_path / "run", f"{s3_server.BUCKET}/{tmp_path.name}/run"
    url = f"s3://{prefix}"
    fs = s3.filesystem()
    log = (tmp_path / "killed.log").open("w")
    proc = subprocess.Popen(
        command(2, *args, f"output_dir={out}", f"remote_dir={url}"),
        env=subprocess_env(**s3.env(), **{SLOW_UPLOAD_ENV: "4:600"}),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 600
    while not fs.exists(f"{prefix}/step_4.tmp") and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
        fs.invalidate_cache()
    _kill_tree(proc.pid, signal.SIGKILL)
    proc.wait()
    fs.invalidate_cache()
    assert fs.exists(f"{prefix}/step_4.tmp"), (tmp_path / "killed.log").read_text()[-5000:]
    assert fs.cat_file(f"{prefix}/latest") == b"step_2\n"

    shutil.rmtree(out)  # the requeued job's node does not see the first one's disk
    again = run_cli(*args, f"output_dir={out}", f"remote_dir={url}/", nproc=2, env=s3.env())  # trailing slash
    assert f"removed {url}/step_4.tmp: an interrupted upload" in again.stdout
    assert f"downloaded {url}/step_2 to {out / 'checkpoints' / 'step_2'}" in again.stdout
    assert f"resumed from {out / 'checkpoints' / 'step_2'} at step 2" in again.stdout
    assert "uploaded step_6 to " in again.stdout

    # Bit for bit: every step's figures (before: the steps up to the checkpoint were missing, as
    # metrics.jsonl went with the output_dir; the checkpoint now carries it), the weights, the result.
    assert [_deterministic(r) for r in _records(out)] == [_deterministic(r) for r in _records(straight)]
    a, b = load_all_tensors(straight / "hf"), load_all_tensors(out / "hf")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    assert _result(out) == _result(straight)

    # keep_last=2 remotely, latest written last, no leftovers.
    fs.invalidate_cache()
    assert sorted(path.rsplit("/", 1)[-1] for path in fs.ls(prefix, detail=False)) == ["latest", "step_4", "step_6"]
    assert fs.cat_file(f"{prefix}/latest") == b"step_6\n"
    assert json.loads(fs.cat_file(f"{prefix}/step_6/run_state.json"))["step"] == 6

    # A changed shard in the newest local checkpoint (found as it loads): the remote copy replaces it.
    # Before: the run fell back to step_4, and its remote side deleted step_6, the one good copy.
    shard = next((out / "checkpoints" / "step_6").rglob("*.distcp"))
    shard.write_bytes(b"changed")
    longer = run_cli(*args, "max_steps=7", f"output_dir={out}", f"remote_dir={url}", nproc=2, env=s3.env())
    assert f"downloaded {url}/step_6 to {out / 'checkpoints' / 'step_6'}" in longer.stdout
    assert f"resumed from {out / 'checkpoints' / 'step_6'} at step 6" in longer.stdout


@pytest.mark.distributed
def test_a_missing_bucket_stops_the_run_at_start_up(tmp_path: Path, s3: s3_server.S3Server) -> None:
    args = _sft(_write_jsonl(tmp_path / "train.jsonl", _sft_rows(16, 0)))[:-3]
    proc = run_cli(
        *args, f"output_dir={tmp_path / 'run'}", "remote_dir=s3://no-such-bucket/run", exit_code=2, env=s3.env()
    )
    assert "remote_dir='s3://no-such-bucket/run' cannot be used: the bucket does not exist" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.distributed
def test_a_stop_signal_waits_for_the_upload_in_flight_and_uploads_its_checkpoint(
    tmp_path: Path, s3: s3_server.S3Server
) -> None:
    """SIGTERM while step 2's upload is in flight (slowed by the test hook): the next save waits for
    it, and the stop's checkpoint is uploaded before the process exits 0; the remote then holds the
    same checkpoints as output_dir (keep_last=2 on both)."""
    train = _write_jsonl(tmp_path / "train.jsonl", _sft_rows(128, 0))
    out, prefix = tmp_path / "run", f"{s3_server.BUCKET}/{tmp_path.name}/run"
    args = ("sft", "--config", "sft-tiny", "log_every=1", f"data.train=[{train}]", "max_steps=40", "save_every=2")
    fs = s3.filesystem()
    proc = subprocess.Popen(
        command(1, *args, f"output_dir={out}", f"remote_dir=s3://{prefix}"),
        env=subprocess_env(**s3.env(), **{SLOW_UPLOAD_ENV: "2:10"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not fs.exists(f"{prefix}/step_2.tmp") and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
        fs.invalidate_cache()
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-6000:]
    latest = (out / "checkpoints" / "latest").read_text()
    step = int(latest.strip().removeprefix("step_"))
    assert 2 < step < 40 and "SIGTERM received" in stdout
    assert stdout.index("uploaded step_2 to") < stdout.index(f"step {step}: saved checkpoint")
    assert f"uploaded step_{step} to s3://{prefix}/step_{step}" in stdout
    fs.invalidate_cache()
    assert fs.cat_file(f"{prefix}/latest").decode() == latest
    local = sorted(path.name for path in (out / "checkpoints").iterdir())
    assert sorted(path.rsplit("/", 1)[-1] for path in fs.ls(prefix, detail=False)) == local  # keep_last=2 both
