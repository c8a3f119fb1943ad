"""``megatron-rlhf convert``: HF safetensors <-> megatron-rlhf checkpoints, in any layout.

``mcore-to-hf`` also reads a trained model of a run checkpoint (``.../checkpoints/step_N/models/<name>``,
``train_state.py``'s format): its weights (the optimizer's state is left), and its architecture
from the ``models`` the training loop records in the checkpoint's ``run_state.json``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.models.gpt import GPTModel

from megatron_rlhf.checkpoint.hf import checkpoint_torch_dtype, load_hf_weights, save_hf_checkpoint
from megatron_rlhf.checkpoint.mcore import (
    global_dp_rank_of,
    has_integrity_manifest,
    load_mcore_checkpoint,
    save_mcore_checkpoint,
)
from megatron_rlhf.checkpoint.mcore_meta import read_architecture
from megatron_rlhf.checkpoint.run_checkpoint import RUN_STATE_FILE
from megatron_rlhf.checkpoint.sources import model_dir
from megatron_rlhf.checkpoint.train_state import STATE_FILE
from megatron_rlhf.metrics.log import log, timed
from megatron_rlhf.models.architecture import Architecture, architecture_from_hf_config, load_architecture
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.parallel.distributed import init_distributed
from megatron_rlhf.parallel.layout import Layout, ParallelGroups, layout_errors, parallel_groups

DIRECTIONS = ("hf-to-mcore", "mcore-to-hf")


def convert(direction: str, source: str, output: str, *, tp: int, pp: int, device: str = "auto") -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"convert direction {direction!r} must be one of {list(DIRECTIONS)}")
    trained = direction == "mcore-to-hf" and (Path(source) / STATE_FILE).is_file()
    if direction == "hf-to-mcore":
        source = str(model_dir(source, setting="source"))  # a hub id: its snapshot in the local HF cache
        arch = load_architecture(source)
    else:
        arch = _trained_architecture(Path(source)) if trained else read_architecture(source)
    env = init_distributed(device)
    errors = layout_errors("", tp, pp, arch, env.world_size)
    if errors:
        if env.world_size % (tp * pp):
            errors.append(
                f"run under torchrun with a multiple of {tp * pp} processes, e.g. "
                f"torchrun --nproc-per-node {tp * pp} -m megatron_rlhf convert ..."
            )
        raise ValueError("; ".join(errors))
    groups = parallel_groups(Layout.for_world(tp, pp, env.world_size))
    # Convert in the checkpoint's own dtype, so that a round trip is bit-exact.
    model = build_model(arch, groups, dtype=checkpoint_torch_dtype(arch, torch.float32), device=env.device)
    with timed(f"convert {direction}: load", env.device):
        if direction == "hf-to-mcore":
            load_hf_weights(model, arch, groups, source)
        elif trained:
            _load_trained_weights(model, groups, Path(source))
        else:
            load_mcore_checkpoint(model, groups, source)
    with timed(f"convert {direction}: save", env.device):
        if direction == "hf-to-mcore":
            save_mcore_checkpoint(model, arch, groups, output, side_files_from=source)
        else:
            save_hf_checkpoint(model, arch, groups, output, side_files_from=None if trained else source)
    log(f"wrote {output} ({arch.hf_class_name}, layout {groups.layout})")
    dist.barrier()


def _trained_architecture(model_dir: Path) -> Architecture:
    """The architecture the run checkpoint holding ``model_dir`` records for it."""
    run_state = model_dir.parent.parent / RUN_STATE_FILE
    models = json.loads(run_state.read_text()).get("models", {}) if run_state.is_file() else {}
    if model_dir.name not in models:
        raise ValueError(
            f"{model_dir}: {run_state} records no architecture for {model_dir.name!r} (a checkpoint "
            "written before run checkpoints recorded their models): convert the run's hf/ export instead"
        )
    return architecture_from_hf_config(models[model_dir.name], source=f"{run_state}:models.{model_dir.name}")


def _load_trained_weights(model: GPTModel, groups: ParallelGroups, model_dir: Path) -> None:
    """Fill ``model`` (any layout) with the weights of a run checkpoint's trained model."""
    dist_dir = model_dir / "dist"
    with global_dp_rank_of(groups):
        sharded = model.sharded_state_dict(metadata={"dp_cp_group": groups.pg_collection.dp_cp})
    loaded = dist_checkpointing.load(sharded, str(dist_dir), verify_integrity=has_integrity_manifest(dist_dir))
    model.load_state_dict(
        {key: value for key, value in loaded.items() if key in sharded}, strict=True
    )  # not the optimizer
