"""Where a model comes from (an HF directory, a Hugging Face hub id found in the local cache, a
megatron-rlhf checkpoint, or ``builtin:NAME``), and a role's model built from its ``ModelConfig``:
architecture, layout, weights.

The config's ``path`` values are resolved here and nowhere else. Reading a path's architecture
imports no megatron-core (a config's checks run before it is imported); building and loading a
model imports it.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_rlhf.checkpoint.hf import load_hf_weights
from megatron_rlhf.checkpoint.mcore_meta import is_mcore_checkpoint, is_trained_model, read_architecture
from megatron_rlhf.checkpoint.peft_adapter import adapter_errors, load_peft_adapter
from megatron_rlhf.config.fields import at_least
from megatron_rlhf.config.run import RunConfig
from megatron_rlhf.models.architecture import (
    VOCAB_PAD_MULTIPLE,
    Architecture,
    architecture_from_hf_config,
    load_architecture,
)
from megatron_rlhf.models.builtin import builtin_checkpoint, builtin_config, is_builtin
from megatron_rlhf.models.lora_config import LoraConfig
from megatron_rlhf.models.roles import HEAD_FROM_LM, NEEDS_SCORE_HEAD, RoleModel
from megatron_rlhf.parallel.layout import Layout, ParallelGroups, layout_errors, parallel_groups

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """One model and its parallel layout (dp = world_size / (tp * pp))."""

    path: str = ""
    """An HF model directory, a megatron-rlhf model checkpoint, or ``builtin:NAME`` (the built-in
    random models, e.g. builtin:tiny-llama); required."""
    tp: int = 1
    """Tensor-parallel size: must divide the number of attention heads and of query groups."""
    pp: int = 1
    """Pipeline-parallel size: must divide the number of layers."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    """Low-rank adapters trained instead of the full model (lora.rank > 0)."""

    def errors(self) -> list[str]:
        return at_least(self, 1, "tp", "pp")


@dataclasses.dataclass(kw_only=True)
class ModelsConfig(RunConfig):
    """A run with the four models (``smoke``, ``ppo``); each command builds the ones it uses."""

    actor: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The policy trained."""
    critic: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The value model; an empty path: the actor's (its backbone and a new value head, as in verl)."""
    reference: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The KL reference; an empty path: the actor's (the policy before training, as in verl). The
    actor's path with a LoRA actor and reference.update=none: the actor with its adapters off (its
    frozen base), and no reference model is built."""
    reward: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The reward model (read with scoring.use_reward_model=true)."""

    def role(self, name: str) -> ModelConfig:
        """The model of ``name``, a following role's empty path resolved to the actor's. The config
        itself keeps the empty path, so that a saved config (``--print-config``, config.yaml) whose
        actor.path is then changed still has the critic and reference follow it."""
        model: ModelConfig = getattr(self, name)
        if name in FOLLOW_ACTOR and not model.path:
            model = copy.copy(model)  # not dataclasses.replace: its __post_init__ checks, and errors() report
            model.path = self.actor.path
        return model


FOLLOW_ACTOR = ("critic", "reference")
"""Roles whose empty ``path`` means the actor's."""


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""``org/name``: how a Hugging Face hub id looks (a relative directory of that name is read first)."""


def hf_hub_cache() -> Path:
    """The local Hugging Face hub cache, where huggingface_hub looks: ``HF_HUB_CACHE``, else
    ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home).expanduser() / "hub"


def cached_hub_model(hub_id: str) -> Path | None:
    """The snapshot of ``hub_id``'s main revision in the local cache (None: not there), as
    ``hf download`` leaves it: ``models--ORG--NAME/refs/main`` names ``snapshots/<commit>``."""
    repo = hf_hub_cache() / ("models--" + hub_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    if not ref.is_file():
        return None
    snapshot = repo / "snapshots" / ref.read_text().strip()
    return snapshot if snapshot.is_dir() else None


def model_dir(path: str, setting: str = "model path") -> Path:
    """The local directory of the model named by ``path`` (not ``builtin:``): the directory itself,
    or a hub id's snapshot in the local Hugging Face cache. ``setting`` names the key for the
    message when there is neither."""
    local = Path(path)
    if local.is_dir():
        return local
    if HUB_ID.fullmatch(path):
        cached = cached_hub_model(path)
        if cached is not None:
            return cached
        raise FileNotFoundError(
            f"model path '{path}': no such directory ({local.absolute()}); as a Hugging Face hub id it is not in "
            f"the local cache ({hf_hub_cache()}) either. Download it with `hf download {path}` (this path then "
            f"finds it in the cache), or `hf download {path} --local-dir DIR` and set {setting}=DIR"
        )
    raise FileNotFoundError(
        f"model path '{path}' is not a directory ({local.absolute()}; expected an HF model dir, "
        f"a megatron-rlhf checkpoint, a Hugging Face hub id in the local cache, or builtin:NAME)"
    )


def shown_path(path: str) -> str:
    """``path`` for the start-up log, with the cache directory a hub id was read from."""
    if is_builtin(path) or Path(path).is_dir():
        return path
    return f"{path} (from the Hugging Face cache: {model_dir(path)})"


def architecture_of(path: str, setting: str = "model path") -> Architecture:
    """Read a model's architecture without touching its weights (cheap; used by validation)."""
    if is_builtin(path):
        return architecture_from_hf_config(builtin_config(path), source=path)
    local = model_dir(path, setting)
    if is_mcore_checkpoint(local):
        return read_architecture(local)
    if is_trained_model(local):
        raise FileNotFoundError(
            f"{local} is a run checkpoint's trained model; a model setting reads an HF model directory, a "
            f"`convert hf-to-mcore` checkpoint or builtin:NAME. Write it as an HF model with `megatron-rlhf "
            f"convert mcore-to-hf {local} OUT` and set OUT (or take the run's hf/ export); to continue that run, "
            "resume it"
        )
    return load_architecture(local)


def model_errors(
    key: str, model: ModelConfig, world_size: int, *, score_head: bool, head_from_lm: bool = False
) -> tuple[list[str], Architecture | None]:
    """The problems of the model configured at ``key`` (path, head type, layout in this world, the
    PEFT adapter its LoRA starts from) and its architecture (None when the path cannot be read).

    ``head_from_lm``: a model that needs a score head may start from a causal LM in HF format (its
    backbone, and a new score head; see ``load_weights``), as critics and reward models usually
    start from the SFT policy. The returned architecture is then the score-head one.
    """
    if not model.path:
        follows = f" (the {' and '.join(FOLLOW_ACTOR)} follow it)" if key == "actor" else ""
        return [
            f"{key}.path is not set{follows}: give an HF model directory, a megatron-rlhf checkpoint or builtin:NAME"
        ], None
    try:
        arch = architecture_of(model.path, f"{key}.path")
    except (ValueError, FileNotFoundError) as err:
        return [f"{key}.path={model.path!r}: {err}"], None
    errors = [f"{e} (model {model.path})" for e in layout_errors(key, model.tp, model.pp, arch, world_size)]
    errors += adapter_errors(f"{key}.lora", model.lora, arch)
    if score_head and not arch.score_head and head_from_lm:
        if not is_builtin(model.path) and is_mcore_checkpoint(model_dir(model.path)):
            errors.append(
                f"{key}.path={model.path!r} is a megatron-rlhf checkpoint of a {arch.hf_class_name}; "
                f"a new score head starts from an HF model dir only (megatron-rlhf convert mcore-to-hf)"
            )
        return errors, arch.with_score_head()
    if score_head and arch.score_head and arch.num_labels != 1:
        errors.append(
            f"{key}.path={model.path!r} is a {arch.hf_class_name} with {arch.num_labels} labels (its config's "
            f"num_labels or id2label; without either, transformers reads 2); the {key} reads one score per "
            "position (num_labels=1), as a Bradley-Terry reward model has: a classifier's logit is not one"
        )
    if arch.score_head != score_head:
        need = "a *ForSequenceClassification (score head)" if score_head else "a *ForCausalLM"
        hint = " (or a *ForCausalLM HF dir, which gets a new score head)" if head_from_lm else ""
        errors.append(f"{key}.path={model.path!r} is a {arch.hf_class_name}; the {key} needs {need} model{hint}")
    return errors, arch


def role_errors(
    cfg: ModelsConfig, roles: tuple[str, ...] | list[str], world_size: int
) -> tuple[list[str], dict[str, Architecture]]:
    """``model_errors`` of each of ``roles``, and their architectures."""
    errors: list[str] = []
    archs: dict[str, Architecture] = {}
    for role in roles:
        path = cfg.role(role).path
        actors_unreadable = path == cfg.actor.path and "actor" in roles and "actor" not in archs
        if role in FOLLOW_ACTOR and (not path or actors_unreadable):
            continue  # the actor's missing or unreadable path is reported once
        found, arch = model_errors(
            role, cfg.role(role), world_size, score_head=NEEDS_SCORE_HEAD[role], head_from_lm=role in HEAD_FROM_LM
        )
        errors += found
        if arch is not None:
            archs[role] = arch
    return errors, archs


def local_dir(path: str) -> Path:
    """The local directory of a model's files (collective for ``builtin:`` models: made on first use)."""
    return builtin_checkpoint(path) if is_builtin(path) else model_dir(path)


def load_weights(model: GPTModel, arch: Architecture, groups: ParallelGroups, path: str) -> Path:
    """Fill ``model`` from ``path``; returns the local directory the weights came from (collective).
    A score-head ``arch`` with a causal LM at ``path`` loads the backbone and keeps its new head."""
    from megatron_rlhf.checkpoint.mcore import load_mcore_checkpoint

    local = local_dir(path)
    if is_mcore_checkpoint(local):
        load_mcore_checkpoint(model, groups, local)
    else:
        load_hf_weights(model, arch, groups, local, new_head=arch.score_head and not architecture_of(path).score_head)
    return local


def build_role(
    role: str,
    model_cfg: ModelConfig,
    arch: Architecture,
    *,
    world_size: int,
    dtype: torch.dtype,
    device: torch.device,
    vocab_pad_multiple: int = VOCAB_PAD_MULTIPLE,
    seed: int = 0,
) -> RoleModel:
    """The model of ``role`` in its own layout, with its weights (collective over the whole world),
    and its LoRA adapters when ``model_cfg.lora.rank > 0`` (drawn from ``seed``, or read from
    ``lora.adapter_path``; base frozen).

    ``vocab_pad_multiple``: a model that receives another's weights in its layout must have that
    model's padded vocabulary (``hybrid.config.matching_vocab_pad_multiple``).
    """
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.lora import apply_lora

    groups = parallel_groups(Layout.for_world(model_cfg.tp, model_cfg.pp, world_size))
    model = build_model(arch, groups, dtype=dtype, device=device, vocab_pad_multiple=vocab_pad_multiple)
    source = load_weights(model, arch, groups, model_cfg.path)
    if model_cfg.lora.enabled:
        apply_lora(model, arch, model_cfg.lora, groups.pg_collection.tp, seed=seed)
    if model_cfg.lora.adapter_path:
        load_peft_adapter(model, groups, model_cfg.lora, arch, f"{role}.lora")
    hub_id = model_cfg.path if source != Path(model_cfg.path) and HUB_ID.fullmatch(model_cfg.path) else None
    return RoleModel(role=role, arch=arch, groups=groups, model=model, source=source, hub_id=hub_id)
