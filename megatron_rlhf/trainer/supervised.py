"""What the SFT and reward-model trainers share: their config, up-front checks, set-up (the start
every trainer makes, ``trainer/start.py``, then the model and its training state) and the
supervised step the loop calls.

Each data-parallel rank trains on its own slice of every global batch; the engine (``train_step``)
reduces gradients and metrics over the model's data-parallel group.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlhf.data import Tokenizer
from megatron_rlhf.data.builtin import resolve_data_paths
from megatron_rlhf.metrics.log import log
from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.models.roles import RoleModel
from megatron_rlhf.parallel.distributed import DistEnv
from megatron_rlhf.trainer.loop import RunClaim, StepRows
from megatron_rlhf.trainer.start import RunModel, start_run
from megatron_rlhf.trainer.supervised_config import SupervisedConfig, check_config
from megatron_rlhf.training.optim import TrainState, make_train_state, set_learning_rate
from megatron_rlhf.training.schedule import Batch, LossFn
from megatron_rlhf.training.train import train_step


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
    totals = torch.tensor(
        values if role.groups.is_last_stage else [0.0] * len(values), dtype=torch.float64, device=device
    )
    dist.all_reduce(totals, group=pg.dp)
    dist.all_reduce(totals, group=pg.pp)
    return totals.tolist()


@dataclasses.dataclass
class SupervisedRun:
    """What ``set_up_run`` prepares for a trainer: the model, its training state, the data."""

    tokenizer: Tokenizer
    train: Any
    validation: Any | None
    state: TrainState
    claim: RunClaim
    """The run's claim on its output_dir, for ``run_loop``."""

    @property
    def role(self) -> RoleModel:
        return self.state.role


def set_up_run(
    cfg: SupervisedConfig,
    env: DistEnv,
    *,
    name: str,
    role: str,
    score_head: bool,
    load: Callable[[list[str], Tokenizer, Any, str], Any],
    arch: Architecture | None = None,
) -> SupervisedRun:
    """Check the config (unless ``arch``, what ``check_config`` returned, says it was), make the run's
    start (``start_run``: reading the train/validation data with ``load(paths, tokenizer, cfg.data,
    "train" | "validation")``), build the model and its state."""
    if arch is None:
        arch = check_config(cfg, env.world_size, score_head=score_head)
    data = cfg.data  # type: ignore[attr-defined]

    def load_data(tokenizer: Tokenizer) -> tuple[Any, Any | None]:
        train = load(resolve_data_paths(data.train), tokenizer, data, "train")
        validation = (
            load(resolve_data_paths(data.validation), tokenizer, data, "validation") if data.validation else None
        )
        return train, validation

    start, (train, validation) = start_run(
        cfg,
        env,
        name=name,
        models={role: RunModel(cfg.model, arch)},
        tokenizer_of=role,
        load_data=load_data,
        batch_setting="global_batch_size",
    )
    model = start.build(role)
    state = make_train_state(model, cfg.optim)
    params = list(model.model.parameters())
    trained = sum(p.numel() for p in params if p.requires_grad)
    lora = cfg.model.lora
    adapters = f" (LoRA rank {lora.rank}: {trained / 1e6:.3f}M trained)" if lora.enabled else ""
    log(
        f"model {arch.hf_class_name} {arch.num_layers} layers, {model.groups.layout}, "
        f"{sum(p.numel() for p in params) / 1e6:.2f}M parameters{adapters} on rank 0, from {model.source}"
    )
    return SupervisedRun(start.tokenizer, train, validation, state, start.claim)


@dataclasses.dataclass(kw_only=True)
class SupervisedTask:
    """The loop's ``Task`` for SFT and RM: one optimizer step on this rank's share of the batch."""

    name: str
    cfg: SupervisedConfig
    run: SupervisedRun
    tokens_of: Callable[[Sequence[int]], int]
    """Real tokens of a set of examples (for tokens/s)."""
    make_batch: Callable[[Sequence[int]], Batch]
    loss_fn: LossFn
    group_size: int
    figures: Callable[[], dict[str, float]] | None
    """Validation figures (identical on every rank), or None without validation data."""
    extra_headline: tuple[str, ...] = ()
    """Loss-function metrics shown on the progress line, besides loss/lr/grad_norm."""
    headline: tuple[str, str] = ("loss", "loss")
    _window_tokens: int = 0
    _window_start: float = dataclasses.field(default_factory=time.perf_counter)
    _epoch: int = 0

    @property
    def num_examples(self) -> int:
        return len(self.run.train)

    @property
    def batch_size(self) -> int:
        return self.cfg.global_batch_size

    @property
    def batch_description(self) -> str:
        dp = self.run.role.groups.layout.dp
        return f"training examples, global batch {self.batch_size} ({self.batch_size // dp} per DP rank x {dp})"

    @property
    def layouts(self) -> str:
        return f"{self.run.role.role} {self.run.role.groups.layout}"

    @property
    def evaluate(self) -> Callable[[], tuple[dict[str, float], StepRows]] | None:
        figures = self.figures
        return None if figures is None else lambda: (figures(), {})

    @property
    def eval_every(self) -> int:
        return self.cfg.eval_every

    @property
    def eval_before_train(self) -> bool:
        return self.cfg.eval_before_train

    @property
    def export_role(self) -> RoleModel:
        return self.run.role

    @property
    def tokenizer(self) -> Tokenizer:
        return self.run.tokenizer

    def step(self, step: int, epoch: int, indices: list[int]) -> tuple[dict[str, float], StepRows]:
        groups = self.run.role.groups
        share = len(indices) // groups.layout.dp
        mine = indices[groups.dp_rank * share : (groups.dp_rank + 1) * share]
        tokens = self.tokens_of(indices)
        start = time.perf_counter()
        metrics = train_step(
            self.run.state,
            self.make_batch(mine),
            self.loss_fn,
            max_tokens_per_micro_batch=self.cfg.max_tokens_per_micro_batch,
            group_size=self.group_size,
            pack_sequences=self.cfg.pack_sequences,
        )
        elapsed = time.perf_counter() - start
        self._window_tokens += tokens
        self._epoch = epoch
        return {**metrics, "tokens": tokens, "tokens_per_s": tokens / max(elapsed, 1e-9)}, {}

    def train_states(self) -> dict[str, TrainState]:
        return {self.run.role.role: self.run.state}

    def changing_weights(self) -> dict[str, RoleModel]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Nothing beyond the model: the step (kept by the loop) is the data position."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def recover(self, lr_scale: float, kl_scale: float) -> None:
        """The learning rate at the config's times ``lr_scale`` (no KL term here)."""
        set_learning_rate(self.run.state, self.cfg.optim, lr_scale)

    def progress(self, metrics: dict[str, float]) -> str:
        """Loss, the loss function's headline figures, lr, gradient norm and the tokens/s since the
        previous progress line."""
        now = time.perf_counter()
        rate = self._window_tokens / max(now - self._window_start, 1e-9)
        self._window_tokens, self._window_start = 0, now
        extra = "".join(f" | {name} {metrics[name]:.4f}" for name in self.extra_headline if name in metrics)
        skipped = " | update skipped (inf/nan grads)" if metrics.get("update_skipped") else ""
        return (
            f"epoch {self._epoch} | loss {metrics['loss']:.4f}{extra} | lr {metrics['lr']:.3e} | "
            f"grad_norm {metrics['grad_norm']:.3f} | {rate:,.0f} tokens/s{skipped}"
        )
