"""One model's megatron checkpoint: megatron-core ``dist_checkpointing`` plus the HF config.

Layout of a model checkpoint directory::

    megatron_rlhf.json   format version, the HF config the model was built from, saved layout
    weights/             dist_checkpointing (torch_dist) shards; reloadable into any TP/PP layout
    tokenizer files      copied from the source HF checkpoint, if any

dist_checkpointing reshards on load, so a checkpoint saved at TP2xPP2 loads at TP1 and vice versa.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.validation import INTEGRITY_FNAME

from megatron_rlhf.checkpoint.hf import copy_side_files
from megatron_rlhf.models.architecture import Architecture, architecture_from_hf_config
from megatron_rlhf.parallel.layout import ParallelGroups

FORMAT_VERSION = 1
META_FILE = "megatron_rlhf.json"
WEIGHTS_DIR = "weights"


def is_mcore_checkpoint(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file()


def read_architecture(ckpt_dir: str | Path) -> Architecture:
    meta_path = Path(ckpt_dir) / META_FILE
    meta = json.loads(meta_path.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{meta_path}: format_version={meta.get('format_version')} is not supported "
            f"(this build reads {FORMAT_VERSION})"
        )
    return architecture_from_hf_config(meta["hf_config"], source=f"{meta_path}:hf_config")


@contextlib.contextmanager
def global_dp_rank_of(groups: ParallelGroups) -> Iterator[None]:
    """megatron-core 0.19.2 reads the *global* data-parallel rank when it ties a last-stage output
    layer to the first-stage embedding (``tie_embeddings_and_output_weights_state_dict``), even
    with explicit process groups. Answer with this model's rank while its state dict is made."""
    original = parallel_state.get_data_parallel_rank
    parallel_state.get_data_parallel_rank = lambda *args, **kwargs: groups.pg_collection.dp_cp.rank()
    try:
        yield
    finally:
        parallel_state.get_data_parallel_rank = original


def has_integrity_manifest(dist_dir: str | Path) -> bool:
    """Whether a dist_checkpointing directory lists its files' SHA-256 hashes (saved with
    ``verify_integrity=True``): loading then re-hashes them and names a file whose bytes changed.
    Checkpoints written before the manifest was kept load unverified."""
    return (Path(dist_dir) / INTEGRITY_FNAME).is_file()


def _sharded_state_dict(model: torch.nn.Module, groups: ParallelGroups) -> dict:
    # Pass the model's own data-parallel group: megatron otherwise reads its global parallel_state.
    with global_dp_rank_of(groups):
        return model.sharded_state_dict(metadata={"dp_cp_group": groups.pg_collection.dp_cp})


def dist_save_request(sharded_state_dict: dict, dist_dir: Path) -> AsyncRequest:
    """Collective. Plans a dist_checkpointing save into the existing ``dist_dir`` (with an integrity
    manifest) and returns it as megatron's ``AsyncRequest``: ``execute_sync()`` writes it here and
    now (what ``dist_checkpointing.save`` does), or ``run_checkpoint`` writes it in a background
    process. Its finalize functions write ``.metadata``, ``metadata.json`` and the manifest."""
    return dist_checkpointing.save(sharded_state_dict, str(dist_dir), verify_integrity=True, async_sharded_save=True,
                                   async_strategy="mcore")  # fmt: skip


def mcore_save_request(
    model: torch.nn.Module,
    arch: Architecture,
    groups: ParallelGroups,
    ckpt_dir: str | Path,
    *,
    side_files_from: str | Path | None = None,
) -> AsyncRequest:
    """Collective: every rank calls it with its shard. Plans the save (``dist_save_request``); its
    last finalize function writes ``megatron_rlhf.json`` and the side files."""
    ckpt = Path(ckpt_dir)
    if dist.get_rank() == 0:
        (ckpt / WEIGHTS_DIR).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    request = dist_save_request(_sharded_state_dict(model, groups), ckpt / WEIGHTS_DIR)

    def write_meta() -> None:
        if dist.get_rank() == 0:
            meta = {"format_version": FORMAT_VERSION, "hf_config": arch.hf_config, "saved_layout": str(groups.layout)}
            (ckpt / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
            if side_files_from is not None:
                copy_side_files(side_files_from, ckpt)
        dist.barrier()

    request.add_finalize_fn(write_meta)
    return request


def save_mcore_checkpoint(
    model: torch.nn.Module,
    arch: Architecture,
    groups: ParallelGroups,
    ckpt_dir: str | Path,
    *,
    side_files_from: str | Path | None = None,
) -> None:
    """Collective: every rank calls it with its shard."""
    mcore_save_request(model, arch, groups, ckpt_dir, side_files_from=side_files_from).execute_sync()


def load_mcore_checkpoint(model: torch.nn.Module, groups: ParallelGroups, ckpt_dir: str | Path) -> None:
    """Fill ``model`` (any layout) from a checkpoint written by ``save_mcore_checkpoint``."""
    weights = Path(ckpt_dir) / WEIGHTS_DIR
    if not weights.is_dir():
        raise FileNotFoundError(f"{weights}: missing; {ckpt_dir} is not a megatron-rlhf model checkpoint")
    state = dist_checkpointing.load(_sharded_state_dict(model, groups), str(weights),
                                    verify_integrity=has_integrity_manifest(weights))  # fmt: skip
    model.load_state_dict(state, strict=True)
