"""What the SFT and reward-model trainers share: config fields, up-front checks, the tokenizer
choice, the metrics sinks (stdout, ``metrics.jsonl``, TensorBoard) and the training loop.

The loop is one SPMD program: every rank runs it; each data-parallel rank trains on its own slice
of every global batch (``epoch_batches``), the engine (``train_step``) reduces gradients and
metrics, and only global rank 0 prints and writes files.

Batches are drawn with ``drop_last``: an epoch is ``len(train) // global_batch_size`` steps and the
few examples left over by each epoch's shuffle wait for another epoch (the count is logged).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlhf.config.loader import ConfigError, to_yaml
from megatron_rlhf.config.schema import ModelConfig
from megatron_rlhf.config.validate import layout_errors
from megatron_rlhf.data import Tokenizer, epoch_batches, num_steps
from megatron_rlhf.data.builtin import resolve_data_paths
from megatron_rlhf.data.tokenizer import resolve_tokenizer
from megatron_rlhf.engine.optim import OptimConfig, TrainState, make_train_state
from megatron_rlhf.engine.schedule import Batch, LossFn
from megatron_rlhf.engine.train import train_step
from megatron_rlhf.metrics.log import format_eta, is_rank0, log, timed
from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.models.builder import DTYPES, resolve_dtype
from megatron_rlhf.models.hf_checkpoint import save_hf_checkpoint, side_files_in
from megatron_rlhf.models.roles import RoleModel, build_role
from megatron_rlhf.models.sources import architecture_of, local_dir
from megatron_rlhf.parallel.distributed import DEVICES, DistEnv, seed_everything

ON_PROBLEM = ("error", "skip")


# --------------------------------------------------------------------------- config


@dataclasses.dataclass(kw_only=True)
class DataConfigBase:
    """Dataset files and how rows become token sequences (fields shared by SFT and RM)."""

    train: list[str] = dataclasses.field(default_factory=list)
    """Training data: .jsonl / .parquet files or directories of them (e.g. data.train=[a.jsonl]),
    or built-in sets (builtin:arithmetic-sft)."""
    validation: list[str] = dataclasses.field(default_factory=list)
    """Validation data, same formats; empty: no validation."""
    max_length: int = 1024
    """Longest sequence in tokens (prompt + response + EOS); longer rows follow ``on_overlong``."""
    on_overlong: str = "error"
    """error: stop naming the file and row; skip: drop such rows and count them in the data report."""
    on_invalid: str = "error"
    """The same for rows with a bad value (null, empty, wrong type, token id out of range)."""
    add_bos: bool = False
    """Prepend the tokenizer's BOS id to every sequence (for text that does not already hold it)."""
    prompt_key: str = "prompt"
    """Column of the prompt text (or pre-tokenized ``<key>_ids``)."""


@dataclasses.dataclass(kw_only=True)
class TrainerConfig:
    """Fields shared by ``megatron-rlhf sft`` and ``megatron-rlhf rm``."""

    device: str = "auto"
    """auto (cuda when a GPU is visible, else cpu), cuda, or cpu (gloo CPU mode)."""
    dtype: str = "auto"
    """Parameter dtype: auto (bf16 on GPU, fp32 on CPU), bf16, fp16 or fp32."""
    seed: int = 1234
    """Seeds the data order (per epoch) and everything random."""
    output_dir: str = "runs/train"
    """Where config.yaml, metrics.jsonl, result.json, tb/ (TensorBoard) and hf/ (the model) go."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The model trained and its TP/PP layout (dp = world_size / (tp * pp))."""
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Adam, warmup and LR decay."""
    global_batch_size: int = 64
    """Examples (SFT sequences or preference pairs) per optimizer step, over all DP ranks; a
    multiple of the data-parallel size."""
    max_tokens_per_micro_batch: int = 8192
    """Token budget of one micro-batch (rows x longest row); gradients accumulate over micro-batches."""
    num_epochs: int = 1
    """Passes over the training data (used when max_steps is 0)."""
    max_steps: int = 0
    """If > 0: train exactly this many steps, over as many epochs as that takes (num_epochs ignored)."""
    log_every: int = 10
    """Print a progress line every this many steps (and at the last step)."""
    eval_every: int = 0
    """If > 0 and validation data is given: evaluate every this many steps (always at the end)."""
    save_hf: bool = True
    """Write the trained model to output_dir/hf as an HF checkpoint (from_pretrained loads it)."""


def config_errors(cfg: TrainerConfig, world_size: int, *, score_head: bool) -> tuple[list[str], Architecture | None]:
    """Every problem of ``cfg`` in a world of ``world_size`` ranks, and the model's architecture."""
    errors: list[str] = []
    if cfg.device not in DEVICES:
        errors.append(f"device={cfg.device!r} must be one of {list(DEVICES)}")
    if cfg.dtype != "auto" and cfg.dtype not in DTYPES:
        errors.append(f"dtype={cfg.dtype!r} must be one of {['auto', *DTYPES]}")
    arch = None
    model = cfg.model
    try:
        arch = architecture_of(model.path)
    except (ValueError, FileNotFoundError) as err:
        errors.append(f"model.path={model.path!r}: {err}")
    if arch is not None:
        errors += [f"{e} (model {model.path})" for e in layout_errors("model", model.tp, model.pp, arch, world_size)]
        if arch.score_head != score_head:
            need = "a *ForSequenceClassification (score head)" if score_head else "a *ForCausalLM"
            errors.append(f"model.path={model.path!r} is a {arch.hf_class_name}; this trainer needs {need} model")
    for name in ("global_batch_size", "max_tokens_per_micro_batch", "num_epochs", "log_every"):
        if getattr(cfg, name) < 1:
            errors.append(f"{name}={getattr(cfg, name)} must be >= 1")
    for name in ("max_steps", "eval_every"):
        if getattr(cfg, name) < 0:
            errors.append(f"{name}={getattr(cfg, name)} must be >= 0 (0: off)")
    if model.tp >= 1 and model.pp >= 1 and world_size % (model.tp * model.pp) == 0 and cfg.global_batch_size >= 1:
        dp = world_size // (model.tp * model.pp)
        if cfg.global_batch_size % dp:
            errors.append(
                f"global_batch_size={cfg.global_batch_size} must be divisible by the data-parallel size "
                f"dp={dp} (world size {world_size} / (model.tp={model.tp} * model.pp={model.pp}))"
            )
    data = cfg.data  # type: ignore[attr-defined]
    if not data.train:
        errors.append("data.train is empty: give the training files, e.g. data.train=[path/to/train.jsonl]")
    if data.max_length < 2:
        errors.append(f"data.max_length={data.max_length} must be >= 2")
    return errors + on_problem_errors(data), arch


def on_problem_errors(data: Any) -> list[str]:
    """``data.on_overlong`` / ``data.on_invalid`` must name a known policy (every trainer's data has both)."""
    return [f"data.{name}={getattr(data, name)!r} must be one of {list(ON_PROBLEM)}"
            for name in ("on_overlong", "on_invalid") if getattr(data, name) not in ON_PROBLEM]  # fmt: skip


def check_config(cfg: TrainerConfig, world_size: int, *, score_head: bool) -> Architecture:
    """Raise ``ConfigError`` listing every problem at once; returns the model's architecture."""
    errors, arch = config_errors(cfg, world_size, score_head=score_head)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    assert arch is not None
    return arch


# --------------------------------------------------------------------------- tokenizer


def with_token_ids(arch: Architecture, tokenizer: Tokenizer) -> Architecture:
    """The architecture with the tokenizer's special ids in its HF config where it names none
    (an exported reward model needs ``pad_token_id`` for batched scoring in transformers)."""
    hf_config = dict(arch.hf_config)
    for key, value in (("pad_token_id", tokenizer.pad_id), ("bos_token_id", tokenizer.bos_id),
                       ("eos_token_id", tokenizer.eos_id)):  # fmt: skip
        if hf_config.get(key) is None and value is not None:
            hf_config[key] = value
    return dataclasses.replace(arch, hf_config=hf_config)


# --------------------------------------------------------------------------- metrics


class MetricsSink:
    """metrics.jsonl, TensorBoard events and other JSONL row files (global rank 0 only; no-ops elsewhere)."""

    def __init__(self, out_dir: Path) -> None:
        self.enabled = is_rank0()
        self.out_dir = out_dir
        self._jsonl = None
        self._tb = None
        self._row_files: dict[str, Any] = {}
        if self.enabled:
            from torch.utils.tensorboard import SummaryWriter

            out_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = (out_dir / "metrics.jsonl").open("w", encoding="utf-8")
            self._tb = SummaryWriter(log_dir=str(out_dir / "tb"))

    def write(self, split: str, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"split": split, "step": step, **values}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for name, value in values.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(f"{split}/{name}", value, step)

    def write_rows(self, name: str, rows: list[dict[str, Any]]) -> None:
        """Append rows to ``out_dir/<name>.jsonl`` (made on first use)."""
        if not self.enabled or not rows:
            return
        if name not in self._row_files:
            self._row_files[name] = (self.out_dir / f"{name}.jsonl").open("w", encoding="utf-8")
        handle = self._row_files[name]
        handle.write("".join(json.dumps(row) + "\n" for row in rows))
        handle.flush()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()
            for handle in self._row_files.values():
                handle.close()


def write_run_files(cfg: Any, out_dir: Path) -> None:
    if is_rank0():
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(to_yaml(cfg))


# --------------------------------------------------------------------------- evaluation helpers


def dp_shard(num_examples: int, dp_rank: int, dp_size: int) -> tuple[list[int], list[bool]]:
    """This DP rank's examples of an evaluation set: rows r, r+dp, ..., padded with copies of
    example 0 (``real`` False) so every rank runs the same number of collectives."""
    mine = list(range(dp_rank, num_examples, dp_size))
    per_rank = -(-num_examples // dp_size)
    real = [True] * len(mine) + [False] * (per_rank - len(mine))
    return mine + [0] * (per_rank - len(mine)), real


def reduce_over_model(role: RoleModel, values: list[float], device: torch.device) -> list[float]:
    """Sum per-rank figures over DP (last pipeline stage holds them), then share along the pipeline;
    every rank gets the totals. TP ranks hold identical figures and are not summed."""
    pg = role.groups.pg_collection
    totals = torch.tensor(values if role.groups.is_last_stage else [0.0] * len(values), dtype=torch.float64,
                          device=device)  # fmt: skip
    dist.all_reduce(totals, group=pg.dp)
    dist.all_reduce(totals, group=pg.pp)
    return totals.tolist()


# --------------------------------------------------------------------------- the loop


@dataclasses.dataclass
class TrainTask:
    """What differs between SFT and RM: how indices become a batch, the loss, how to evaluate."""

    name: str
    num_examples: int
    tokens_of: Callable[[Sequence[int]], int]
    """Real tokens of a set of examples (for tokens/s)."""
    make_batch: Callable[[Sequence[int]], Batch]
    loss_fn: LossFn
    group_size: int
    evaluate: Callable[[], dict[str, float]] | None
    """Validation figures (identical on every rank), or None without validation data."""
    headline: tuple[str, ...] = ()
    """Loss-function metrics shown on the progress line, besides loss/lr/grad_norm."""


def plan_steps(cfg: TrainerConfig, num_examples: int) -> tuple[int, int]:
    """(steps per epoch, total steps)."""
    per_epoch = num_steps(num_examples, cfg.global_batch_size, drop_last=True)
    if per_epoch == 0:
        raise ConfigError(f"the training set has {num_examples} examples, fewer than "
                          f"global_batch_size={cfg.global_batch_size}: not one full step")
    total = cfg.max_steps if cfg.max_steps > 0 else cfg.num_epochs * per_epoch
    return per_epoch, total


def train_loop(cfg: TrainerConfig, state: TrainState, task: TrainTask, sink: MetricsSink,
               device: torch.device) -> dict[str, Any]:  # fmt: skip
    """Run the configured number of steps; returns a summary (first/last loss, last validation)."""
    groups = state.role.groups
    dp, dp_rank = groups.layout.dp, groups.dp_rank
    per_epoch, total = plan_steps(cfg, task.num_examples)
    left_over = task.num_examples - per_epoch * cfg.global_batch_size
    log(f"{task.name}: {task.num_examples} training examples, global batch {cfg.global_batch_size} "
        f"({cfg.global_batch_size // dp} per DP rank x {dp}): {per_epoch} steps per epoch"
        + (f" ({left_over} examples of each epoch's shuffle left for later epochs)" if left_over else "")
        + f"; {total} steps ({total / per_epoch:.2f} epochs)")  # fmt: skip
    summary: dict[str, Any] = {"steps": total, "steps_per_epoch": per_epoch}
    step, epoch = 0, 0
    window_tokens, window_start = 0, time.perf_counter()
    run_start = window_start
    last_eval_step = -1
    while step < total:
        mine = epoch_batches(task.num_examples, cfg.global_batch_size, dp_rank, dp, cfg.seed, epoch, True)
        everyone = epoch_batches(task.num_examples, cfg.global_batch_size, 0, 1, cfg.seed, epoch, True)
        for indices, global_indices in zip(mine, everyone):
            if step >= total:
                break
            batch = task.make_batch(indices)
            tokens = task.tokens_of(global_indices)
            start = time.perf_counter()
            metrics = train_step(state, batch, task.loss_fn, max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
                                 group_size=task.group_size)  # fmt: skip
            elapsed = time.perf_counter() - start
            step += 1
            window_tokens += tokens
            record = {"epoch": epoch, **metrics, "tokens": tokens, "tokens_per_s": tokens / max(elapsed, 1e-9)}
            sink.write("train", step, record)
            if step == 1:
                summary["first_loss"] = metrics["loss"]
            summary["last_loss"] = metrics["loss"]
            if step % cfg.log_every == 0 or step == total or step == 1:
                now = time.perf_counter()
                rate = window_tokens / max(now - window_start, 1e-9)
                eta = (now - run_start) / step * (total - step)
                extra = "".join(f" | {name} {metrics[name]:.4f}" for name in task.headline if name in metrics)
                skipped = " | update skipped (inf/nan grads)" if metrics.get("update_skipped") else ""
                log(f"step {step}/{total} | epoch {epoch} | loss {metrics['loss']:.4f}{extra} | "
                    f"lr {metrics['lr']:.3e} | grad_norm {metrics['grad_norm']:.3f} | "
                    f"{rate:,.0f} tokens/s | eta {format_eta(eta)}{skipped}")  # fmt: skip
                window_tokens, window_start = 0, now
            if task.evaluate is not None and cfg.eval_every and step % cfg.eval_every == 0 and step < total:
                summary["validation"] = _evaluate(task, step, sink)
                last_eval_step = step
        epoch += 1
    if task.evaluate is not None and last_eval_step != total:
        summary["validation"] = _evaluate(task, total, sink)
    summary["train_seconds"] = time.perf_counter() - run_start
    return summary


def _evaluate(task: TrainTask, step: int, sink: MetricsSink) -> dict[str, float]:
    start = time.perf_counter()
    figures = task.evaluate()
    sink.write("validation", step, figures)
    shown = " | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
    log(f"validation at step {step}: {shown} ({time.perf_counter() - start:.1f}s)")
    return figures


@dataclasses.dataclass
class TrainerRun:
    """What ``set_up_run`` prepares for a trainer: the model, its training state, the data."""

    arch: Architecture
    tokenizer: Tokenizer
    train: Any
    validation: Any | None
    role: RoleModel
    state: TrainState
    out_dir: Path


def set_up_run(
    cfg: TrainerConfig, env: DistEnv, *, name: str, role: str, score_head: bool,
    load: Callable[[list[str], Tokenizer, Any, str], Any],
) -> TrainerRun:  # fmt: skip
    """Check the config, seed, write config.yaml, read the train/validation data with
    ``load(paths, tokenizer, cfg.data, "train" | "validation")``, build the model and its state."""
    arch = check_config(cfg, env.world_size, score_head=score_head)
    seed_everything(cfg.seed)
    dtype = resolve_dtype(cfg.dtype, env.device)
    out_dir = Path(cfg.output_dir)
    write_run_files(cfg, out_dir)
    log(f"{name}: world {env.world_size} on {env.device.type}, dtype {str(dtype).removeprefix('torch.')}, "
        f"model {cfg.model.path}")  # fmt: skip
    tokenizer = resolve_tokenizer(local_dir(cfg.model.path), arch, cfg.model.path)
    train = load(resolve_data_paths(cfg.data.train), tokenizer, cfg.data, "train")
    validation = (load(resolve_data_paths(cfg.data.validation), tokenizer, cfg.data, "validation")
                  if cfg.data.validation else None)  # fmt: skip
    with timed("build+load model", env.device):
        model = build_role(role, cfg.model, arch, world_size=env.world_size, dtype=dtype, device=env.device)
        state = make_train_state(model, cfg.optim)
    log(f"model {arch.hf_class_name} {arch.num_layers} layers, {model.groups.layout}, "
        f"{sum(p.numel() for p in model.model.parameters()) / 1e6:.2f}M parameters on rank 0, from {model.source}")
    return TrainerRun(arch, tokenizer, train, validation, model, state, out_dir)


def run_task(cfg: TrainerConfig, run: TrainerRun, task: TrainTask, device: torch.device) -> dict[str, Any]:
    """Train (metrics to stdout, metrics.jsonl and TensorBoard), then export and write result.json."""
    sink = MetricsSink(run.out_dir)
    try:
        summary = train_loop(cfg, run.state, task, sink, device)
    finally:
        sink.close()
    finish(cfg, run.role, with_token_ids(run.arch, run.tokenizer), run.out_dir, summary)
    return summary


def finish(cfg: TrainerConfig, role: RoleModel, arch: Architecture, out_dir: Path, summary: dict[str, Any]) -> None:
    """Export the model (collective) and write result.json."""
    if cfg.save_hf:
        hf_dir = out_dir / "hf"
        start = time.perf_counter()
        save_hf_checkpoint(role.model, arch, role.groups, hf_dir, side_files_from=role.source)
        copied = side_files_in(role.source)
        log(f"saved HF checkpoint ({arch.hf_class_name}) to {hf_dir} in {time.perf_counter() - start:.1f}s; "
            + (f"copied {', '.join(copied)} from {role.source}" if copied else
               "no tokenizer files to copy (the model ships none: byte tokenizer)"))  # fmt: skip
        summary["hf_dir"] = str(hf_dir)
    if is_rank0():
        (out_dir / "result.json").write_text(json.dumps(summary, indent=2) + "\n")
