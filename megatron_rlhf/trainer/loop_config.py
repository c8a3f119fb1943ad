"""The settings every trainer's run has (``LoopConfig``), apart from the loop (``loop.py``) so that
reading and checking a config imports no megatron-core; finding a checkpoint to resume imports it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_rlhf.config.fields import at_least
from megatron_rlhf.config.run import RunConfig
from megatron_rlhf.data.sampler import num_steps
from megatron_rlhf.metrics.sinks import WandbConfig, logger_errors
from megatron_rlhf.trainer.health import HealthConfig
from megatron_rlhf.training.config import OptimConfig


@dataclasses.dataclass(kw_only=True)
class LoopConfig(RunConfig):
    """What every trainer's run has: its length, logging, the engine's micro-batch budget, export."""

    max_tokens_per_micro_batch: int = 8192
    """Token budget of one micro-batch (rows x longest row) in forward passes and updates."""
    pack_sequences: bool = True
    """Pack several sequences into one row of a micro-batch (each attends only to itself), so that
    short sequences fill the room beside long ones instead of padding. Same results as unpacked;
    reward-model training (chosen/rejected pairs) is never packed."""
    num_epochs: int = 1
    """Passes over the training data (used when max_steps is 0)."""
    max_steps: int = 0
    """If > 0: train exactly this many steps, over as many epochs as that takes (num_epochs ignored)."""
    log_every: int = 10
    """Print a progress line every this many steps (and at the first and last)."""
    loggers: list[str] = dataclasses.field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """Where metrics go: console (progress lines), jsonl (metrics.jsonl, samples.jsonl), tensorboard
    (tb/), wandb (pip install wandb; see wandb.*)."""
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    """The wandb logger's project, run name and mode."""
    save_hf: bool = True
    """Write the trained model to output_dir/hf as an HF checkpoint (from_pretrained loads it)."""
    save_every: int = 0
    """Save a resumable checkpoint under output_dir/checkpoints/step_N every this many steps; 0: only
    at the end (a checkpoint is written when the run completes, unless save_final=false)."""
    save_final: bool = True
    """Write a resumable checkpoint when the run completes. false: only save_every's and a stop's
    (for a benchmark whose optimizer state, e.g. a 7B model's 91 GB, should not go to disk)."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted once a newer one is complete. 0: keep every
    one (verl's default)."""
    async_save: bool = False
    """Write checkpoints in the background (a forked process per checkpoint) while training
    continues; a checkpoint is completed (renamed, named by ``latest``) at the first step boundary
    after every rank's files are written, the next save waits for it, and the run waits for the last.
    Off by default: it holds a host copy of every saved model's weights and optimizer state while
    it writes, and it forks a process that has CUDA and NCCL state (megatron's own async save does
    the same; measured here on CPU only)."""
    resume: str = "auto"
    """auto: continue from the newest complete checkpoint under output_dir/checkpoints, if any;
    never: start fresh; or the path of a checkpoint directory (.../checkpoints/step_N)."""
    remote_dir: str = ""
    """Also keep the checkpoints on remote storage: any fsspec URL (s3://bucket/prefix,
    gs://bucket/prefix, hdfs://namenode:8020/path (untested here), file:///shared/path; a trailing
    slash changes nothing). Each complete checkpoint is uploaded to remote_dir/step_N in the
    background (through step_N.tmp, remote_dir/latest written last), keep_last applies there too,
    and with resume=auto a run whose output_dir holds no checkpoint, or an older one, downloads the
    newest complete one and resumes from it (a requeued job on another node). Checked at start-up by writing a
    probe file. Needs fsspec and the protocol's package (pip install 'megatron-rlhf[remote]':
    s3fs); credentials come from the environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...)."""
    trust_unverified_checkpoint: bool = False
    """Resume (or roll back) from a checkpoint that has no integrity manifest (``manifest.json``),
    e.g. one written before manifests were kept: its files are then read unchecked, and
    dist_checkpointing unpickles its metadata (pickle can run code). Only for checkpoints you trust;
    without it such a checkpoint is refused (resume=auto tries the previous one)."""
    overwrite: bool = False
    """Allow an output_dir that holds another run's files (and no checkpoint to resume) to be
    written over; without it such a run is refused before anything is built. Not needed for the
    same command restarted after it stopped before its first checkpoint (same config.yaml)."""
    profile_steps: list[int] = dataclasses.field(default_factory=list)
    """Steps to run under torch.profiler: each rank writes output_dir/profile/step_N[.rank_R].txt
    (every phase's wall time, GPU busy time, launches, time by kind, costliest kernels), the same
    figures less the kernels as .json, and step_N[.rank_R].trace.json.gz (Perfetto). The profiler
    slows the step it watches."""
    max_bad_steps: int = 3
    """After this many steps in a row whose update was skipped (non-finite loss or gradients), roll
    back to the newest checkpoint and redo the steps since with another data order; a second
    rollback over the same steps (or none to roll back to) stops the run with exit code 3."""
    health: HealthConfig = dataclasses.field(default_factory=HealthConfig)
    """The health watch: validation patience with rollback to the best evaluation's checkpoint and a
    recovery, and per-step collapse signals (``trainer/health.py``; all off by default)."""

    def errors(self) -> list[str]:
        return (
            super().errors()
            + at_least(self, 1, "max_tokens_per_micro_batch", "num_epochs", "log_every", "max_bad_steps")
            + at_least(self, 0, "max_steps", "save_every", "keep_last")
            + logger_errors("loggers", self.loggers, self.wandb)
            + self._resume_errors()
            + self._remote_errors()
            + self._profile_errors()
            + self._rollback_errors()
        )

    def run_steps(self, examples: int, batch_size: int) -> tuple[int, int]:
        """(steps per epoch, the run's steps) over ``examples`` in batches of ``batch_size`` (the
        last short batch of an epoch left for the next)."""
        per_epoch = num_steps(examples, batch_size, drop_last=True)
        return per_epoch, self.max_steps if self.max_steps > 0 else self.num_epochs * per_epoch

    def optimizers(self) -> dict[str, OptimConfig]:
        """The run's optimizers' settings, by their setting's name."""
        return {}

    def optimizer_steps_per_step(self) -> int:
        """Optimizer steps (learning-rate schedule steps) each step of the run makes."""
        return 1

    def without_effect(self) -> dict[str, str]:
        """The settings this configuration reads nothing of (a dotted key, or a section), each with
        why: a value given for one is reported at start-up (``ConfigSources.report``), where it
        would otherwise change nothing without a word."""
        unread = {}
        if self.max_steps > 0:
            unread["num_epochs"] = f"max_steps={self.max_steps} sets the run's length"
            if self.save_every > self.max_steps:
                unread["save_every"] = f"the run ends at max_steps={self.max_steps}, before the first save"
        for name, optim in self.optimizers().items():
            if optim.decay_style == "constant":
                why = f"{name}.decay_style=constant: the learning rate stays at lr after the warm-up"
                unread |= {f"{name}.min_lr": why, f"{name}.decay_steps": why}
        return unread

    def _rollback_errors(self) -> list[str]:
        """A health rollback goes back to the best evaluation's checkpoint (pruning keeps it), else to
        the newest one from before the signal's ``signal_steps`` in a row: keep_last must reach back
        that far, or that checkpoint is pruned by the time the signal acts."""
        health = self.health
        if not health.roll_back_on or self.save_every == 0 or self.keep_last == 0:
            return []
        needed = -(-health.signal_steps // self.save_every) + 1
        if self.keep_last >= needed:
            return []
        return [
            f"keep_last={self.keep_last} keeps {self.keep_last} checkpoints, {self.save_every} steps apart "
            f"(save_every), and health.roll_back_on={health.roll_back_on} goes back past health.signal_steps="
            f"{health.signal_steps} steps in a row: set keep_last >= {needed} (0 keeps all)"
        ]

    def _profile_errors(self) -> list[str]:
        if any(s < 1 for s in self.profile_steps):
            return [f"profile_steps={self.profile_steps}: steps count from 1"]
        past = [s for s in self.profile_steps if self.max_steps and s > self.max_steps]
        return [f"profile_steps={self.profile_steps}: {past} come after max_steps={self.max_steps}"] if past else []

    def length_errors(self, longest: int, longest_is: str) -> list[str]:
        """A micro-batch holds at least one whole sequence: the budget must take the longest
        (``longest_is`` names the settings that make it)."""
        if self.max_tokens_per_micro_batch >= longest:
            return []
        return [
            f"max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} is below the longest sequence, "
            f"{longest_is} = {longest} tokens, and a micro-batch holds at least one: raise it to {longest} or more"
        ]

    def _resume_errors(self) -> list[str]:
        if self.resume in ("auto", "never") or Path(self.resume).is_dir():
            return []
        why = "does not exist" if not Path(self.resume).exists() else "is not a directory"
        return [
            f"resume={self.resume!r} must be auto, never, or a checkpoint directory (.../checkpoints/step_N); "
            f"{self.resume!r} {why}"
        ]

    def _remote_errors(self) -> list[str]:
        if not self.remote_dir:
            return []
        protocol, sep, rest = self.remote_dir.partition("://")
        if not sep or not protocol.isidentifier() or not rest.strip("/"):
            return [
                f"remote_dir={self.remote_dir!r} must be a URL with a protocol and a path: s3://bucket/prefix, "
                "gs://bucket/prefix, hdfs://namenode:8020/path or file:///shared/path"
            ]
        if protocol == "file" and not rest.startswith("/"):
            return [
                f"remote_dir={self.remote_dir!r}: a file:// URL takes an absolute path, file:///shared/path (this "
                "one would be relative to each node's working directory, which a requeued job may not see)"
            ]
        return []

    def resume_from(self) -> Path | None:
        """The checkpoint this run continues from (None: a fresh run)."""
        from megatron_rlhf.checkpoint.run_checkpoint import checkpoints_root, newest_checkpoint

        if self.resume == "never":
            return None
        if self.resume == "auto":
            return newest_checkpoint(checkpoints_root(self.output_dir))
        return Path(self.resume)

    def resume_candidates(self) -> list[Path]:
        """The checkpoints a resume tries, in order: ``resume_from``, then with resume=auto the
        older complete ones (a checkpoint that turns out unusable falls back to the previous)."""
        from megatron_rlhf.checkpoint.run_checkpoint import checkpoints_root, complete_checkpoints

        first = self.resume_from()
        if first is None:
            return []
        if self.resume != "auto":
            return [first]
        older = [ckpt for ckpt in reversed(complete_checkpoints(checkpoints_root(self.output_dir))) if ckpt != first]
        return [first, *older]


def eval_every_errors(eval_every: int, validation: list[str]) -> list[str]:
    """``eval_every`` evaluates the validation set: without one it would do nothing, unseen."""
    if eval_every and not validation:
        return [
            f"eval_every={eval_every} evaluates data.validation, which is empty: give validation files, or eval_every=0"
        ]
    return []
