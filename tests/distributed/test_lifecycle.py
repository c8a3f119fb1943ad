"""Run lifecycle as a user meets it (CPU mode, CLI subprocesses): a run killed with SIGKILL and
started again with the same command continues from its newest checkpoint, and ends with the
metrics and the exported weights of a run that was never interrupted, bit for bit."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import megatron_rlhf
from megatron_rlhf.debug.faults import NAN_GRADIENTS_ENV, SLOW_SAVE_ENV
from tests.distributed.test_sft_rm import _preference_rows, _sft_rows, _write_jsonl
from tests.helpers import load_all_tensors
from tests.launch import REPO, command, run_cli, run_cli_here, subprocess_env


def _run_killed_after_first_checkpoint(nproc: int, args: tuple[str, ...], out: Path) -> None:
    """Start the run; SIGKILL it and every process under it (torchrun starts its workers in their
    own sessions) as soon as a checkpoint is complete (``checkpoints/latest`` exists)."""
    proc = subprocess.Popen(
        command(nproc, *args), env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    latest = out / "checkpoints" / "latest"
    deadline = time.monotonic() + 600
    while not latest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    _kill_tree(proc.pid, signal.SIGKILL)
    proc.wait()
    assert latest.exists(), "the run ended before its first checkpoint"


def _kill_tree(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to ``pid`` and all its descendants (found before any of them dies)."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        parent = psutil.Process(pid)
        for process in [*parent.children(recursive=True), parent]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(sig)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _deterministic(record: dict) -> dict:
    """A metrics line without wall-clock figures."""
    return {
        key: value for key, value in record.items() if not key.startswith(("timing_s/", "perf/")) and "per_s" not in key
    }


def _straight_run(nproc: int, args: tuple[str, ...], straight: Path) -> Path:
    """An uninterrupted run of ``args`` into ``straight``: the reference of resumed runs."""
    run_cli(*args, f"output_dir={straight}", nproc=nproc)
    return straight


def _check_resume_matches(
    nproc: int,
    args: tuple[str, ...],
    root: Path,
    total: int,
    resumed_args: tuple[str, ...] = (),
    straight: Path | None = None,
) -> subprocess.CompletedProcess:
    """An uninterrupted run of ``args`` (or ``straight``, made by ``_straight_run`` already) is the
    reference for one killed after its first checkpoint and started again with ``resumed_args``
    added; returns the second start's process."""
    resumed = root / "resumed"
    straight = straight or _straight_run(nproc, args, root / "straight")
    _run_killed_after_first_checkpoint(nproc, (*args, *resumed_args, f"output_dir={resumed}"), resumed)
    again = run_cli(*args, *resumed_args, f"output_dir={resumed}", nproc=nproc)
    step = int(again.stdout.split("resumed from ")[1].split(" at step ")[1].split()[0])
    assert 0 < step < total, again.stdout[-3000:]
    records = _records(resumed)
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(1, total + 1))
    expected = [_deterministic(r) for r in _records(straight)]
    assert [_deterministic(r) for r in records] == expected
    a, b = load_all_tensors(straight / "hf"), load_all_tensors(resumed / "hf")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    assert _result(resumed) == _result(straight)
    return again


def _result(out: Path) -> dict:
    """result.json without its wall-clock time and its own path."""
    result = json.loads((out / "result.json").read_text())
    return {key: value for key, value in result.items() if key not in ("train_seconds", "hf_dir")}


PPO_ARGS = (
    "ppo",
    "--config",
    "ppo-tiny",
    "max_steps=6",
    "save_every=2",
    "prompts_per_step=4",
    "mini_batch_size=8",
    "algorithm.advantage_estimator=gae",
    "scoring.use_reward_model=true",
    "algorithm.kl_penalty.type=adaptive",
    "algorithm.kl_penalty.coef=0.05",
    "algorithm.kl_penalty.horizon=10",
    "algorithm.loss.kl_loss_coef=0",
    "reference.update=ema",
    "reference.ema_decay=0.5",
    "rollout.sampling.max_new_tokens=12",
)


PPO_TWO_RANKS = (*PPO_ARGS, "actor.tp=2", "reference.tp=2", "reward.tp=2", "critic.pp=2", "rollout.tp=2")


@pytest.fixture(scope="module")
def ppo_two_ranks_straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted, synchronously saved 2-rank PPO run both PPO resume tests compare with."""
    return _straight_run(2, PPO_TWO_RANKS, tmp_path_factory.mktemp("ppo") / "straight")


@pytest.mark.distributed
def test_ppo_with_critic_resumes_exactly_over_two_ranks(tmp_path: Path, ppo_two_ranks_straight: Path) -> None:
    """PPO with a critic (GAE, PP2), a reward model, an adaptive KL penalty and an EMA reference,
    actor TP2: the KL coefficient, the reference and both optimizers come back exactly."""
    _check_resume_matches(2, PPO_TWO_RANKS, tmp_path, 6, straight=ppo_two_ranks_straight)


@pytest.mark.distributed
def test_ppo_saved_in_the_background_resumes_like_a_synchronous_run(
    tmp_path: Path, ppo_two_ranks_straight: Path
) -> None:
    """As above, the interrupted run saving with async_save=true (actor TP2 and critic PP2 written
    by one background process per checkpoint), the uninterrupted one synchronously: same metrics,
    weights and result."""
    again = _check_resume_matches(
        2, PPO_TWO_RANKS, tmp_path, 6, resumed_args=("async_save=true",), straight=ppo_two_ranks_straight
    )
    assert "step 6: saved checkpoint" in again.stdout and "written in the background" in again.stdout


GRPO = (
    "ppo",
    "--config",
    "ppo-tiny",
    "max_steps=8",
    "save_every=2",
    "prompts_per_step=4",
    "mini_batch_size=8",
    "rollout.sampling.max_new_tokens=12",
)


@pytest.fixture(scope="module")
def grpo_straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted GRPO run that the killed and the stopped runs end like."""
    return _straight_run(1, GRPO, tmp_path_factory.mktemp("grpo") / "straight")


@pytest.mark.distributed
def test_grpo_resumes_exactly(tmp_path: Path, grpo_straight: Path) -> None:
    _check_resume_matches(1, GRPO, tmp_path, 8, straight=grpo_straight)


@pytest.mark.distributed
def test_sft_resumes_exactly(tmp_path: Path) -> None:
    train = _write_jsonl(tmp_path / "train.jsonl", _sft_rows(128, 0))
    val = _write_jsonl(tmp_path / "val.jsonl", _sft_rows(16, 1))
    _check_resume_matches(
        1,
        (
            "sft",
            "--config",
            "sft-tiny",
            f"data.train=[{train}]",
            f"data.validation=[{val}]",
            "max_steps=12",
            "save_every=2",
            "eval_every=4",
            "keep_last=1",
        ),
        tmp_path,
        12,
    )
    assert [p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir()] in (
        ["latest", "step_12"],
        ["step_12", "latest"],
    )


@pytest.mark.distributed
def test_rm_resumes_exactly(tmp_path: Path) -> None:
    train = _write_jsonl(tmp_path / "train.jsonl", _preference_rows(128, 2))
    _check_resume_matches(
        1,
        (
            "rm",
            "--config",
            "rm-tiny",
            f"data.train=[{train}]",
            "global_batch_size=16",
            "optim.lr=1e-3",
            "max_steps=12",
            "save_every=2",
        ),
        tmp_path,
        12,
    )


@pytest.mark.distributed
@pytest.mark.parametrize("saved_layout", ["model.tp=2", "model.pp=2"])
def test_checkpoint_resumes_in_another_layout(tmp_path: Path, saved_layout: str) -> None:
    """A checkpoint saved by 2 ranks at TP2 (or PP2) continues in one process at TP1xPP1, in another
    output_dir, with the uninterrupted run's per-step losses (to 1e-5: only the summation order
    changes); its metrics.jsonl starts with the history the checkpoint carries."""
    train = _write_jsonl(tmp_path / "train.jsonl", _sft_rows(128, 0))
    args = ("sft", "--config", "sft-tiny", f"data.train=[{train}]", "max_steps=6", "save_every=3")
    run_cli(*args, saved_layout, f"output_dir={tmp_path / 'sharded'}", nproc=2)
    checkpoint = tmp_path / "sharded" / "checkpoints" / "step_3"
    single = run_cli(*args, f"resume={checkpoint}/", f"output_dir={tmp_path / 'single'}/")  # trailing slashes
    assert f"resumed from {checkpoint} at step 3" in single.stdout
    expected = {r["step"]: r["loss"] for r in _records(tmp_path / "sharded")}
    got = {r["step"]: r["loss"] for r in _records(tmp_path / "single")}
    assert got.keys() == expected.keys() == {1, 2, 3, 4, 5, 6}  # steps 1-3: the checkpoint's history
    for step, loss in expected.items():
        assert got[step] == (loss if step <= 3 else pytest.approx(loss, abs=1e-5)), step


@pytest.mark.distributed
def test_sigterm_saves_exits_0_and_the_rerun_finishes_the_same(tmp_path: Path, grpo_straight: Path) -> None:
    """SIGTERM mid-run: a checkpoint at the next step boundary, exit 0 (no export yet); the same
    command again continues from it and exports the uninterrupted run's weights."""
    straight, stopped = grpo_straight, tmp_path / "stopped"
    proc = subprocess.Popen(
        command(1, *GRPO, f"output_dir={stopped}"),
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = stopped / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 1) and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-6000:]
    assert "SIGTERM received" in out and not (stopped / "hf").exists()
    step = int((stopped / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert 1 <= step < 8
    again = run_cli(*GRPO, f"output_dir={stopped}")
    assert f"at step {step}" in again.stdout
    assert [_deterministic(r) for r in _records(stopped)] == [_deterministic(r) for r in _records(straight)]
    a, b = load_all_tensors(straight / "hf"), load_all_tensors(stopped / "hf")
    assert all(torch.equal(a[name], b[name]) for name in a)


def _strict_records(out: Path) -> list[dict]:
    """metrics.jsonl read as strict JSON (NaN/Infinity literals refused)."""

    def refuse(literal: str) -> None:
        raise ValueError(f"not JSON: {literal}")

    return [json.loads(line, parse_constant=refuse) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def sft_train(tmp_path: Path) -> Path:
    return _write_jsonl(tmp_path / "train.jsonl", _sft_rows(128, 0))


SFT = ("sft", "--config", "sft-tiny", "log_every=1")


@pytest.mark.distributed
@pytest.mark.parametrize("save_every", [0, 1])
def test_diverging_sft_stops_with_exit_3_and_exports_nothing(tmp_path: Path, sft_train: Path, save_every: int) -> None:
    """optim.lr=1e12: the loss turns NaN at step 3. Without a checkpoint the run stops at once; with
    one it rolls back, redoes steps 3-5 with another data order, diverges again and stops."""
    out = tmp_path / "run"
    proc = run_cli(
        *SFT,
        f"data.train=[{sft_train}]",
        "optim.lr=1e12",
        "max_steps=8",
        f"save_every={save_every}",
        f"output_dir={out}",
        exit_code=3,
    )
    assert "steps 3-5: 3 updates in a row skipped" in proc.stderr
    assert ("no checkpoint to roll back to" if save_every == 0 else "again after a rollback") in proc.stderr
    assert not (out / "hf").exists() and not (out / "result.json").exists()
    records = _strict_records(out)
    bad = [r for r in records if r["split"] == "train" and r["update_skipped"]]
    assert bad and all(r["loss"] is None and "loss" in r["nonfinite"] for r in bad)
    assert [r["to_step"] for r in records if r["split"] == "rollback"] == ([] if save_every == 0 else [2])


@pytest.mark.distributed
def test_nan_on_one_rank_skips_the_update_on_every_rank(tmp_path: Path, sft_train: Path) -> None:
    """NaN gradients on rank 1 only (data-parallel over 2 ranks), once: step 3's update is skipped
    on both ranks (the LR schedule waits too) and the run ends normally with finite weights."""
    out = tmp_path / "run"
    run_cli(
        *SFT,
        f"data.train=[{sft_train}]",
        "max_steps=5",
        f"output_dir={out}",
        nproc=2,
        env={NAN_GRADIENTS_ENV: "1:2:1"},
    )
    train = [r for r in _strict_records(out) if r["split"] == "train"]
    assert [r["update_skipped"] for r in train] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert train[2]["grad_norm"] is None and train[3]["lr"] == train[2]["lr"]
    assert all(torch.isfinite(t).all() for t in load_all_tensors(out / "hf").values())


@pytest.mark.distributed
def test_rollback_with_another_data_order_recovers(tmp_path: Path, sft_train: Path) -> None:
    """Three NaN updates in a row after a checkpoint at step 2: back to step 2, steps 3-5 again with
    other batches (the NaNs are spent), and the run completes."""
    out = tmp_path / "run"
    run_cli(
        *SFT,
        f"data.train=[{sft_train}]",
        "max_steps=6",
        "save_every=2",
        f"output_dir={out}",
        env={NAN_GRADIENTS_ENV: "0:2:3"},
    )
    records = _strict_records(out)
    assert [(r["split"], r["step"]) for r in records if r["split"] != "train" or r["step"] > 2] == [
        ("train", 3),
        ("train", 4),
        ("train", 5),
        ("rollback", 5),
        ("train", 3),
        ("train", 4),
        ("train", 5),
        ("train", 6),
    ]
    first, again = records[2], records[6]
    assert first["update_skipped"] == 1.0 and again["update_skipped"] == 0.0
    assert first["tokens"] != again["tokens"]  # another batch


@pytest.mark.distributed
def test_a_stopped_rank_ends_the_job_non_zero_within_a_minute(tmp_path: Path, sft_train: Path) -> None:
    """SIGSTOP one rank of a 2-rank run with dist_timeout_s=10: the other's next collective times
    out and the job ends non-zero, instead of hanging."""
    import psutil

    out = tmp_path / "run"
    log = (tmp_path / "log").open("w")
    proc = subprocess.Popen(
        command(2, *SFT, f"data.train=[{sft_train}]", "max_steps=100000", "dist_timeout_s=10", f"output_dir={out}"),
        env=subprocess_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    metrics = out / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 1) and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, (tmp_path / "log").read_text()[-5000:]
    (rank1,) = [p for p in psutil.Process(proc.pid).children() if p.environ().get("RANK") == "1"]
    rank1.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        returncode = proc.wait(timeout=90)
    finally:
        _kill_tree(proc.pid, signal.SIGKILL)
    assert returncode != 0
    assert time.monotonic() - stopped_at < 60
    assert "timed out" in (tmp_path / "log").read_text().lower()


@dataclass
class DamagedResume:
    """An SFT run, its checkpoints damaged, and the same command run again for more steps."""

    out: Path
    fresh: subprocess.CompletedProcess
    fresh_losses: dict[int, float]
    resumed: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def damaged_resume(tmp_path_factory: pytest.TempPathFactory) -> DamagedResume:
    """The newest checkpoint gets bytes that are not UTF-8 in its config.yaml, the one before a flipped
    byte in a shard, an interrupted save's step_8.tmp/ and latest.tmp (what a SIGKILL mid-save
    leaves), and a step_5 without run_state.json, before the run is started again."""
    root = tmp_path_factory.mktemp("damaged")
    out = root / "run"
    train = _write_jsonl(root / "train.jsonl", _sft_rows(128, 0))
    args = (*SFT, f"data.train=[{train}]", "save_every=2", "keep_last=3", f"output_dir={out}")
    fresh = run_cli(*args, "max_steps=6")
    losses = {r["step"]: r["loss"] for r in _records(out)}
    shard = out / "checkpoints" / "step_4" / "models" / "actor" / "dist" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    config = out / "checkpoints" / "step_6" / "config.yaml"
    config.write_bytes(b"\xff\xfe" + config.read_bytes())
    (out / "checkpoints" / "step_8.tmp" / "models").mkdir(parents=True)
    (out / "checkpoints" / "latest.tmp").write_text("step_8\n")
    shutil.copytree(out / "checkpoints" / "step_2", out / "checkpoints" / "step_5")  # then its run_state.json lost
    (out / "checkpoints" / "step_5" / "run_state.json").unlink()
    return DamagedResume(out, fresh, losses, run_cli(*args, "max_steps=8"))


@pytest.mark.distributed
def test_interrupted_save_and_changed_bytes_fall_back_to_the_previous_checkpoint(damaged_resume: DamagedResume) -> None:
    """The run names the changed files, resumes from the newest good checkpoint (comparing the config
    with that one's), deletes the leftovers of interrupted saves, moves the unusable ones aside, and
    redoes the steps with the same losses."""
    out, again, losses = damaged_resume.out, damaged_resume.resumed, damaged_resume.fresh_losses
    config = out / "checkpoints" / "step_6" / "config.yaml"
    assert f"step_6 is unusable: {config}: changed since the save" in again.stdout
    assert "step_4 is unusable" in again.stdout and "__0_0.distcp" in again.stdout
    assert f"resumed from {out / 'checkpoints' / 'step_2'} at step 2" in again.stdout
    assert f"removed {out / 'checkpoints' / 'step_8.tmp'}: an interrupted save" in again.stdout
    # Before: passed over without a word. It stays (it is not this run's to delete), named.
    assert f"{out / 'checkpoints' / 'step_5'} has no run_state.json: incomplete, so not resumed" in again.stdout
    # The unusable ones are moved aside, not deleted (before: deleted; the damage may pass, a file
    # system still syncing): kept for a look, neither resumed nor pruned.
    aside = out / "checkpoints" / "step_6.unusable"
    assert f"moved {out / 'checkpoints' / 'step_6'} aside to {aside}: not resumed, nor pruned" in again.stdout
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "latest",
        "step_4",
        "step_4.unusable",
        "step_5",
        "step_6",
        "step_6.unusable",
        "step_8",
    ]
    redone = {r["step"]: r["loss"] for r in _records(out)}
    assert list(redone) == list(range(1, 9)) and all(redone[step] == losses[step] for step in range(1, 7))


@pytest.mark.distributed
@pytest.mark.parametrize(("async_save", "killed_step"), [("false", 2), ("true", 4)])
def test_sigkill_mid_save_resumes_from_the_previous_checkpoint(
    tmp_path: Path, sft_train: Path, async_save: str, killed_step: int
) -> None:
    """2 ranks at TP2: the save of ``killed_step`` is slowed by the test hook (in the training
    process, or in the background writer while training goes on) and every process is SIGKILLed
    once its first shard file is written. The same command started again deletes the partial
    ``.tmp``, resumes from step_2, or starts over when the first save was the one killed (before:
    refused as "another run's files"), and finishes with every step logged once."""
    out = tmp_path / "run"
    args = (
        *SFT,
        f"data.train=[{sft_train}]",
        "model.tp=2",
        "max_steps=6",
        "save_every=2",
        f"async_save={async_save}",
        f"output_dir={out}",
    )
    log = (tmp_path / "killed.log").open("w")
    proc = subprocess.Popen(
        command(2, *args),
        env=subprocess_env(**{SLOW_SAVE_ENV: f"{killed_step}:600"}),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    partial = out / "checkpoints" / f"step_{killed_step}.tmp"
    deadline = time.monotonic() + 600
    while (
        not (partial.is_dir() and any(partial.rglob("*.distcp")))
        and proc.poll() is None
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    _kill_tree(proc.pid, signal.SIGKILL)
    proc.wait()
    assert any(partial.rglob("*.distcp")), (tmp_path / "killed.log").read_text()[-5000:]
    again = run_cli(*args, nproc=2)
    assert f"removed {partial}: an interrupted save" in again.stdout
    if killed_step == 2:
        assert (
            "an earlier attempt of this run (the same config.yaml) stopped before its first checkpoint" in again.stdout
        )
    else:
        assert f"resumed from {out / 'checkpoints' / 'step_2'} at step 2" in again.stdout
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_4", "step_6"]
    assert [r["step"] for r in _records(out) if r["split"] == "train"] == list(range(1, 7))


@pytest.mark.distributed
def test_start_up_report_names_versions_layouts_and_the_resumed_step(damaged_resume: DamagedResume) -> None:
    """The report a run starts with, fresh and resumed: this package's version and git commit, the
    interpreter and its environment, torch, CUDA, megatron-core, apex, Transformer Engine and
    FlashInfer (looked up here), torch's host threads, each checkpointed model's layout, and the
    checkpoint step a resumed run continues from."""
    out, fresh, resumed = damaged_resume.out, damaged_resume.fresh, damaged_resume.resumed
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    present = {
        name: "present" if importlib.util.find_spec(module) else "absent"
        for name, module in (
            ("apex", "apex"),
            ("transformer-engine", "transformer_engine"),
            ("flashinfer", "flashinfer"),
        )
    }
    package = f"megatron-rlhf {megatron_rlhf.__version__} (git {commit}), "
    interpreter = f"python {platform.python_version()} {sys.executable}, "  # the run's: tests launch with it
    versions = (
        f"; torch {torch.__version__}, "
        f"CUDA {torch.version.cuda or 'none'}, megatron-core {importlib.metadata.version('megatron-core')}, "
        f"apex {present['apex']}, transformer-engine {present['transformer-engine']}, "
        f"flashinfer {present['flashinfer']}"
    )
    threads = re.compile(
        re.escape(package + interpreter)
        + r"(venv|conda env|no venv) [^;]+"
        + re.escape(versions)
        + r"; \d+ host threads"
    )
    for proc in (fresh, resumed):
        assert any(threads.fullmatch(line) for line in proc.stdout.splitlines()), proc.stdout[-3000:]
        assert "layouts: actor TP1xPP1xDP1" in proc.stdout.splitlines()
    assert "starting fresh" in fresh.stdout and "resumed from" not in fresh.stdout
    assert f"resumed from {out / 'checkpoints' / 'step_2'} at step 2" in resumed.stdout.splitlines()
    assert "starting fresh" not in resumed.stdout


@pytest.mark.distributed
def test_output_dir_with_another_runs_files_is_refused_without_overwrite(tmp_path: Path, sft_train: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"split": "train", "step": 1}\n')
    args = (*SFT, f"data.train=[{sft_train}]", "max_steps=1", f"output_dir={out}")
    refused = run_cli_here(*args, exit_code=2)
    assert "holds another run's files (metrics.jsonl)" in refused.stderr
    assert "overwrite=true" in refused.stderr
    run_cli(*args, "overwrite=true")


def _endless_sft(launch: list[str], train: Path, out: Path) -> subprocess.Popen:
    """SFT started by ``launch`` (its command line up to the settings), running until stopped, in a
    process group of its own (as a terminal's foreground job or a container's processes are)."""
    args = [*launch, f"data.train=[{train}]", "max_steps=100000", f"output_dir={out}"]
    return subprocess.Popen(
        args, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _wait_for_a_step(proc: subprocess.Popen, out: Path) -> None:
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n")):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)


@pytest.mark.distributed
def test_a_stop_signal_during_start_up_stops_before_the_first_step(tmp_path: Path, sft_train: Path) -> None:
    """Before: SIGUSR1 (Slurm's warning ahead of a time limit) while the models loaded killed the
    process (exit 138; under launch/slurm, where it is ignored until training starts, it was lost)."""
    out = tmp_path / "run"
    proc = _endless_sft(command(1, *SFT), sft_train, out)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # the run's first line, written once its start-up has begun
        seen.append(line)
        if line.startswith("sft: world 1"):
            proc.send_signal(signal.SIGUSR1)
            break
    rest, err = proc.communicate(timeout=300)
    log = "".join(seen) + rest
    assert proc.returncode == 0, (log[-3000:], err[-3000:])
    assert "SIGUSR1 received" in log and "step 1/" not in log
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


@pytest.mark.distributed
def test_term_to_the_torchrun_launcher_saves_and_exits_0(tmp_path: Path, sft_train: Path) -> None:
    """SIGTERM to the launcher's whole process group (docker stop, a terminal's kill, Slurm), which
    torchrun is in. Before: torchrun passed it on, SIGKILLed its workers 30 s later (in a real run
    often mid-checkpoint) and exited 1 with a traceback."""
    out = tmp_path / "run"
    proc = _endless_sft([str(REPO / "launch" / "torchrun.sh"), "--nproc", "2", *SFT], sft_train, out)
    _wait_for_a_step(proc, out)
    os.killpg(proc.pid, signal.SIGTERM)
    log, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, (log[-3000:], err[-3000:])
    assert (out / "checkpoints" / "latest").is_file()
    assert "SIGTERM received" in log and "Traceback" not in err and "SignalException" not in err


@pytest.mark.distributed
def test_sigint_saves_and_exits_130_and_a_signal_delivered_twice_stops_once(tmp_path: Path, sft_train: Path) -> None:
    def started(out: Path) -> subprocess.Popen:
        proc = _endless_sft(command(1, *SFT), sft_train, out)
        _wait_for_a_step(proc, out)
        return proc

    once = started(tmp_path / "once")
    once.send_signal(signal.SIGINT)
    once.communicate(timeout=300)
    assert once.returncode == 130
    assert (tmp_path / "once" / "checkpoints" / "latest").is_file()

    # The same request delivered twice at once (Slurm and torchrun both signal a worker): one stop,
    # with its checkpoint. A second signal later exits at once: tests/unit/test_stop_signals.py.
    twice = started(tmp_path / "twice")
    twice.send_signal(signal.SIGUSR1)
    twice.send_signal(signal.SIGUSR1)
    out, _ = twice.communicate(timeout=300)
    assert twice.returncode == 0 and "again: exiting now" not in out
    assert (tmp_path / "twice" / "checkpoints" / "latest").is_file()


@pytest.mark.distributed
def test_a_fresh_run_leaves_nothing_of_the_run_it_replaces_and_an_export_replaces_the_last_whole(
    tmp_path: Path, sft_train: Path
) -> None:
    """overwrite=true over a LoRA run, without LoRA and without an export: the old hf/ and hf_adapter/
    stayed, and passed for the new run's model. A re-export wrote into hf/ beside what it held."""
    out = tmp_path / "run"
    args = (*SFT, f"data.train=[{sft_train}]", f"output_dir={out}", "max_steps=1")
    run_cli_here(*args, "model.lora.rank=4")
    assert (out / "hf" / "config.json").is_file() and (out / "hf_adapter" / "adapter_config.json").is_file()
    (out / "hf" / "model-stale.safetensors").write_bytes(b"")
    run_cli_here(*args, "model.lora.rank=4", "max_steps=2")  # resumes step 1, exports again
    assert not (out / "hf" / "model-stale.safetensors").exists() and (out / "hf_adapter").is_dir()
    assert not list(tmp_path.glob("run/.*")), "no staging directory is left"
    fresh = run_cli_here(*args, "overwrite=true", "resume=never", "save_hf=false")
    for name in ("hf", "hf_adapter", "result.json"):
        assert f"removed {out / name}: another run's (overwrite=true)" in fresh.stdout
    assert not (out / "hf").exists() and not (out / "hf_adapter").exists()
    assert json.loads((out / "result.json").read_text())["steps"] == 1 and "hf_dir" not in json.loads(
        (out / "result.json").read_text()
    )
