"""``megatron-rlhf sft``'s and ``rm``'s configurations and their up-front check, apart from the
trainers (``sft.py``, ``rm.py``, ``supervised.py``) so that reading and checking a config imports no
megatron-core."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from megatron_rlhf.checkpoint.sources import ModelConfig, model_errors
from megatron_rlhf.config.fields import at_least
from megatron_rlhf.config.loader import config_errors, raise_if_errors
from megatron_rlhf.data.builtin import data_path_errors
from megatron_rlhf.data.config import ChatDataConfig, DataFilesConfig
from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.parallel.layout import Layout
from megatron_rlhf.trainer.loop_config import LoopConfig, eval_every_errors
from megatron_rlhf.training.config import OptimConfig


@dataclasses.dataclass(kw_only=True)
class SupervisedDataConfig(DataFilesConfig):
    """Training and validation files of SFT and RM rows."""

    validation: list[str] = dataclasses.field(default_factory=list)
    """Validation data, same formats; empty: no validation."""
    max_length: int = 1024
    """Longest sequence in tokens (prompt + response + EOS); longer rows follow ``on_overlong``."""

    def errors(self) -> list[str]:
        return super().errors() + at_least(self, 2, "max_length")


@dataclasses.dataclass(kw_only=True)
class SupervisedConfig(LoopConfig):
    """Fields shared by ``megatron-rlhf sft`` and ``megatron-rlhf rm``."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The model trained and its TP/PP layout (dp = world_size / (tp * pp))."""
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Adam, warmup and LR decay."""
    global_batch_size: int = 64
    """Examples (SFT sequences or preference pairs) per optimizer step, over all DP ranks; a
    multiple of the data-parallel size."""
    eval_every: int = 0
    """If > 0 and validation data is given: evaluate every this many steps (always at the end)."""
    eval_before_train: bool = False
    """With validation data: also evaluate before the first step (logged as step 0)."""
    VALIDATION_FIGURES: ClassVar[tuple[str, ...]] = ()
    """The figures an evaluation reports, in order (``health.val_metric`` names one)."""

    def errors(self) -> list[str]:
        return super().errors() + at_least(self, 1, "global_batch_size") + at_least(self, 0, "eval_every")

    def optimizers(self) -> dict[str, OptimConfig]:
        return {"optim": self.optim}


def check_config(cfg: SupervisedConfig, world_size: int, *, score_head: bool) -> Architecture:
    """Raise ``ConfigError`` listing every problem at once; returns the model's architecture."""
    errors, arch = model_errors("model", cfg.model, world_size, score_head=score_head, head_from_lm=score_head)
    model = cfg.model
    if model.tp >= 1 and model.pp >= 1 and world_size % (model.tp * model.pp) == 0 and cfg.global_batch_size >= 1:
        dp = Layout.for_world(model.tp, model.pp, world_size).dp
        if cfg.global_batch_size % dp:
            errors.append(
                f"global_batch_size={cfg.global_batch_size} must be divisible by the data-parallel size "
                f"dp={dp} (world size {world_size} / (model.tp={model.tp} * model.pp={model.pp}))"
            )
    data = cfg.data  # type: ignore[attr-defined]
    if not data.train:
        errors.append("data.train is empty: give the training files, e.g. data.train=[path/to/train.jsonl]")
    errors += data_path_errors("data.train", data.train) + data_path_errors("data.validation", data.validation)
    errors += cfg.health.validation_errors(data.validation, cfg.eval_every, cfg.VALIDATION_FIGURES)
    errors += cfg.health.reach_errors((), ())  # a supervised step times only itself, and reports no RL signal
    errors += cfg.length_errors(data.max_length, "data.max_length")
    limit = arch.hf_config.get("max_position_embeddings") if arch is not None else None
    if limit is not None and data.max_length > limit:
        errors.append(
            f"data.max_length={data.max_length} exceeds the model's max_position_embeddings={limit} "
            f"(model.path={model.path!r}): set data.max_length to at most {limit}"
        )
    errors += eval_every_errors(cfg.eval_every, data.validation)
    raise_if_errors(config_errors(cfg) + cfg.output_dir_errors() + errors)
    assert arch is not None
    return arch


@dataclasses.dataclass(kw_only=True)
class SFTDataConfig(SupervisedDataConfig, ChatDataConfig):
    """SFT rows: a conversation whose assistant messages the model learns to write, or a prompt (text,
    or a conversation rendered with the generation prompt) and the response it learns to produce."""

    response_key: str = "response"
    """Column of the response text (or pre-tokenized ``<key>_ids``)."""
    messages_key: str = "messages"
    """Column of a conversation (a list of {role, content, tool_calls} messages, verl's multi-turn SFT
    rows): a row that has it is trained on its assistant messages only, each through its stop token;
    system, user and tool messages are context. Rows without it use prompt_key and response_key. "":
    no such column."""


@dataclasses.dataclass(kw_only=True)
class SFTConfig(SupervisedConfig):
    """``megatron-rlhf sft``: the fields of ``SupervisedConfig`` plus the SFT data."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """A *ForCausalLM model (HF dir, megatron-rlhf checkpoint or builtin:NAME) and its TP/PP layout."""
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Adam, warmup and LR decay."""
    data: SFTDataConfig = dataclasses.field(default_factory=SFTDataConfig)
    """Training / validation files and columns."""
    VALIDATION_FIGURES = ("nll", "perplexity", "tokens", "examples")


@dataclasses.dataclass(kw_only=True)
class PreferenceDataConfig(SupervisedDataConfig, ChatDataConfig):
    """Preference rows: a prompt, a chosen and a rejected response; or chosen and rejected
    conversations (TRL's conversational rows, after a conversation prompt or whole)."""

    chosen_key: str = "chosen"
    """Column of the preferred response: text, pre-tokenized ``<key>_ids``, or a conversation."""
    rejected_key: str = "rejected"
    """Column of the dispreferred response, in the chosen response's form."""


@dataclasses.dataclass(kw_only=True)
class RMConfig(SupervisedConfig):
    """``megatron-rlhf rm``: the fields of ``SupervisedConfig`` plus the preference data.

    ``global_batch_size`` counts pairs (each pair is two sequences)."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """A *ForSequenceClassification model (score head; HF dir, megatron-rlhf checkpoint or
    builtin:NAME) and its TP/PP layout."""
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=5e-6))
    """Adam, warmup and LR decay."""
    data: PreferenceDataConfig = dataclasses.field(default_factory=PreferenceDataConfig)
    """Training / validation files and columns."""
    VALIDATION_FIGURES = ("accuracy", "loss", "margin", "pairs")
