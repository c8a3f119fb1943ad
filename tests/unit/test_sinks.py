"""The metric sinks a run's ``loggers`` setting names: each destination, the checks of the setting,
and the same key in every destination."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from megatron_rlhf.config.loader import ConfigError, config_errors, load_config
from megatron_rlhf.metrics.sinks import SinkSetup, WandbConfig, build_sinks
from megatron_rlhf.trainer.ppo_config import PPOConfig, check_ppo_config


def _setup(out_dir: Path, total_steps: int = 3, log_every: int = 2) -> SinkSetup:
    return SinkSetup(
        out_dir=out_dir,
        total_steps=total_steps,
        log_every=log_every,
        progress=lambda m: f"loss {m['actor/loss']:.2f}",
        wandb=WandbConfig(),
        config={},
    )


def test_each_logger_writes_its_destination_with_the_same_keys(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = build_sinks(["console", "jsonl", "tensorboard"], _setup(tmp_path))
    for step in (1, 2, 3):
        sinks.write("train", step, {"actor/loss": step / 10, "timing_s/gen": 0.5})
    sinks.write_rows("samples", [{"step": 3, "response": "hi"}])
    sinks.write("validation", 3, {"accuracy": 0.75, "pairs": 8})
    sinks.close()

    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | eta")[0] for line in lines] == [
        "step 1/3 | loss 0.10",
        "step 2/3 | loss 0.20",
        "step 3/3 | loss 0.30",
        "validation at step 3: accuracy 0.7500 | pairs 8",
    ]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"split": "train", "step": 1, "actor/loss": 0.1, "timing_s/gen": 0.5}
    assert rows[-1] == {"split": "validation", "step": 3, "accuracy": 0.75, "pairs": 8}
    assert json.loads((tmp_path / "samples.jsonl").read_text()) == {"step": 3, "response": "hi"}
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"actor/loss", "timing_s/gen", "val/accuracy", "val/pairs"}
    assert [e.value for e in events.Scalars("actor/loss")] == pytest.approx([0.1, 0.2, 0.3])


def test_a_fresh_run_replaces_an_earlier_attempts_tensorboard_events(tmp_path: Path) -> None:
    """Before: an attempt killed before its first checkpoint, started over in the same output_dir,
    left its events beside the new ones: TensorBoard drew each step twice."""
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for run, steps in ((1.0, (1, 2, 3)), (2.0, (1, 2))):
        sinks = build_sinks(["tensorboard"], _setup(tmp_path))
        for step in steps:
            sinks.write("train", step, {"actor/loss": run + step / 10})
        sinks.close()
        time.sleep(1.1)  # event files are named by the second they were opened
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = events.Scalars("actor/loss")
    assert [e.step for e in scalars] == [1, 2] and [e.value for e in scalars] == pytest.approx([2.1, 2.2])


def test_only_the_named_loggers_write(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    sinks = build_sinks(["jsonl"], _setup(tmp_path))
    sinks.write("train", 1, {"actor/loss": 0.1})
    sinks.close()
    assert capsys.readouterr().out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def _errors(*overrides: str) -> list[str]:
    return config_errors(load_config("ppo-tiny", list(overrides), schema=PPOConfig))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "loggers=[console,mlflow]",
            "loggers=['console', 'mlflow']: unknown logger 'mlflow'; choose from ['console', "
            "'jsonl', 'tensorboard', 'wandb']",
        ),
        ("loggers=[jsonl,jsonl]", "loggers=['jsonl', 'jsonl']: 'jsonl' is listed twice"),
    ],
)
def test_logger_settings_are_checked(override: str, message: str) -> None:
    assert message in _errors(override)


def test_an_unknown_wandb_mode_is_refused_when_loaded() -> None:
    with pytest.raises(ConfigError, match=re.escape("wandb.mode='onlin' must be one of ['', 'online', 'offline',")):
        _errors("wandb.mode=onlin")


def test_wandb_without_its_package_is_refused_before_anything_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    message = (
        "loggers=['console', 'wandb'] lists wandb, but the wandb package is not installed: pip install wandb "
        "(or leave wandb out of loggers)"
    )
    assert message in _errors("loggers=[console,wandb]")
    with pytest.raises(ConfigError, match=re.escape(message)):  # the trainer's first check, before any model
        check_ppo_config(load_config("ppo-tiny", ["loggers=[console,wandb]"], schema=PPOConfig), 1)


def test_a_resumed_run_appends_after_the_checkpoint_step(tmp_path: Path) -> None:
    """Lines written after the checkpoint (steps 3-4 of the killed run) are dropped; the resumed
    run's lines follow; a partly written last line is dropped too."""
    import dataclasses

    first = build_sinks(["jsonl"], _setup(tmp_path))
    for step in (1, 2, 3, 4):
        first.write("train", step, {"actor/loss": step / 10})
        first.write_rows("samples", [{"step": step, "response": "x"}])
    first.close()
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"split": "train", "st')
    resumed = build_sinks(["jsonl"], dataclasses.replace(_setup(tmp_path), resumed_step=2))
    resumed.write("train", 3, {"actor/loss": 0.5})
    resumed.write_rows("samples", [{"step": 3, "response": "y"}])
    resumed.close()
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["actor/loss"]) for r in metrics] == [(1, 0.1), (2, 0.2), (3, 0.5)]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["response"]) for r in samples] == [(1, "x"), (2, "x"), (3, "y")]


@pytest.mark.parametrize("rollbacks_in_checkpoint", [0, 1])
def test_a_run_resumed_after_a_rollback_keeps_the_rollbacks_record_and_the_steps_it_left(
    tmp_path: Path, rollbacks_in_checkpoint: int
) -> None:
    """A rollback at step 4 to step 2, step 3 redone, then a kill. Resumed from a checkpoint saved
    after the rollback (step 3, one rollback behind it), the file reads as an uninterrupted run's:
    steps 1-4, the record, step 3 again. Before: step 4 and the record went, and the step 3 left
    stayed. Resumed from step 2 (saved before the rollback, which it does not know of): steps 1-2."""
    import dataclasses

    first = build_sinks(["jsonl"], _setup(tmp_path, total_steps=5))
    for step in (1, 2, 3, 4):
        first.write("train", step, {"actor/loss": step / 10})
    first.write("rollback", 4, {"to_step": 2})
    first.write("train", 3, {"actor/loss": 0.35})
    first.write("train", 4, {"actor/loss": 0.45})
    first.close()
    resumed_step = 3 if rollbacks_in_checkpoint else 2
    setup = dataclasses.replace(
        _setup(tmp_path, total_steps=5), resumed_step=resumed_step, resumed_rollbacks=rollbacks_in_checkpoint
    )
    build_sinks(["jsonl"], setup).close()
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    got = [(r["split"], r["step"], r.get("actor/loss")) for r in metrics]
    if rollbacks_in_checkpoint:
        assert got == [
            ("train", 1, 0.1),
            ("train", 2, 0.2),
            ("train", 3, 0.3),
            ("train", 4, 0.4),
            ("rollback", 4, None),
            ("train", 3, 0.35),
        ]
    else:
        assert got == [("train", 1, 0.1), ("train", 2, 0.2)]


def test_a_resume_continues_the_checkpoints_own_history_where_the_output_dir_lacks_it(tmp_path: Path) -> None:
    """A requeue onto a node without output_dir (before: metrics.jsonl and TensorBoard began at the
    checkpoint's step), and one onto a node with a stale copy of it (before: a gap)."""
    import dataclasses

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    history = "".join(json.dumps({"split": "train", "step": s, "actor/loss": s / 10}) + "\n" for s in (1, 2, 3))
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "metrics.jsonl").write_text(history.splitlines(keepends=True)[0])
    for out in (tmp_path / "new", stale):
        setup = dataclasses.replace(_setup(out, total_steps=5), resumed_step=3, history=history)
        sinks = build_sinks(["jsonl", "tensorboard"], setup)
        sinks.write("train", 4, {"actor/loss": 0.4})
        sinks.close()
        steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2, 3, 4], out
    events = EventAccumulator(str(tmp_path / "new" / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("actor/loss")] == [1, 2, 3, 4]


def test_non_finite_figures_are_written_as_null_and_listed() -> None:
    from megatron_rlhf.metrics.sinks import strict_json

    row = json.loads(strict_json({"step": 3, "loss": float("nan"), "lr": 1.0, "validation": {"nll": float("inf")}}))
    assert row == {
        "step": 3,
        "loss": None,
        "lr": 1.0,
        "validation": {"nll": None},
        "nonfinite": ["loss", "validation.nll"],
    }


def test_wandb_online_without_credentials_is_refused_before_anything_is_built(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine example.org login me password secret\n")
    netrc_file.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc_file))
    message = "loggers=['console', 'wandb'] lists wandb online, but no wandb credentials were found"
    assert any(e.startswith(message) for e in _errors("loggers=[console,wandb]"))
    assert not any(e.startswith(message) for e in _errors("loggers=[console,wandb]", "wandb.mode=offline"))
    netrc_file.write_text("machine api.wandb.ai login user password k3y\n")
    assert not any(e.startswith(message) for e in _errors("loggers=[console,wandb]"))
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("WANDB_API_KEY", "k3y")
    assert not any(e.startswith(message) for e in _errors("loggers=[console,wandb]"))


def test_a_resume_without_the_earlier_rows_says_where_they_are(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """samples.jsonl is not carried in checkpoints (its rows, a prompt and response each, would grow
    every checkpoint by the run's whole history). A requeue onto a node without output_dir began the
    file at the resumed step without a word; now the log says so. With the file there, no note."""
    import dataclasses

    for out, earlier in ((tmp_path / "new", None), (tmp_path / "same", '{"step": 1}\n')):
        out.mkdir()
        if earlier is not None:
            (out / "samples.jsonl").write_text(earlier)
        sinks = build_sinks(["jsonl"], dataclasses.replace(_setup(out, total_steps=5), resumed_step=3))
        sinks.write_rows("samples", [{"step": 4}])
        sinks.close()
        note = capsys.readouterr().out
        rows = [json.loads(line)["step"] for line in (out / "samples.jsonl").read_text().splitlines()]
        if earlier is None:
            assert f"note: {out / 'samples.jsonl'} is not here to continue: it starts at step 4" in note
            assert rows == [4]
        else:
            assert "not here to continue" not in note and rows == [1, 4]
