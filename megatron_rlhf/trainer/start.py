"""The start every trainer (``ppo``, ``sft``, ``rm``) makes after its checks, in one order: seed,
dtype, the tokenizer, the data, then the run's files in output_dir (``write_run_files``, after the
data: a run that fails on its data leaves none behind); then it builds its models with
``RunStart.build``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_rlhf.checkpoint.sources import ModelConfig, build_role, local_dir, shown_path
from megatron_rlhf.config.loader import ConfigError
from megatron_rlhf.config.run import dtype_name, resolve_dtype
from megatron_rlhf.data.builtin import data_overlap_warnings
from megatron_rlhf.data.datasets import Digestible, content_digest
from megatron_rlhf.data.tokenizer import Tokenizer, has_tokenizer, load_tokenizer, resolve_tokenizer, same_encoding
from megatron_rlhf.metrics.log import log, timed
from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.models.builder import VOCAB_PAD_MULTIPLE
from megatron_rlhf.models.roles import RoleModel
from megatron_rlhf.parallel.distributed import DistEnv, seed_everything
from megatron_rlhf.trainer.loop import LoopConfig, RunClaim, write_run_files
from megatron_rlhf.trainer.resume_check import RunFacts


@dataclasses.dataclass(frozen=True)
class RunModel:
    """A model a run uses: its settings and its architecture (as the checks read it)."""

    cfg: ModelConfig
    arch: Architecture


@dataclasses.dataclass
class RunStart:
    """What a trainer's start made: the dtype, the tokenizer and the run's claim on its output_dir
    (for ``run_loop``)."""

    env: DistEnv
    dtype: torch.dtype
    tokenizer: Tokenizer
    claim: RunClaim
    models: dict[str, RunModel]
    seed: int
    """The run's seed (the LoRA adapters' initial values are drawn from it)."""

    def build(self, role: str, vocab_pad_multiple: int = VOCAB_PAD_MULTIPLE) -> RoleModel:
        """The model of ``role``, built in its layout and loaded from its path (timed)."""
        model = self.models[role]
        with timed(f"{role}: build+load", self.env.device):
            return build_role(
                role,
                model.cfg,
                model.arch,
                world_size=self.env.world_size,
                dtype=self.dtype,
                device=self.env.device,
                vocab_pad_multiple=vocab_pad_multiple,
                seed=self.seed,
            )


def start_run[Train: Digestible, Validation](
    cfg: LoopConfig,
    env: DistEnv,
    *,
    name: str,
    models: dict[str, RunModel],
    tokenizer_of: str,
    load_data: Callable[[Tokenizer], tuple[Train, Validation]],
    batch_setting: str,
    details: str = "",
) -> tuple[RunStart, tuple[Train, Validation]]:
    """Seed, log the run's line (``details`` before its models), read the tokenizer of the model
    ``tokenizer_of``, ``load_data`` with it (the training and validation sets), check that the
    training set fills one step's batch (the config's ``batch_setting``), and write the run's files
    (collective). Returns the start and the data."""
    seed_everything(cfg.seed)
    dtype = resolve_dtype(cfg.dtype, env.device)
    log(
        f"{name}: world {env.world_size} on {env.device.type}, dtype {str(dtype).removeprefix('torch.')}, "
        f"{details}models: "
        + ", ".join(f"{role} {shown_path(m.cfg.path)} (tp {m.cfg.tp}, pp {m.cfg.pp})" for role, m in models.items())
    )
    source = models[tokenizer_of]
    tokenizer = resolve_tokenizer(local_dir(source.cfg.path), source.arch, source.cfg.path)
    require_one_encoding(models, tokenizer_of, tokenizer)
    data = getattr(cfg, "data", None)
    if data is not None and data.add_bos is None:  # recorded as resolved: a resume compares what the data got
        data.add_bos = tokenizer.adds_bos
        if data.add_bos:
            log(f"text prompts start with the tokenizer's BOS id {tokenizer.bos_id}, as its own encoding of text does")
    if data is not None:
        for line in data_overlap_warnings(data.train, getattr(data, "validation", [])):
            log(line)
    train, validation = load_data(tokenizer)
    _require_a_full_step(len(train), getattr(cfg, batch_setting), batch_setting)
    _, run_steps = cfg.run_steps(len(train), getattr(cfg, batch_setting))
    for setting, optim in cfg.optimizers().items():  # before config.yaml records them
        for line in optim.resolve_length(setting, run_steps, cfg.optimizer_steps_per_step()):
            log(line)
    archs = {role: model.arch for role, model in models.items()}
    facts = RunFacts(name, len(train), archs, dtype_name(dtype), content_digest(train))
    claim = write_run_files(cfg, Path(cfg.output_dir), facts, tokenizer)
    return RunStart(env, dtype, tokenizer, claim, models, cfg.seed), (train, validation)


def require_one_encoding(models: dict[str, RunModel], tokenizer_of: str, tokenizer: Tokenizer) -> None:
    """Every model reads the token ids of ``tokenizer_of``'s tokenizer: one whose own tokenizer encodes
    text otherwise (a reward model of another family, with a vocabulary of the same size) would read
    them as other text, with no error from its shapes."""
    errors = []
    for role, model in models.items():
        if model.cfg.path == models[tokenizer_of].cfg.path:
            continue
        directory = local_dir(model.cfg.path)
        if not has_tokenizer(directory):
            continue  # nothing to compare: it is read with the run's tokenizer, as its vocabulary allows
        theirs = load_tokenizer(directory)
        if not same_encoding(theirs, tokenizer):
            errors.append(
                f"{role}.path={model.cfg.path!r}: its tokenizer ({theirs!r}) encodes text otherwise than the "
                f"{tokenizer_of}'s ({tokenizer!r}), and the {role} reads the {tokenizer_of}'s token ids: give it "
                f"a model trained with the {tokenizer_of}'s tokenizer"
            )
    if errors:
        raise ConfigError("; ".join(errors))


def _require_a_full_step(examples: int, batch_size: int, setting: str) -> None:
    """The training set must fill one step's batch, which ``setting`` sets: checked as soon as the
    data is read, before any model is built."""
    if examples < batch_size:
        raise ConfigError(
            f"data.train has {examples} examples, fewer than one step's {setting}={batch_size}: not one full "
            f"step. Set {setting} to at most {examples}, or give more data"
        )
