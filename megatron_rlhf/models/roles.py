"""The four models of a run (actor, critic, reference, reward), each in its own layout.

A ``RoleModel`` bundles what every later stage needs of one model: its architecture, its process
groups and this rank's shard. ``build_role`` is collective over the whole world.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from megatron_rlhf.config.schema import ModelConfig
from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.sources import load_weights
from megatron_rlhf.parallel.layout import Layout, ParallelGroups, parallel_groups


@dataclasses.dataclass
class RoleModel:
    role: str
    arch: Architecture
    groups: ParallelGroups
    model: torch.nn.Module
    source: Path
    """The local directory the weights were read from (tokenizer files live there too)."""

    @property
    def padded_vocab_size(self) -> int:
        return self.model.vocab_size


def build_role(
    role: str, model_cfg: ModelConfig, arch: Architecture, *, world_size: int, dtype: torch.dtype, device: torch.device
) -> RoleModel:
    groups = parallel_groups(Layout.for_world(model_cfg.tp, model_cfg.pp, world_size))
    model = build_model(arch, groups, dtype=dtype, device=device)
    source = load_weights(model, arch, groups, model_cfg.path)
    return RoleModel(role=role, arch=arch, groups=groups, model=model, source=source)
