"""LoRA settings of a trained model (``actor.lora``, ``critic.lora``, sft's/rm's ``model.lora``) and
the PEFT module names they accept; no megatron import, so that a config is checked before it loads.

The names are PEFT's (the HF projections); ``models/lora.py`` maps each onto its rows or columns of
megatron's fused linears.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from megatron_rlhf.config.fields import check_on_init, did_you_mean, field_default

if TYPE_CHECKING:
    from megatron_rlhf.models.architecture import Architecture

ALL_LINEAR = "all-linear"
TARGET_LINEARS = {
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}
"""Each PEFT target name and the megatron linear that holds its weight (q/k/v and gate/up share
one fused linear; the LM head and the score head are never adapted, as in PEFT's all-linear)."""


@dataclasses.dataclass(frozen=True)
class TargetShape:
    """One PEFT target's full weight shape (PEFT's A is (rank, in_features), B (out_features, rank))
    and how tensor parallelism splits its adapter."""

    in_features: int
    out_features: int
    input_split: bool
    """Row-parallel (o_proj, down_proj): A split by input columns, B whole; else (column-parallel)
    A whole and B split by output rows."""


def target_shapes(arch: Architecture) -> dict[str, TargetShape]:
    """Each PEFT target of ``arch``, in ``TARGET_LINEARS`` order: the one table of adapter shapes
    (the model's adapters, the planner's count and an adapter file's check all read it)."""
    hidden, ffn = arch.hidden_size, arch.ffn_hidden_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    return {
        "q_proj": TargetShape(hidden, q, False),
        "k_proj": TargetShape(hidden, kv, False),
        "v_proj": TargetShape(hidden, kv, False),
        "o_proj": TargetShape(q, hidden, True),
        "gate_proj": TargetShape(hidden, ffn, False),
        "up_proj": TargetShape(hidden, ffn, False),
        "down_proj": TargetShape(ffn, hidden, True),
    }


@dataclasses.dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters (LoRA, Hu et al. 2021) on the model's linears; the base weights then stay
    frozen and only the adapters (and a score head) train."""

    rank: int = 0
    """The adapters' rank r; 0 trains the full model without adapters."""
    alpha: float = 16.0
    """Scale numerator: an adapter adds (alpha / rank) * B @ A to its weight (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1) (PEFT's lora_dropout)."""
    target_modules: list[str] = dataclasses.field(default_factory=lambda: [ALL_LINEAR])
    """PEFT module names to adapt: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or
    all-linear (all seven)."""
    adapter_path: str = ""
    """A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors, as PEFT's
    save_pretrained or a run's hf_adapter/ writes) to start the adapters from instead of A random and
    B zero; its r, lora_alpha and target_modules must equal rank, alpha and target_modules. Only a
    start: a resumed run continues from its checkpoint's adapters. Empty: none."""

    def __post_init__(self) -> None:
        check_on_init(self)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def targets(self) -> tuple[str, ...]:
        """The PEFT names adapted, in ``TARGET_LINEARS`` order (all-linear expanded)."""
        wanted = set(self.target_modules)
        return tuple(name for name in TARGET_LINEARS if ALL_LINEAR in wanted or name in wanted)

    def errors(self) -> list[str]:
        errors = []
        if self.rank < 0:
            errors.append(f"rank={self.rank} must be >= 0 (0: no adapters)")
        if self.adapter_path and self.rank == 0:
            errors.append(f"adapter_path={self.adapter_path!r} is set with rank=0: set rank to the adapter's r")
        defaults = LoraConfig.__dataclass_fields__
        adapter_settings = [
            f"{name}={getattr(self, name)!r}"
            for name in ("alpha", "dropout", "target_modules")
            if getattr(self, name) != field_default(defaults[name])
        ]
        if adapter_settings and self.rank == 0:
            errors.append(
                f"{', '.join(adapter_settings)} set with rank=0, which trains the full model without adapters: "
                "set rank > 0 for LoRA, or leave these unset"
            )
        if not 0 < self.alpha < math.inf:
            errors.append(f"alpha={self.alpha} must be > 0 and finite")
        if not 0.0 <= self.dropout < 1.0:
            errors.append(f"dropout={self.dropout} must be in [0, 1)")
        known = [*TARGET_LINEARS, ALL_LINEAR]
        if not self.target_modules:
            errors.append(f"target_modules is empty: name at least one of {known}")
        for name in self.target_modules:
            if name not in known:
                errors.append(
                    f"target_modules: {name!r} is not a known module; expected names from {known}"
                    f"{did_you_mean(name, known)}"
                )
        return errors
