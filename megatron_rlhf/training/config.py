"""The training settings a config holds (the optimizer's, the PPO losses'), apart from the code that
uses them so that reading and checking a config imports no megatron-core."""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_rlhf.algorithms import AGG_MODES, KL_ESTIMATORS
from megatron_rlhf.config.fields import at_least, check_on_init


@dataclasses.dataclass(kw_only=True)
class OptimConfig:
    """Adam with warmup and decay; the same fields for actor, critic and the SFT/RM trainers."""

    lr: float = 1e-6
    min_lr: float = 0.0
    """Floor of the decay (cosine/linear)."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay; 0.01 as in verl and torch's AdamW."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    warmup_steps: int = 0
    """Optimizer steps over which the learning rate rises from 0 to lr."""
    decay_style: Literal["constant", "cosine", "linear"] = "constant"
    """constant, cosine or linear (after warmup)."""
    decay_steps: int | None = None
    """Optimizer steps from the start to the end of the decay (to min_lr), warm-up included; null:
    the run's optimizer steps (its steps x the optimizer steps of each), resolved at the start and
    recorded in config.yaml, as Megatron and verl do. A PPO step makes ppo_epochs x (rollout /
    mini_batch_size) optimizer steps."""
    distributed_optimizer: bool = True
    """Shard optimizer states over data-parallel ranks (ZeRO-1)."""
    cpu_offload_fraction: float = 0.0
    """Share of the optimizer state (by parameter count, whole parameters) kept in host memory and
    updated by a CPU Adam: 0 keeps it all on the device, 1 all on the host. Needs
    distributed_optimizer (megatron supports the offload only there)."""

    def __post_init__(self) -> None:
        check_on_init(self)

    def errors(self) -> list[str]:
        errors = at_least(self, 0, "warmup_steps", "clip_grad")
        if self.decay_steps is not None:
            errors += at_least(self, 1, "decay_steps")
        if self.decay_style != "constant" and self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            errors.append(
                f"decay_steps={self.decay_steps} must be above warmup_steps={self.warmup_steps}: the decay "
                "counts from step 0, warm-up included"
            )
        if not self.lr > 0:
            errors.append(f"lr={self.lr} must be > 0")
        elif not 0 <= self.min_lr <= self.lr:
            errors.append(f"min_lr={self.min_lr} must be in [0, lr={self.lr}]")
        if not 0.0 <= self.cpu_offload_fraction <= 1.0:
            errors.append(f"cpu_offload_fraction={self.cpu_offload_fraction} must be in [0, 1]")
        elif self.cpu_offload_fraction > 0 and not self.distributed_optimizer:
            errors.append(f"cpu_offload_fraction={self.cpu_offload_fraction} needs distributed_optimizer=true")
        return errors

    def resolve_length(self, name: str, run_steps: int, per_step: int) -> list[str]:
        """Set a null ``decay_steps`` to the run's optimizer steps (``run_steps`` x ``per_step``); the
        lines for the log: the resolved length, and where the schedule and the run disagree."""
        total = run_steps * per_step
        count = f"the run's {total} optimizer steps ({run_steps} steps x {per_step})"
        lines = []
        if self.decay_steps is None:
            self.decay_steps = max(total, self.warmup_steps + 1)
            if self.decay_style != "constant":
                lines.append(f"{name}.decay_steps: {count}")
        elif self.decay_style != "constant" and self.decay_steps < total:
            lines.append(
                f"warning: {name}.decay_steps={self.decay_steps} ends the {self.decay_style} decay before the run "
                f"ends: the learning rate stays at {name}.min_lr={self.min_lr} for the last "
                f"{total - self.decay_steps} of {count}"
            )
        if self.warmup_steps >= total:
            lines.append(
                f"warning: {name}.warmup_steps={self.warmup_steps} is not over within {count}: the learning "
                f"rate never reaches {name}.lr={self.lr}"
            )
        return lines


@dataclasses.dataclass(kw_only=True)
class PPOLossConfig:
    """Actor and critic loss settings (see ``megatron_rlhf.algorithms.losses``)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    """Asymmetric ratio clip [1 - clip_low, 1 + clip_high] (clip-higher, DAPO)."""
    dual_clip_c: float | None = 3.0
    """Dual-clip bound c > 1 for negative advantages (Ye et al. 2020); None disables it. 3.0 is
    verl's clip_ratio_c (always on there)."""
    value_clip: float | None = 0.5
    """Clip of the value update around the old values (verl's cliprange_value, 0.5); None disables it."""
    entropy_coef: float = 0.0
    kl_loss_coef: float = 0.0
    """KL to the reference policy as a loss term (GRPO style); 0 when KL is a reward penalty."""
    kl_estimator: str = "low_var_kl"
    """KL estimator of the KL loss term (k1, k2, k3 / low_var_kl, abs, ...)."""
    agg_mode: str = "token-mean"
    """How per-token losses become one number (token-mean, seq-mean-token-sum, seq-mean-token-mean,
    seq-mean-token-sum-norm)."""
    loss_scale_factor: int | None = None
    """seq-mean-token-sum-norm only, and required there: the constant each sequence's token sum is
    divided by (Dr. GRPO; verl defaults it to the padded response length, here set it to
    rollout.sampling.max_new_tokens). Fixed, so the loss does not depend on a batch's padding; an
    integer because megatron receives loss denominators as integers."""

    def __post_init__(self) -> None:
        check_on_init(self)

    def errors(self) -> list[str]:
        errors = KL_ESTIMATORS.field_errors("kl_estimator", self.kl_estimator) + AGG_MODES.field_errors(
            "agg_mode", self.agg_mode
        )
        errors += at_least(self, 0, "clip_low", "clip_high", "entropy_coef", "kl_loss_coef")
        if self.clip_low >= 1:
            errors.append(f"clip_low={self.clip_low} must be < 1: the ratio's lower clip is 1 - clip_low, above 0")
        for name in ("dual_clip_c", "value_clip", "loss_scale_factor"):
            low = 1 if name == "dual_clip_c" else 0
            value = getattr(self, name)
            if value is not None and not value > low:
                errors.append(f"{name}={value} must be > {low} (or null: off)")
        if self.agg_mode in AGG_MODES and AGG_MODES.info(self.agg_mode).scale_factor and self.loss_scale_factor is None:
            errors.append(f"agg_mode={self.agg_mode} needs loss_scale_factor (e.g. rollout.sampling.max_new_tokens)")
        return errors
