"""A run's output_dir as a user meets it (CPU mode, CLI subprocesses): a resumed run follows the
config it is given (a new learning rate at once, changed settings reported, an architecture change
refused before anything is built), two runs on one output_dir (the second refused), a run that
failed at step 1 corrected in place, and a failed HF export redone from the final checkpoint."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from megatron_rlhf.checkpoint.run_checkpoint import is_complete
from megatron_rlhf.trainer.run_lock import LOCK_FILE
from tests.distributed.test_lifecycle import _records
from tests.distributed.test_sft_rm import _sft_rows, _write_jsonl
from tests.launch import command, run_cli, run_cli_here, subprocess_env

PPO = (
    "ppo",
    "--config",
    "ppo-tiny",
    "prompts_per_step=4",
    "mini_batch_size=8",
    "rollout.sampling.max_new_tokens=8",
    "log_every=1",
)
SFT = ("sft", "--config", "sft-tiny", "optim.warmup_steps=0", "optim.decay_style=constant", "log_every=1")
TRAINERS = {
    # args, the model's key, the lr key and its metric, a sampling-like change and how it is reported
    "ppo": (PPO, "actor.path", "actor_optim.lr", "actor/lr", "rollout.sampling.n=8", "rollout.sampling.n: 4 -> 8"),
    "sft": (SFT, "model.path", "optim.lr", "lr", "log_every=2", "log_every: 1 -> 2"),
}


@pytest.fixture(scope="module")
def sft_train(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", _sft_rows(64, 0))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, sft_train: Path) -> dict[str, tuple[tuple[str, ...], Path]]:
    """One finished 2-step run per trainer (checkpoint step_2, hf/), copied by each test that resumes it."""
    runs = {}
    for name, (args, *_) in TRAINERS.items():
        args = (*args, f"data.train=[{sft_train}]") if name == "sft" else args
        out = tmp_path_factory.mktemp(name) / "run"
        run_cli(*args, "max_steps=2", f"output_dir={out}")
        runs[name] = (args, out)
    return runs


def _copy(saved_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_new_learning_rate_applies_at_the_first_resumed_step_and_changes_are_reported(
    tmp_path: Path, saved: dict, trainer: str
) -> None:
    """Before: megatron's KeyError (its param groups are keyed by their lr), and no word of the
    other changes."""
    args, saved_run = saved[trainer]
    _, _, lr_key, lr_metric, change, reported = TRAINERS[trainer]
    out = _copy(saved_run, tmp_path)
    old_lr = _records(out)[-1][lr_metric]
    proc = run_cli(*args, "max_steps=3", f"{lr_key}={old_lr * 2}", change, f"output_dir={out}")
    assert f"resumed from {out / 'checkpoints' / 'step_2'} at step 2" in proc.stdout
    assert f"{lr_key}: {old_lr!r} -> {old_lr * 2!r}" in proc.stdout and reported in proc.stdout, proc.stdout[-3000:]
    (resumed,) = [r for r in _records(out) if r["split"] == "train" and r["step"] == 3]
    assert resumed[lr_metric] == pytest.approx(old_lr * 2, rel=1e-12)


@pytest.mark.distributed
@pytest.mark.parametrize("trainer", TRAINERS)
def test_another_architecture_is_refused_before_anything_is_built(tmp_path: Path, saved: dict, trainer: str) -> None:
    """With half the layers the model is refused, naming the difference and the ways out, before
    set-up; the saved run's own export, moved elsewhere, resumes (same architecture; the path change
    is reported; sft only, to keep the test short)."""
    args, saved_run = saved[trainer]
    model_key = TRAINERS[trainer][1]
    out = _copy(saved_run, tmp_path)
    smaller = shutil.copytree(out / "hf", tmp_path / "smaller")
    config = json.loads((smaller / "config.json").read_text())
    (smaller / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] // 2}))
    refused = run_cli_here(*args, "max_steps=3", f"{model_key}={smaller}", f"output_dir={out}", exit_code=2)
    assert f"num_layers {config['num_hidden_layers']} -> {config['num_hidden_layers'] // 2}" in refused.stderr
    assert (
        "resume=never, or another output_dir" in refused.stderr and "build+load" not in refused.stdout + refused.stderr
    )
    assert max(r["step"] for r in _records(out)) == 2 and not (out / LOCK_FILE).exists()
    if trainer == "ppo":
        return
    moved = shutil.copytree(out / "hf", tmp_path / "moved")
    accepted = run_cli(*args, "max_steps=3", f"{model_key}={moved}", f"output_dir={out}")
    assert f"-> '{moved}' (compared by architecture and tokenizer" in accepted.stdout


@pytest.mark.distributed
def test_a_run_resumed_past_its_length_is_refused_and_a_finished_one_says_so(tmp_path: Path, saved: dict) -> None:
    """Before: max_steps=1 on a run at step 2 saved the step-2 weights as checkpoints/step_1, pruned
    it at once and left ``latest`` naming it; the same command again said only that it resumed."""
    args, saved_run = saved["sft"]
    out = _copy(saved_run, tmp_path)
    refused = run_cli_here(*args, "max_steps=1", f"output_dir={out}", exit_code=2)
    assert "max_steps=1, but the checkpoint resumed is at step 2, past the run's end" in refused.stderr
    assert "max_steps=2 or more to continue it" in refused.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_2"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_2" and not (out / LOCK_FILE).exists()
    finished = run_cli_here(*args, "max_steps=2", f"output_dir={out}")
    assert "the run is complete (max_steps=2, resumed at step 2): no step to train" in finished.stdout
    assert max(r["step"] for r in _records(out)) == 2


@pytest.mark.distributed
def test_a_checkpoint_of_another_trainer_or_of_changed_data_is_refused(
    tmp_path: Path, saved: dict, sft_train: Path
) -> None:
    """Before: ppo on an sft run's output_dir resumed its checkpoint as the actor's and exited 0;
    a training file cut after a checkpoint resumed with another data order, unreported."""
    out = _copy(saved["sft"][1], tmp_path)
    refused = run_cli_here(*PPO, "max_steps=3", f"output_dir={out}", exit_code=2)
    assert "the checkpoint was written by 'sft', this run is 'ppo'" in refused.stderr
    assert "build+load" not in refused.stdout
    data = tmp_path / "train.jsonl"
    shutil.copy(sft_train, data)
    own = [*SFT, f"data.train=[{data}]", f"output_dir={tmp_path / 'own'}"]
    run_cli_here(*own, "max_steps=1")
    data.write_text("".join(data.read_text().splitlines(keepends=True)[:48]))
    refused = run_cli_here(*own, "max_steps=2", exit_code=2)
    assert "the training data now has 48 examples, the checkpoint's run had 64" in refused.stderr


@pytest.mark.distributed
def test_an_incomplete_checkpoint_is_named_not_called_no_checkpoint(tmp_path: Path, saved: dict) -> None:
    """Before: "no checkpoint to resume from: set overwrite=true", advice that writes over it; and
    with resume=never, complete checkpoints were called incomplete."""
    args, saved_run = saved["sft"]
    out = _copy(saved_run, tmp_path)
    (out / "checkpoints" / "step_2" / "run_state.json").unlink()
    refused = run_cli_here(*args, "max_steps=3", f"output_dir={out}", exit_code=2)
    assert "checkpoints that are incomplete (checkpoints/step_2: no run_state.json)" in refused.stderr
    assert "move them aside first" in refused.stderr
    # resume=never beside complete checkpoints: before, they too were called incomplete.
    out = _copy(saved_run, tmp_path / "never")
    refused = run_cli_here(*args, "max_steps=3", "resume=never", f"output_dir={out}", exit_code=2)
    assert (
        "holds another run's checkpoints (checkpoints/step_2), which resume=never would replace: set resume=auto"
        in refused.stderr
    )


@pytest.mark.distributed
def test_too_little_data_for_one_step_is_refused_before_a_model_is_built(tmp_path: Path, sft_train: Path) -> None:
    refused = run_cli_here(*SFT, f"data.train=[{sft_train}]", "global_batch_size=128", f"output_dir={tmp_path / 'run'}",
                           exit_code=2)  # fmt: skip
    assert "data.train has 64 examples, fewer than one step's global_batch_size=128" in refused.stderr
    assert "Set global_batch_size to at most 64" in refused.stderr and "build+load" not in refused.stdout


@pytest.mark.distributed
def test_a_second_run_on_a_busy_output_dir_is_refused_and_the_first_is_unharmed(
    tmp_path: Path, sft_train: Path
) -> None:
    """Before: the second resumed from the first's checkpoint and both wrote metrics.jsonl. The
    first, stopped with SIGTERM once the second is refused, has every step once."""
    out = tmp_path / "run"
    args = (*SFT, f"data.train=[{sft_train}]", "save_every=4", f"output_dir={out}")
    log = tmp_path / "first.log"
    with log.open("w") as sink:  # a file, not a pipe: a pipe nobody reads fills and stops the run
        first = subprocess.Popen(
            command(1, *args, "max_steps=100000"), env=subprocess_env(), stdout=sink, stderr=subprocess.STDOUT
        )
    while not (out / "checkpoints" / "latest").is_file():
        assert first.poll() is None, log.read_text()[-6000:]
        time.sleep(0.02)
    try:
        second = run_cli(*args, "max_steps=8", exit_code=2)  # ends by itself where it is not refused
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=600)
    assert f"in use by another run: pid {first.pid}" in second.stderr and str(out / LOCK_FILE) in second.stderr
    assert first.returncode == 0, log.read_text()[-6000:]
    steps = [r["step"] for r in _records(out) if r["split"] == "train"]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 4
    assert not (out / LOCK_FILE).exists()


@pytest.mark.distributed
def test_a_run_that_failed_at_step_1_is_corrected_in_the_same_output_dir(tmp_path: Path) -> None:
    """A reward rule that raises: the run dies at step 1 after writing config.yaml. Before: the
    corrected command was refused ('holds another run's files') without overwrite=true."""
    out = tmp_path / "run"
    failed = run_cli(
        *PPO,
        "max_steps=2",
        "scoring.rules=[tests.distributed.failing_reward:fails]",
        f"output_dir={out}",
        exit_code=None,
    )
    assert "failing_reward.fails" in failed.stderr, failed.stderr[-6000:]
    assert (out / "config.yaml").is_file() and not (out / LOCK_FILE).exists()
    again = run_cli(*PPO, "max_steps=2", f"output_dir={out}")
    assert "replacing the files of an earlier run that completed no step (config.yaml" in again.stdout


@pytest.mark.distributed
def test_a_failed_export_leaves_the_final_checkpoint_and_the_command_that_redoes_it(
    tmp_path: Path, sft_train: Path
) -> None:
    """The export cannot write (where it stages hf/ is a file): it fails after the final checkpoint
    (before: the export came first and its failure lost the steps since the last save); the command
    it names writes an HF directory that transformers loads."""
    out = tmp_path / "run"
    out.mkdir()
    (out / ".hf.partial").write_text("not a directory\n")
    proc = run_cli(*SFT, f"data.train=[{sft_train}]", "max_steps=2", f"output_dir={out}", exit_code=2)
    ckpt = out / "checkpoints" / "step_2"
    assert is_complete(ckpt) and f"the checkpoint {ckpt} holds every step" in proc.stderr
    command = proc.stderr.split("redo the export with: megatron-rlhf ")[1].split(" (it writes")[0].split()
    assert command == ["convert", "mcore-to-hf", str(ckpt / "models" / "actor"), str(out / "hf")]
    run_cli(*command[:-1], str(tmp_path / "hf"))
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert (
        model.config.num_hidden_layers == json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"]
    )


@pytest.mark.distributed
def test_a_resume_follows_the_datas_content_not_its_file_name(tmp_path: Path) -> None:
    """Before: a file rewritten in place with as many rows resumed at another data position without a
    word, and the same data copied under another name (a node's own disk) was refused."""
    data = _write_jsonl(tmp_path / "train.jsonl", _sft_rows(64, 0))
    out = tmp_path / "run"
    run_cli_here(*SFT, f"data.train=[{data}]", "max_steps=1", f"output_dir={out}")
    copy = tmp_path / "local" / "train.jsonl"
    copy.parent.mkdir()
    shutil.copy(data, copy)
    moved = run_cli_here(*SFT, f"data.train=[{copy}]", "max_steps=2", f"output_dir={out}")
    assert "compared by the examples' content, not by file name" in moved.stdout
    _write_jsonl(data, _sft_rows(64, 1))
    refused = run_cli_here(*SFT, f"data.train=[{data}]", "max_steps=3", f"output_dir={out}", exit_code=2)
    assert "the training examples' content differs from the checkpoint's run's" in refused.stderr
