"""The training loop every trainer runs: steps over epochs of shuffled batches, metrics to the sinks
the ``loggers`` setting names (progress lines with the ETA, metrics.jsonl, TensorBoard, wandb),
validation, the final export and ``result.json``.

A trainer supplies a ``Task``: its set-up is done, and the loop calls ``task.step`` with the global
batch of example indices for each step (the same on every rank; a task takes its own share). The
loop is one SPMD program: every rank runs it, only global rank 0 prints and writes files.

Batches are drawn with ``drop_last``: an epoch is ``num_examples // batch_size`` steps and the few
examples left over by each epoch's shuffle wait for another epoch (the count is logged).

Checkpoints (``checkpoint/run_checkpoint.py``): the loop decides when (``save_every``, and at the
end) and where (``output_dir/checkpoints``); the task says what (its trained models, weights that
change without an optimizer, and its own small state). The data order is a pure function of
(seed, epoch, step), so the step is the data position: a resumed run skips the batches of the
steps it has done and continues bit for bit. A resumed run follows the config it is given: the
settings that may change take their new values (the optimizer's hyperparameters and LR schedule too,
at the checkpoint's step), the changes are reported, and those a checkpoint cannot follow are refused
at start-up, before any model is built (``resume_check.RULES``). The final checkpoint is written
before the HF export, so a failed export loses no step.

One run per output_dir: ``write_run_files`` takes its lock (``run_lock``) and returns it in the run's
``RunClaim``, which the trainer hands to ``run_loop``; ``run_loop`` releases it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, Protocol

import torch.distributed as dist
import yaml

from megatron_rlhf.checkpoint.export import export_hf
from megatron_rlhf.checkpoint.remote import RemoteDir, RemoteMirror, RemoteStorageError
from megatron_rlhf.checkpoint.run_checkpoint import (
    METRICS_FILE,
    REMOVING_SUFFIX,
    RUN_STATE_FILE,
    RunCheckpointWriter,
    UnusableCheckpoint,
    checkpoints_root,
    complete_checkpoints,
    incomplete_checkpoints,
    is_complete,
    load_run_checkpoint,
    manifest_problems,
    newest_checkpoint,
    remove_beyond,
    remove_partial,
)
from megatron_rlhf.config.loader import ConfigError, to_yaml
from megatron_rlhf.data import Tokenizer, epoch_batches
from megatron_rlhf.metrics.curves import read_metrics, validation_table, write_curves
from megatron_rlhf.metrics.kernels import profiled
from megatron_rlhf.metrics.log import environment_report, is_rank0, log
from megatron_rlhf.metrics.sinks import (
    Sink,
    SinkSetup,
    build_sinks,
    new_wandb_run_id,
    strict_json,
)
from megatron_rlhf.models.roles import RoleModel
from megatron_rlhf.rewards.calls import ScoringInterrupted
from megatron_rlhf.trainer import run_lock
from megatron_rlhf.trainer.health import (
    Firing,
    HealthState,
    higher_is_better,
    judge_evaluation,
    step_signals,
    triggered,
    update_streaks,
    warning_due,
    watched_metric,
)
from megatron_rlhf.trainer.loop_config import LoopConfig
from megatron_rlhf.trainer.resume_check import ResumeRefused, RunFacts, review_resume, tokenizer_fingerprint
from megatron_rlhf.trainer.stop import RunStopped, StopSignals, stop_signals
from megatron_rlhf.training.optim import TrainState

StepRows = dict[str, list[dict[str, Any]]]
"""Rows a step writes beside its metrics, by file: ``{"samples": [...]}`` -> ``samples.jsonl``."""


class Task(Protocol):
    """What a trainer gives the loop (``sft``, ``rm``, ``ppo``)."""

    @property
    def name(self) -> str: ...

    @property
    def num_examples(self) -> int: ...

    @property
    def batch_size(self) -> int:
        """Examples per step over all ranks (sequences, preference pairs, prompts)."""
        ...

    @property
    def batch_description(self) -> str:
        """How a step's batch is made up, for the plan line (e.g. ``prompts, 8 per step x 4 samples``)."""
        ...

    @property
    def layouts(self) -> str:
        """Every model's layout (and where generation runs), for the start-up report."""
        ...

    @property
    def headline(self) -> tuple[str, str]:
        """The metric whose first and last values the summary keeps, and its name in the final line."""
        ...

    @property
    def evaluate(self) -> Callable[[], tuple[dict[str, float], StepRows]] | None:
        """Validation figures (identical on every rank) and rows for other files (validation
        samples), or None without validation."""
        ...

    @property
    def eval_every(self) -> int:
        """Evaluate every this many steps (0: only at the end), when ``evaluate`` is set."""
        ...

    @property
    def eval_before_train(self) -> bool:
        """Also evaluate before the first step (logged as step 0): the starting point of the curve."""
        ...

    @property
    def export_role(self) -> RoleModel:
        """The model written to ``hf/`` at the end (with the tokenizer's files)."""
        ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    def step(self, step: int, epoch: int, indices: list[int]) -> tuple[dict[str, float], StepRows]:
        """Train on the global batch ``indices``; returns the step's metrics (identical on every rank)
        and rows for other files."""
        ...

    def progress(self, metrics: dict[str, float]) -> str:
        """The middle of the progress line (between ``step s/t`` and the ETA)."""
        ...

    def train_states(self) -> dict[str, TrainState]:
        """The trained models by name, saved with their optimizer and LR schedule."""
        ...

    def changing_weights(self) -> dict[str, RoleModel]:
        """Models whose weights change during the run without an optimizer (a reference that
        follows the actor), saved as weights."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The task's own state beyond its models (JSON), e.g. an adaptive KL coefficient."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        ...

    def recover(self, lr_scale: float, kl_scale: float) -> None:
        """Set the learning rates to the config's times ``lr_scale`` and the KL coefficients to the
        config's times ``kl_scale`` (the health watch's recovery; applied after every load)."""
        ...


STEP_TIME = "timing_s/step"
"""The whole step's wall time, every trainer's (its phases, ``timing_s/<phase>``, sum to about it)."""

RUN_FILES = ("config.yaml", "metrics.jsonl", "result.json", "hf")
"""What a run leaves in its output_dir (besides checkpoints/)."""
RUN_OUTPUTS = ("result.json", "hf", "hf_adapter", "samples.jsonl", "curves.png")
"""What a run writes as it goes or at its end that a fresh run in the same output_dir may not write
(no export, no adapters, no samples): removed when it starts, or it would pass for the new run's."""


@dataclasses.dataclass(frozen=True)
class RunClaim:
    """What ``write_run_files`` established for a run in its output_dir, for ``run_loop``: the lock
    (rank 0), and the run's facts and tokenizer that each checkpoint records."""

    lock: Path | None
    facts: RunFacts
    tokenizer: str
    """``tokenizer_fingerprint`` of the run's tokenizer."""

    def recorded(self) -> dict[str, Any]:
        """What a checkpoint's run_state.json keeps of them."""
        return {
            "trainer": self.facts.trainer,
            "examples": self.facts.examples,
            "models": {role: arch.hf_config for role, arch in self.facts.models.items()},
            "tokenizer": self.tokenizer,
            "dtype": self.facts.dtype,
            "data": self.facts.data,
        }


@dataclasses.dataclass
class LoopState:
    """What the loop carries from step to step, and keeps in every checkpoint (``run_state.json``:
    ``summary``, the figures the result reports, and ``loop``, the loop's own position)."""

    headline: str
    """The task's headline metric (``Task.headline``)."""
    first_headline: float | None = None
    """Its value at step 1; None before."""
    last_headline: float | None = None
    """Its value at the latest step."""
    validation: dict[str, float] | None = None
    """The latest validation figures; None before the first validation."""
    last_eval_step: int = -1
    """The step the latest validation followed (-1: none yet)."""
    train_seconds: float = 0.0
    """Seconds trained before this process's steps started (by the runs it continues)."""
    reseeded: list[list[int]] = dataclasses.field(default_factory=list)
    """[first, last] of each window of steps redone after a rollback, with another data order."""
    wandb_run_id: str | None = None
    """The wandb run this run writes to (rank 0, with the wandb logger): a resumed run continues it."""
    health: HealthState = dataclasses.field(default_factory=HealthState)
    """The health watch's best evaluation, patience count, rollbacks and recovery (``health.py``)."""

    def record(self, metrics: dict[str, float]) -> None:
        """A step's metrics: its headline value."""
        value = metrics[self.headline]
        self.first_headline = value if self.first_headline is None else self.first_headline
        self.last_headline = value

    def summary(self, total: int, per_epoch: int) -> dict[str, Any]:
        """``result.json``'s figures: steps, the headline's first and last value, the validation."""
        stem = self.headline.replace("/", "_")
        out: dict[str, Any] = {"steps": total, "steps_per_epoch": per_epoch}
        if self.first_headline is not None:
            out |= {f"first_{stem}": self.first_headline, f"last_{stem}": self.last_headline}
        if self.validation is not None:
            out["validation"] = self.validation
        return out

    def loop_figures(self, train_seconds: float) -> dict[str, Any]:
        """The loop's position as a checkpoint keeps it, with the seconds trained so far."""
        return {
            "last_eval_step": self.last_eval_step,
            "train_seconds": train_seconds,
            "reseeded": self.reseeded,
            "wandb_run_id": self.wandb_run_id,
            "health": self.health.as_json(),
        }

    def restore(self, run_state: dict[str, Any]) -> None:
        """Continue from a checkpoint's ``summary`` and ``loop``."""
        stem = self.headline.replace("/", "_")
        summary, loop = run_state["summary"], run_state["loop"]
        self.first_headline = summary.get(f"first_{stem}")
        self.last_headline = summary.get(f"last_{stem}")
        self.validation = summary.get("validation")
        self.last_eval_step = loop["last_eval_step"]
        self.train_seconds = loop["train_seconds"]
        self.reseeded = loop["reseeded"]
        # A rollback keeps the run's live wandb run; checkpoints written before ids were kept have none.
        self.wandb_run_id = self.wandb_run_id or loop.get("wandb_run_id")
        self.health = HealthState.from_json(loop.get("health"))


def write_run_files(cfg: LoopConfig, out_dir: Path, facts: RunFacts, tokenizer: Tokenizer) -> RunClaim:
    """Collective, before any model is built: take the output_dir's lock (``run_lock``); refuse an
    output_dir that holds another run's files and nothing to resume, and a resume whose config
    changes what a checkpoint cannot follow (``resume_check``), reporting what it does change;
    then write config.yaml. One decision, made by rank 0, so that no rank sees files another rank
    has just written. Returns the run's claim, for ``run_loop``."""
    claim = RunClaim(lock=None, facts=facts, tokenizer=tokenizer_fingerprint(tokenizer))
    refusal: list[ConfigError | None] = [None]
    if is_rank0():
        try:
            claim = dataclasses.replace(claim, lock=run_lock.acquire(out_dir))
            _fetch_remote(cfg, out_dir)
            _check_output_dir(cfg, out_dir)
            _check_resume(cfg, claim)
        except ConfigError as err:
            refusal[0] = err
        except Exception as err:  # reaches the other ranks too, which would wait in the broadcast until the timeout
            refusal[0] = ConfigError(f"output_dir={cfg.output_dir!r}: setting up the run's files failed: {err!r}")
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        if claim.lock is not None:
            run_lock.release(claim.lock)
        raise refusal[0]
    if is_rank0():
        (out_dir / "config.yaml").write_text(to_yaml(cfg))
    return claim


def _fetch_remote(cfg: LoopConfig, out_dir: Path) -> None:
    """Rank 0, with ``remote_dir``: check that it can be written (``ConfigError`` naming why not);
    with resume=auto, download the newest complete remote checkpoint into ``output_dir/checkpoints``
    when the local one is older or missing (a job requeued onto a node that does not see the first
    one's disk, or back onto one holding a stale copy: ``RemoteDir.fetch_newer``). Like every
    checkpoint, it is read by every rank: output_dir is shared by the nodes of a run. resume=never
    replaces remote checkpoints only with overwrite=true, as it does output_dir's."""
    if not cfg.remote_dir:
        return
    try:
        remote = RemoteDir(cfg.remote_dir)
        remote.check_writable()
        if cfg.resume == "auto":
            # The local checkpoint the resume would take: an unusable newest one is passed over.
            local = next((ckpt for ckpt in cfg.resume_candidates() if _usable(cfg, ckpt)), None)
            root = checkpoints_root(out_dir)
            got = remote.fetch_newer(root, local)
            if got is None and local is None:
                log(f"no checkpoint under output_dir or remote_dir={cfg.remote_dir!r}")
            if got is not None:  # the local ones after it are stale, or another branch's
                for path in remove_beyond(root, int(got.name.removeprefix("step_"))):
                    log(f"removed {path}: beyond {got.name}, the checkpoint further along downloaded from remote_dir")
        elif cfg.resume == "never" and not cfg.overwrite and (held := remote.held_steps()):
            raise ConfigError(
                f"remote_dir={cfg.remote_dir!r} holds another run's checkpoints "
                f"({', '.join(f'step_{step}' for step in held)}), which resume=never would replace: set "
                "overwrite=true to replace them, or choose another remote_dir"
            )
        elif cfg.resume not in ("auto", "never"):
            remote.latest()  # one that names no checkpoint is refused now, not at the first upload
    except ConfigError:
        raise
    except RemoteStorageError as err:
        raise ConfigError(str(err)) from err
    except OSError as err:  # the storage failed while the checkpoint was downloaded
        raise ConfigError(f"remote_dir={cfg.remote_dir!r}: downloading its newest checkpoint failed: {err!r}") from err
    except Exception as err:  # the storage library's own errors, e.g. botocore's NoCredentialsError
        raise ConfigError(
            f"remote_dir={cfg.remote_dir!r}: {type(err).__name__}: {err} (credentials and endpoint come from the "
            "environment, e.g. AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE for s3://)"
        ) from err


def _check_output_dir(cfg: LoopConfig, out_dir: Path) -> None:
    """Raise ``ConfigError`` if this run may not write ``out_dir``. Files of an earlier attempt that
    never completed a step (a start-up or step-1 failure) are not another run's: the corrected
    command replaces them."""
    if cfg.overwrite or (cfg.resume != "never" and cfg.resume_from() is not None):
        return
    root = checkpoints_root(out_dir)
    complete = [p.name for p in complete_checkpoints(root)]
    if complete:  # resume=never: any other resume would continue them
        raise ConfigError(
            f"output_dir={cfg.output_dir!r} holds another run's checkpoints "
            f"({', '.join(f'checkpoints/{name}' for name in complete)}), which resume=never would replace: set "
            "resume=auto to continue them, overwrite=true to start over in their place, or choose another output_dir"
        )
    found = [name for name in RUN_FILES if (out_dir / name).exists()]
    if not found:
        return
    if not _completed_a_step(out_dir):
        log(
            f"output_dir={cfg.output_dir!r}: replacing the files of an earlier run that completed no step "
            f"({', '.join(found)})"
        )
        return
    damaged = [p.name for p in incomplete_checkpoints(root)]  # no complete one: refused above
    if not damaged and _unfinished_attempt_of(cfg, out_dir):
        log(
            f"output_dir={cfg.output_dir!r}: an earlier attempt of this run (the same config.yaml) stopped before "
            f"its first checkpoint (save_every={cfg.save_every}); starting over"
        )
        return
    if damaged:  # no complete one (a complete one would be resumed): run_state.json missing
        raise ConfigError(
            f"output_dir={cfg.output_dir!r} holds another run's files ({', '.join(found)}) and checkpoints "
            f"that are incomplete ({', '.join(f'checkpoints/{name}' for name in damaged)}: no {RUN_STATE_FILE}), "
            "so none can be resumed. overwrite=true would write over them: move them aside first if they matter, "
            "or choose another output_dir"
        )
    raise ConfigError(
        f"output_dir={cfg.output_dir!r} holds another run's files ({', '.join(found)}) and no checkpoint "
        f"to resume from (resume={cfg.resume}): set overwrite=true to replace them, or choose another "
        "output_dir"
    )


def _unfinished_attempt_of(cfg: LoopConfig, out_dir: Path) -> bool:
    """Whether ``out_dir`` holds an earlier attempt of this very run that did not finish: the same
    config.yaml (a restarted or requeued command), no result.json and no export. It left no
    checkpoint (one would be resumed), so the steps it made are lost either way: this run redoes them."""
    if (out_dir / "result.json").exists() or (out_dir / "hf").exists():
        return False
    with contextlib.suppress(OSError, UnicodeDecodeError):
        return (out_dir / "config.yaml").read_text() == to_yaml(cfg)
    return False


def _completed_a_step(out_dir: Path) -> bool:
    """Whether the run that wrote ``out_dir`` got through a training step: it wrote a result, an
    export, or a training line to metrics.jsonl (validation before step 1 does not count)."""
    if (out_dir / "result.json").exists() or (out_dir / "hf").exists():
        return True
    metrics = out_dir / "metrics.jsonl"
    if not metrics.is_file():
        return False
    for line in metrics.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            if json.loads(line).get("split") == "train":
                return True
    return False


def _check_resume(cfg: LoopConfig, claim: RunClaim) -> None:
    """Rank 0: report how the config differs from the config.yaml of the checkpoint it resumes;
    raise ``ResumeRefused`` naming the changes a checkpoint cannot follow (``resume_check.RULES``)."""
    # The checkpoint the load will take. Its files are read only once they are checked.
    ckpt = next((ckpt for ckpt in cfg.resume_candidates() if _usable(cfg, ckpt)), None)
    if ckpt is None:
        return  # a fresh run; an unusable checkpoint is reported when it is loaded
    try:
        run_state = json.loads((ckpt / RUN_STATE_FILE).read_text())
        old_yaml = (ckpt / "config.yaml").read_text()
        review = review_resume(cfg, to_yaml(cfg), old_yaml, run_state, claim.facts, claim.tokenizer)
    except (ValueError, yaml.YAMLError):  # an unverified checkpoint's bytes that do not parse
        return  # reported as unusable when it is loaded
    if review.changed:
        log(
            f"resuming {ckpt} with {len(review.changed)} settings changed from its config.yaml:\n  "
            + "\n  ".join(review.changed)
        )
    if review.refused:
        raise ResumeRefused(
            f"resume={cfg.resume!r} continues {ckpt}, and this config changes what its state cannot "
            f"follow: {'; '.join(review.refused)}. Keep those settings as they were "
            f"({ckpt / 'config.yaml'}), or start a new run: resume=never, or another output_dir"
        )


def _usable(cfg: LoopConfig, ckpt: Path) -> bool:
    """Whether a resume would load ``ckpt``: its files match its manifest (without a manifest, only
    if trusted)."""
    return (ckpt / "config.yaml").is_file() and manifest_problems(ckpt) in (
        [],
        *([None] if cfg.trust_unverified_checkpoint else []),
    )


def plan_steps(cfg: LoopConfig, task: Task) -> tuple[int, int]:
    """(steps per epoch, total steps)."""
    per_epoch, total = cfg.run_steps(task.num_examples, task.batch_size)
    assert per_epoch > 0, "start_run refuses a training set smaller than one step's batch"
    return per_epoch, total


def epochs_line(name: str, examples: int, description: str, batch_size: int, per_epoch: int, total: int) -> str:
    """The start-up line of a run's length: steps per epoch and in all, and the examples a step's
    whole batches leave out of each epoch's shuffle (never trained when the run takes one epoch)."""
    left_over = examples - per_epoch * batch_size
    if not left_over:
        left_out = ""
    elif total <= per_epoch:  # the run draws from one epoch's shuffle only
        left_out = f" ({left_over} examples of the shuffle are never trained: a step takes whole batches)"
    else:
        left_out = f" ({left_over} examples of each epoch's shuffle are left out of its steps, other ones each epoch)"
    steps = f"{per_epoch} step{'s' * (per_epoch != 1)} per epoch"
    return f"{name}: {examples} {description}: {steps}{left_out}; {total} steps ({total / per_epoch:.2f} epochs)"


def run_loop(cfg: LoopConfig, task: Task, claim: RunClaim | None = None) -> dict[str, Any]:
    """Train for the configured steps (continuing a checkpoint when ``resume`` finds one), saving
    checkpoints; export, write ``result.json``; returns the summary. ``claim``: what
    ``write_run_files`` returned (its lock is released at the end, whatever ends the run; None: no
    run files were written)."""
    try:
        return _train_and_export(cfg, task, claim)
    finally:
        if claim is not None and claim.lock is not None:
            run_lock.release(claim.lock)


def _train_and_export(cfg: LoopConfig, task: Task, claim: RunClaim | None) -> dict[str, Any]:
    out_dir = Path(cfg.output_dir)
    per_epoch, total = plan_steps(cfg, task)
    log(epochs_line(task.name, task.num_examples, task.batch_description, task.batch_size, per_epoch, total))
    log(environment_report())
    log(f"layouts: {task.layouts}")
    state = LoopState(headline=task.headline[0])
    mirror = RemoteMirror(cfg.remote_dir, cfg.keep_last)
    resumed_step, history = _resume(cfg, task, state, mirror)
    if resumed_step is not None:
        _check_length_after_resume(cfg, resumed_step, total)
    if "wandb" in cfg.loggers and is_rank0() and state.wandb_run_id is None:
        state.wandb_run_id = new_wandb_run_id()
    setup = SinkSetup(
        out_dir=out_dir,
        total_steps=total,
        log_every=cfg.log_every,
        progress=task.progress,
        wandb=cfg.wandb,
        config=dataclasses.asdict(cfg),
        resumed_step=resumed_step,
        resumed_rollbacks=len(state.reseeded),
        history=history,
        wandb_run_id=state.wandb_run_id,
    )
    sink = build_sinks(cfg.loggers, setup)
    # Set-up leaves some 0.4M Python objects (torch, megatron-core, the models' modules) that live as
    # long as the run. The cyclic GC walks all of them in each full collection (0.28 s on a 2-core
    # host), which it starts inside whichever phase has just allocated enough. Frozen, they are never
    # walked again, and a step's collections cost only what the step allocates. Unfrozen at the end,
    # so that a process running several trainers (``pipeline``, tests) can still free a finished one.
    gc.collect()
    gc.freeze()
    # The health watch's best evaluation: the checkpoint a rollback goes back to, which pruning keeps.
    pinned = f"step_{state.health.best_step}" if state.health.best_step >= 0 else None
    resumed_ckpt = checkpoints_root(out_dir) / f"step_{resumed_step}"
    if resumed_step is not None and is_rank0() and is_complete(resumed_ckpt):  # not another run's (resume=PATH)
        mirror.catch_up(resumed_ckpt, pinned)
    steps = _Steps(
        cfg=cfg,
        task=task,
        state=state,
        per_epoch=per_epoch,
        total=total,
        sink=sink,
        writer=RunCheckpointWriter(
            checkpoints_root(out_dir), keep_last=cfg.keep_last, background=cfg.async_save, on_complete=mirror.start
        ),
        mirror=mirror,
        recorded={} if claim is None else claim.recorded(),
    )
    steps.writer.pinned = pinned
    if (state.health.lr_scale, state.health.kl_scale) != (1.0, 1.0):
        task.recover(state.health.lr_scale, state.health.kl_scale)  # a resumed run after a rollback
    with stop_signals() as signals:
        try:
            signals.stop_before_training()
            steps.run(resumed_step, signals)
        except RunStopped:
            steps.writer.wait()  # the stop's checkpoint is complete before the process exits
            mirror.wait()  # and uploaded
            raise
        finally:
            sink.close()
            gc.unfreeze()
    summary = state.summary(total, per_epoch) | {"train_seconds": steps.train_seconds()}
    # before the export: a failed export costs no step
    if cfg.save_final and resumed_step != total and steps.last_saved != total:
        steps.save(total)
    steps.writer.wait()
    if cfg.save_hf:
        _export(cfg, task, out_dir, total if cfg.save_final or resumed_step == total else None)
        summary["hf_dir"] = str(out_dir / "hf")
    mirror.wait(required=True)  # the final checkpoint's upload ran beside the export
    if is_rank0():
        (out_dir / "result.json").write_text(strict_json(summary, indent=2) + "\n")
        _report_curves(out_dir, task)
    label = task.headline[1]
    log(
        f"{task.name} done: {label} {state.first_headline:.4f} (step 1) -> {state.last_headline:.4f} "
        f"(step {total})" + _validation_headline(state.validation) + f"; {out_dir}"
    )
    return summary


class ExportFailed(ValueError):
    """The final HF export failed; the message says what the checkpoint holds and how to redo it."""


def _export(cfg: LoopConfig, task: Task, out_dir: Path, final_step: int | None) -> None:
    """Export ``task.export_role`` to ``out_dir/hf``. On failure (a full disk, an unwritable
    directory) say what the final checkpoint (``final_step``; None: none was saved) holds and give
    the ``convert`` command that redoes the export from it."""
    hf = out_dir / "hf"
    try:
        export_hf(task.export_role, task.tokenizer, hf, adapter_dir=out_dir / "hf_adapter")
    except OSError as err:
        if final_step is None:
            what = (
                f"no checkpoint holds the final step (save_final={cfg.save_final}): the steps since the last "
                "checkpoint are lost"
            )
        else:
            ckpt = checkpoints_root(out_dir) / f"step_{final_step}"
            name = next(n for n, s in task.train_states().items() if s.role is task.export_role)
            what = (
                f"the checkpoint {ckpt} holds every step; redo the export with: megatron-rlhf convert mcore-to-hf "
                f"{ckpt / 'models' / name} {hf} (it writes what the run's export writes), "
                "or run the same command again (it resumes at the last step and exports)"
            )
        raise ExportFailed(f"the HF export to {hf} failed: {err}; {what}") from err


@dataclasses.dataclass
class _Steps:
    """The steps of one ``run_loop``: what they run, write to and save with, and the state they carry."""

    cfg: LoopConfig
    task: Task
    state: LoopState
    per_epoch: int
    total: int
    sink: Sink
    writer: RunCheckpointWriter
    mirror: RemoteMirror
    """Uploads each complete checkpoint to ``remote_dir`` (nothing without one)."""
    recorded: dict[str, Any]
    """What each checkpoint records of the run's models and tokenizer (``RunClaim``)."""
    start: float = dataclasses.field(default_factory=time.perf_counter)
    last_saved: int = -1
    """The step of the latest checkpoint this process saved (-1: none)."""
    _verdict: str | None = None
    """The latest evaluation's verdict for ``after_evaluation``: ``best``, why to roll back, or None."""

    def train_seconds(self) -> float:
        return self.state.train_seconds + time.perf_counter() - self.start

    def save(self, step: int) -> None:
        self.last_saved = step
        run_state = {
            "summary": self.state.summary(self.total, self.per_epoch),
            "loop": self.state.loop_figures(self.train_seconds()),
            "task": self.task.state_dict(),
            **self.recorded,
        }
        # The previous checkpoint is complete and uploaded before this one is written: its upload
        # reads files that this save's pruning (keep_last) may delete.
        self.writer.wait()
        self.mirror.wait()
        metrics = Path(self.cfg.output_dir) / METRICS_FILE
        self.writer.save(
            step,
            train_states=self.task.train_states(),
            weights=self.task.changing_weights(),
            run_state=run_state,
            config_yaml=to_yaml(self.cfg),
            history=metrics.read_text(encoding="utf-8") if is_rank0() and metrics.is_file() else "",
        )

    def run(self, resumed_step: int | None, signals: StopSignals) -> None:
        """The steps after ``resumed_step`` and the final validation; a background save is completed
        at the first step boundary after its files are written. A stop request saves a checkpoint at
        the step boundary and raises ``RunStopped``; ``max_bad_steps`` skipped updates in a row roll
        back (``roll_back``)."""
        cfg, task, state, total = self.cfg, self.task, self.state, self.total
        step, bad_steps = resumed_step or 0, 0
        if task.evaluate is not None and task.eval_before_train and resumed_step is None:
            # The starting model may be the best (a run that collapses at once): judged, saved as step_0.
            _evaluate(task.evaluate, 0, self.sink, self.judge_evaluation)
            self.after_evaluation(0)
        while step < total:
            step += 1
            epoch, indices = _batch(cfg, task, self.per_epoch, step, state.reseeded)
            started = time.perf_counter()
            try:
                with _profiled(cfg, step):
                    metrics, rows = task.step(step, epoch, indices)
            except ScoringInterrupted as interrupted:
                self._stop_mid_step(step - 1, bad_steps, signals, interrupted)
            metrics[STEP_TIME] = time.perf_counter() - started
            health, fired = step_signals(cfg.health, metrics)
            self.sink.write("train", step, {"epoch": epoch, **metrics, **health})
            for name, file_rows in rows.items():
                self.sink.write_rows(name, [{"step": step, **row} for row in file_rows])
            state.record(metrics)
            update_streaks(state.health, health)
            for firing in fired:
                if warning_due(streak := state.health.streaks[firing.metric]):
                    log(firing.warning(step, streak))
            bad_steps = bad_steps + 1 if any(k.endswith("update_skipped") and v for k, v in metrics.items()) else 0
            if bad_steps == cfg.max_bad_steps:
                step, bad_steps = self.roll_back(step), 0
                continue
            if triggers := triggered(cfg.health, state.health, fired):
                step, bad_steps = self.health_roll_back(step, _signals_reason(state.health, triggers)), 0
                continue
            # The last step's evaluation is made here too, so that the watch judges it.
            if task.evaluate is not None and ((task.eval_every and step % task.eval_every == 0) or step == total):
                state.validation = _evaluate(task.evaluate, step, self.sink, self.judge_evaluation)
                state.last_eval_step = step
                if (why := self.after_evaluation(step)) is not None:
                    step, bad_steps = self.health_roll_back(step, why), 0
                    continue
            self.writer.poll()
            stop = signals.agreed()
            # Not in a run of skipped updates: a rollback goes back to before its first step.
            due = stop is not None or (cfg.save_every and step % cfg.save_every == 0)
            if step < total and not bad_steps and due and self.last_saved != step:
                self.save(step)
            if stop is not None and step < total:
                raise RunStopped(f"stopped on request after step {step}; the same command continues from there", stop)
        if task.evaluate is not None and state.last_eval_step != total:
            state.validation = _evaluate(task.evaluate, total, self.sink)
            state.last_eval_step = total

    def _stop_mid_step(self, done: int, bad_steps: int, signals: StopSignals, why: ScoringInterrupted) -> NoReturn:
        """Collective (every rank's step was interrupted alike): a stop request arrived while step
        ``done + 1`` waited on reward code that had not returned. Nothing of that step is kept: save
        step ``done`` (its models, optimizer and the loop's state are still as that step left them;
        the RNG has moved on, so the redone step samples anew) unless no step is done, a checkpoint
        of it exists, or it ends a run of skipped updates (which a rollback goes back before); then
        stop."""
        code = signals.agreed() or 0
        root = checkpoints_root(self.cfg.output_dir)
        newest = newest_checkpoint(root)
        if done and not bad_steps and (newest is None or newest.name != f"step_{done}"):
            self.save(done)
            newest = newest_checkpoint(root)
        where = f"continues from {newest}" if newest is not None else "starts over"
        raise RunStopped(f"stopped on request during step {done + 1} ({why}); the same command {where}", code)

    def roll_back(self, step: int) -> int:
        """Load the newest checkpoint after ``max_bad_steps`` skipped updates ending at ``step``; the
        steps after it are redone with another data order. Returns the checkpoint's step. Raises
        ``RunStopped`` (exit 3) with no checkpoint, or when these steps were redone once already."""
        cfg = self.cfg
        first_bad = step - cfg.max_bad_steps + 1
        what = (
            f"steps {first_bad}-{step}: {cfg.max_bad_steps} updates in a row skipped for a non-finite loss or "
            f"gradients (max_bad_steps={cfg.max_bad_steps})"
        )
        self.writer.wait()  # a checkpoint still being written is older than these steps: the one to go back to
        self.mirror.wait()  # its upload too, before the remote's later checkpoints go
        ckpt = newest_checkpoint(checkpoints_root(cfg.output_dir))
        if ckpt is None:
            raise RunStopped(
                f"{what}, and no checkpoint to roll back to (save_every={cfg.save_every}): stopping; "
                "lower the learning rate or check the data",
                3,
            )
        reseeded = self.state.reseeded
        good = self._load(ckpt)
        if any(first == good + 1 for first, _ in reseeded):
            raise RunStopped(f"{what}, again after a rollback to {ckpt} with another data order: stopping", 3)
        self.state.reseeded = [*reseeded, [good + 1, step]]
        _remove_beyond(checkpoints_root(cfg.output_dir), good, "beyond the checkpoint rolled back to", self.mirror)
        self.sink.write("rollback", step, {"to_step": good})
        log(f"{what}: rolled back to {ckpt}; redoing steps {good + 1}-{step} with another data order")
        return good

    def _load(self, ckpt: Path) -> int:
        """Collective: the task and the loop's position from ``ckpt``, keeping the live health watch
        (its best, rollbacks and recovery, applied again over what the checkpoint's optimizer holds);
        returns the checkpoint's step."""
        run_state = load_run_checkpoint(
            ckpt,
            train_states=self.task.train_states(),
            weights=self.task.changing_weights(),
            trust_unverified=self.cfg.trust_unverified_checkpoint,
        )
        health = self.state.health
        self.task.load_state_dict(run_state["task"])
        self.state.restore(run_state)
        self.state.health = health
        self.last_saved = int(run_state["step"])  # the steps redone after it are saved again
        if (health.lr_scale, health.kl_scale) != (1.0, 1.0):
            self.task.recover(health.lr_scale, health.kl_scale)
        return int(run_state["step"])

    def judge_evaluation(self, step: int, figures: dict[str, float]) -> dict[str, float]:
        """The validation watch (``health.val_patience``), before the evaluation's line is written:
        compares the watched figure with the best; returns the line's ``health/...`` figures."""
        cfg, health = self.cfg.health, self.state.health
        self._verdict = None
        if not cfg.val_patience:
            return {}
        metric = watched_metric(cfg, figures)
        value, best = figures[metric], health.best
        verdict = judge_evaluation(health, value, higher=higher_is_better(metric, cfg.val_mode))
        if verdict == "best":
            health.best_step = step
            log(f"health: step {step}: validation {metric} {value:.4f} is the best so far; saving its checkpoint")
            self._verdict = "best"
        elif verdict == "below":
            log(
                f"health: step {step}: validation {metric} {value:.4f} below the best {best:.4f} (step "
                f"{health.best_step}): {health.below} of health.val_patience={cfg.val_patience} in a row"
            )
            if health.below >= cfg.val_patience:
                self._verdict = (
                    f"validation {metric} below its best {best:.4f} (step {health.best_step}) for {health.below} "
                    f"evaluations in a row (health.val_patience={cfg.val_patience}), now {value:.4f}"
                )
        return {"health/val_below_best": float(health.below), "health/val_best": float(health.best or 0.0)}

    def after_evaluation(self, step: int) -> str | None:
        """After an evaluation's line: a new best is saved at once (and kept by pruning); returns why
        to roll back when the patience has run out, else None."""
        verdict, self._verdict = self._verdict, None
        if verdict == "best":
            self.writer.pinned = f"step_{step}"
            if self.last_saved != step:
                self.save(step)
            return None
        return verdict

    def health_roll_back(self, step: int, why: str) -> int:
        """Roll back for the health watch after ``step``: to the best evaluation's checkpoint, else
        the newest one from before the signals' run of steps; the recovery (``health.lr_factor``,
        ``kl_coef_factor``) is applied and the steps after the checkpoint are redone with another data
        order (fresh prompts and samples). Returns the checkpoint's step. With ``max_rollbacks``
        spent, exports the best checkpoint's model and raises ``RunStopped`` (exit 3)."""
        cfg, health = self.cfg, self.state.health
        self.writer.wait()
        self.mirror.wait()
        root = checkpoints_root(cfg.output_dir)
        best = root / f"step_{health.best_step}" if health.best_step >= 0 else None
        if best is None or not (best / RUN_STATE_FILE).is_file():
            first_bad = step - max(health.streaks.values(), default=1) + 1
            before = [c for c in complete_checkpoints(root) if int(c.name.removeprefix("step_")) < first_bad]
            best = before[-1] if before else None
        if best is None:
            raise RunStopped(f"health: {why}; no checkpoint to roll back to: stopping", 3)
        if health.rollbacks >= cfg.health.max_rollbacks:
            self._stop_with_best(best, step, why)
        health.rollbacks += 1
        health.lr_scale *= cfg.health.lr_factor
        health.kl_scale *= cfg.health.kl_coef_factor
        health.below, health.streaks = 0, {}
        reseeded = self.state.reseeded
        good = self._load(best)  # which applies the recovery
        self.state.reseeded = [*reseeded, [good + 1, step]]
        _remove_beyond(root, good, "beyond the checkpoint rolled back to", self.mirror)
        self.sink.write(
            "rollback",
            step,
            {
                "to_step": good,
                "health/rollbacks": health.rollbacks,
                "health/lr_scale": health.lr_scale,
                "health/kl_scale": health.kl_scale,
            },
        )
        log(
            f"health: {why}: rolled back to {best} (rollback {health.rollbacks} of "
            f"health.max_rollbacks={cfg.health.max_rollbacks}); learning rates x{health.lr_scale:g}, KL "
            f"coefficients x{health.kl_scale:g} of the config's; redoing steps {good + 1}-{step} with another "
            "data order"
        )
        return good

    def _stop_with_best(self, best: Path, step: int, why: str) -> NoReturn:
        """Load ``best``, export its model as ``hf/`` (with ``save_hf``) and its evaluation in
        ``result.json``, then stop with exit code 3."""
        cfg, task = self.cfg, self.task
        good = self._load(best)
        summary = self.state.summary(self.total, self.per_epoch) | {"train_seconds": self.train_seconds()}
        summary["stopped"] = {"step": step, "reason": f"health: {why}", "rollbacks": self.state.health.rollbacks}
        summary["exported_step"] = good
        if task.evaluate is not None:  # what the exported model scores (the same greedy figures as at its step)
            summary["exported_validation"], _ = task.evaluate()
        out_dir = Path(cfg.output_dir)
        if cfg.save_hf:
            _export(cfg, task, out_dir, good)
            summary["hf_dir"] = str(out_dir / "hf")
        if is_rank0():
            (out_dir / "result.json").write_text(strict_json(summary, indent=2) + "\n")
        raise RunStopped(
            f"health: {why}, after health.max_rollbacks={cfg.health.max_rollbacks} rollbacks: stopping; "
            f"exported {best} (the best evaluation's model)" + (f" to {out_dir / 'hf'}" if cfg.save_hf else ""),
            3,
        )


def _signals_reason(health: HealthState, triggers: list[Firing]) -> str:
    """Why the signals ``triggers`` roll the run back."""
    named = ", ".join(f"{f.metric} ({f.figure} {f.value:.4g})" for f in triggers)
    return f"{named} fired {max(health.streaks[f.metric] for f in triggers)} steps in a row (health.roll_back_on)"


def _profiled(cfg: LoopConfig, step: int) -> contextlib.AbstractContextManager[Any]:
    """``profiled`` around the steps ``profile_steps`` names; nothing around the others."""
    if step not in cfg.profile_steps:
        return contextlib.nullcontext()
    rank = f".rank_{dist.get_rank()}" if dist.get_world_size() > 1 else ""
    return profiled(Path(cfg.output_dir) / "profile" / f"step_{step}{rank}")


@functools.cache
def _epoch_order(num_examples: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    return list(epoch_batches(num_examples, batch_size, 0, 1, seed, epoch, True))


def _batch(cfg: LoopConfig, task: Task, per_epoch: int, step: int, reseeded: list[list[int]]) -> tuple[int, list[int]]:
    """(epoch, global batch) of ``step``: a pure function of (seed, epoch, step), with another
    seed inside each window of steps redone after a rollback (the latest window wins)."""
    epoch, position = divmod(step - 1, per_epoch)
    seed = cfg.seed
    for number, (first, last) in enumerate(reseeded, 1):
        if first <= step <= last:
            seed = cfg.seed + 1_000_003 * number
    return epoch, _epoch_order(task.num_examples, task.batch_size, seed, epoch)[position]


def _resume(cfg: LoopConfig, task: Task, state: LoopState, mirror: RemoteMirror) -> tuple[int | None, str | None]:
    """Load the checkpoint ``cfg.resume`` names into the task and the loop's state; returns its
    step (None: a fresh run) and the metrics history it keeps (None: none). Leftovers of interrupted
    saves are deleted first, and the checkpoints after the step it continues from (here and on
    ``mirror``'s remote_dir). With resume=auto an unusable newest checkpoint (changed bytes, missing
    files) is reported and the previous complete one is used."""
    root = checkpoints_root(cfg.output_dir)
    if is_rank0():
        for partial in remove_partial(root):
            log(f"removed {partial}: an interrupted {'removal' if partial.name.endswith(REMOVING_SUFFIX) else 'save'}")
    if is_rank0():
        for damaged in incomplete_checkpoints(root):
            log(f"{damaged} has no {RUN_STATE_FILE}: incomplete, so not resumed (a save of its step replaces it)")
    candidates = cfg.resume_candidates()
    if not candidates:
        log("starting fresh" + (" (resume=never)" if cfg.resume == "never" else ""))
        why = "another run's (overwrite=true)" if cfg.overwrite else "an earlier attempt's, never completed"
        _remove_beyond(root, 0, why, mirror)
        if is_rank0():
            for name in RUN_OUTPUTS:
                if (path := Path(cfg.output_dir) / name).exists():
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
                    log(f"removed {path}: {why}")
        return None, None
    older = candidates[1:]
    unusable: list[Path] = []  # this output_dir's checkpoints found unusable, newest first

    def load(ckpt: Path) -> dict[str, Any]:
        return load_run_checkpoint(
            ckpt,
            train_states=task.train_states(),
            weights=task.changing_weights(),
            trust_unverified=cfg.trust_unverified_checkpoint,
        )

    for ckpt in candidates:
        try:
            try:
                run_state = load(ckpt)
            except UnusableCheckpoint as err:
                if ckpt.parent != root or not mirror.enabled:
                    raise
                log(f"{err}; trying remote_dir's copy of {ckpt.name}")
                if not mirror.restore(ckpt):
                    raise
                run_state = load(ckpt)
            break
        except FileNotFoundError as err:
            raise ConfigError(f"resume={cfg.resume!r}: {err}") from err
        except UnusableCheckpoint as err:
            if ckpt is candidates[-1]:
                raise ConfigError(
                    f"resume={cfg.resume!r}: {err}" + ("; no older one is usable" if older else "")
                ) from err
            log(f"{err}; trying the previous checkpoint")
            if ckpt.parent == root:
                unusable.append(ckpt)
    task.load_state_dict(run_state["task"])
    state.restore(run_state)
    log(f"resumed from {ckpt} at step {run_state['step']}")
    if is_rank0():  # kept for a look, not deleted: the damage may pass (a file system still syncing)
        for damaged in unusable:
            aside = damaged.with_name(f"{damaged.name}.unusable")
            shutil.rmtree(aside, ignore_errors=True)
            damaged.rename(aside)
            log(f"moved {damaged} aside to {aside}: not resumed, nor pruned; delete it once looked at")
    _remove_beyond(root, int(run_state["step"]), "beyond the step this run continues from", mirror)
    history = ckpt / METRICS_FILE
    return int(run_state["step"]), history.read_text(encoding="utf-8") if history.is_file() else None


def _remove_beyond(root: Path, step: int, why: str, mirror: RemoteMirror) -> None:
    """Rank 0: ``remove_beyond`` here and on remote_dir, each removal logged."""
    if is_rank0():
        for path in remove_beyond(root, step):
            log(f"removed {path}: {why}")
        mirror.remove_beyond(step, why)


def _check_length_after_resume(cfg: LoopConfig, resumed_step: int, total: int) -> None:
    """A run resumed at its last step has nothing left to train: say so. One resumed past it would
    save its final checkpoint under an earlier step than the weights it holds: refuse."""
    length = f"max_steps={cfg.max_steps}" if cfg.max_steps > 0 else f"num_epochs={cfg.num_epochs} ({total} steps)"
    if resumed_step > total:
        raise ConfigError(
            f"{length}, but the checkpoint resumed is at step {resumed_step}, past the run's end: give "
            f"max_steps={resumed_step} or more to continue it, or start a new run (resume=never, or another output_dir)"
        )
    if resumed_step == total:
        log(
            f"the run is complete ({length}, resumed at step {resumed_step}): no step to train; the export "
            "and result.json are written again. Raise max_steps to train on"
        )


def _evaluate(
    evaluate: Callable[[], tuple[dict[str, float], StepRows]],
    step: int,
    sink: Sink,
    judge: Callable[[int, dict[str, float]], dict[str, float]] | None = None,
) -> dict[str, float]:
    """The validation figures; the sinks also get the time they took, the rows it made, and what
    ``judge`` (the health watch) makes of them."""
    start = time.perf_counter()
    figures, rows = evaluate()
    seconds = time.perf_counter() - start
    verdict = judge(step, figures) if judge is not None else {}
    sink.write("validation", step, {**figures, "timing_s/validation": seconds, **verdict})
    for name, file_rows in rows.items():
        sink.write_rows(name, [{"step": step, "split": "validation", **row} for row in file_rows])
    return figures


def _report_curves(out_dir: Path, task: Task) -> None:
    """``curves.png`` and the validation curve as a table, from the run's ``metrics.jsonl``."""
    metrics = out_dir / "metrics.jsonl"
    if not metrics.is_file():  # loggers without jsonl
        return
    train, validation = read_metrics(metrics)
    png = write_curves(train, validation, out_dir / "curves.png", task.headline[0], f"{task.name}: {out_dir}")
    log(f"curves: {png}" if png else "curves.png not drawn: matplotlib is not installed")
    table = validation_table(validation)
    if table:
        log("validation curve:\n" + table)


def _validation_headline(figures: dict[str, float] | None) -> str:
    """``, validation <first figure> <value>`` (e.g. accuracy for rm, nll for sft), if validated."""
    if not figures:
        return ""
    name, value = next(iter(figures.items()))
    return f", validation {name} {value:.4f}"
