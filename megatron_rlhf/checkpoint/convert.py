"""``megatron-rlhf convert``: HF safetensors <-> megatron-rlhf checkpoints, in any layout."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rlhf.checkpoint.hf import checkpoint_torch_dtype, load_hf_weights, save_hf_checkpoint
from megatron_rlhf.checkpoint.mcore import load_mcore_checkpoint, read_architecture, save_mcore_checkpoint
from megatron_rlhf.metrics.log import log, timed
from megatron_rlhf.models.architecture import load_architecture
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.parallel.distributed import init_distributed
from megatron_rlhf.parallel.layout import Layout, layout_errors, parallel_groups

DIRECTIONS = ("hf-to-mcore", "mcore-to-hf")


def convert(direction: str, source: str, output: str, *, tp: int, pp: int, device: str = "auto") -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"convert direction {direction!r} must be one of {list(DIRECTIONS)}")
    arch = load_architecture(source) if direction == "hf-to-mcore" else read_architecture(source)
    env = init_distributed(device)
    errors = layout_errors("convert", tp, pp, arch, env.world_size, as_flags=True)
    if errors:
        if env.world_size % (tp * pp):
            errors.append(f"run under torchrun with a multiple of {tp * pp} processes, e.g. "
                          f"torchrun --nproc-per-node {tp * pp} -m megatron_rlhf convert ...")
        raise ValueError("; ".join(errors))
    groups = parallel_groups(Layout.for_world(tp, pp, env.world_size))
    # Convert in the checkpoint's own dtype, so that a round trip is bit-exact.
    model = build_model(arch, groups, dtype=checkpoint_torch_dtype(arch, torch.float32), device=env.device)
    with timed(f"convert {direction}: load", env.device):
        if direction == "hf-to-mcore":
            load_hf_weights(model, arch, groups, source)
        else:
            load_mcore_checkpoint(model, groups, source)
    with timed(f"convert {direction}: save", env.device):
        if direction == "hf-to-mcore":
            save_mcore_checkpoint(model, arch, groups, output, side_files_from=source)
        else:
            save_hf_checkpoint(model, arch, groups, output, side_files_from=source)
    log(f"wrote {output} ({arch.hf_class_name}, layout {groups.layout})")
    dist.barrier()
