"""Where a model comes from: an HF directory, a megatron-rlhf checkpoint, or ``builtin:NAME``.

The config's ``path`` values are resolved here and nowhere else.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rlhf.checkpoint.mcore import is_mcore_checkpoint, load_mcore_checkpoint, read_architecture
from megatron_rlhf.models.architecture import Architecture, architecture_from_hf_config, load_architecture
from megatron_rlhf.models.builtin import builtin_checkpoint, builtin_config, is_builtin
from megatron_rlhf.models.hf_checkpoint import load_hf_weights
from megatron_rlhf.parallel.layout import ParallelGroups


def architecture_of(path: str) -> Architecture:
    """Read a model's architecture without touching its weights (cheap; used by validation)."""
    if is_builtin(path):
        return architecture_from_hf_config(builtin_config(path), source=path)
    if not Path(path).is_dir():
        raise FileNotFoundError(f"model path '{path}' is not a directory (expected an HF model dir, "
                                f"a megatron-rlhf checkpoint, or builtin:NAME)")
    if is_mcore_checkpoint(path):
        return read_architecture(path)
    return load_architecture(path)


def local_dir(path: str) -> Path:
    """The local directory of a model's files (collective for ``builtin:`` models: made on first use)."""
    return builtin_checkpoint(path) if is_builtin(path) else Path(path)


def load_weights(model: torch.nn.Module, arch: Architecture, groups: ParallelGroups, path: str) -> Path:
    """Fill ``model`` from ``path``; returns the local directory the weights came from (collective)."""
    local = local_dir(path)
    if is_mcore_checkpoint(local):
        load_mcore_checkpoint(model, groups, local)
    else:
        load_hf_weights(model, arch, groups, local)
    return local
