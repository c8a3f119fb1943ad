"""One model's megatron checkpoint: megatron-core ``dist_checkpointing`` plus the HF config.

Layout of a model checkpoint directory::

    megatron_rlhf.json   format version, the HF config the model was built from, saved layout
    weights/             dist_checkpointing (torch_dist) shards; reloadable into any TP/PP layout
    tokenizer files      copied from the source HF checkpoint, if any

dist_checkpointing reshards on load, so a checkpoint saved at TP2xPP2 loads at TP1 and vice versa.

``weights/`` holds megatron's integrity manifest (``integrity.json``: every file's SHA-256), checked
before dist_checkpointing reads (and unpickles) ``.metadata`` and the shards. A model path without
one (written before manifests were kept) is loaded unverified, with a warning: the user named that
path, so it is a file they chose to trust. A run checkpoint's own manifest lists each model's
``integrity.json`` (``run_checkpoint.py``), so there it cannot be removed unnoticed.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import queue
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.validation import INTEGRITY_FNAME

from megatron_rlhf.checkpoint.hf import copy_side_files
from megatron_rlhf.checkpoint.mcore_meta import FORMAT_VERSION, META_FILE
from megatron_rlhf.metrics.log import log
from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.parallel.layout import ParallelGroups

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

WEIGHTS_DIR = "weights"


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
    ``verify_integrity=True``): loading then re-hashes them, before anything is unpickled, and names
    a file whose bytes changed. Model paths written before the manifest was kept load unverified."""
    return (Path(dist_dir) / INTEGRITY_FNAME).is_file()


def write_bytes(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path``. A failed write (a full disk: ENOSPC) raises an ``OSError`` that
    names the file, which a write error alone does not (``torch.save`` into a full disk says only
    ``unexpected pos 704 vs 598``)."""
    try:
        with open(path, "wb") as file:
            file.write(data)
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(path)) from err


def _sharded_state_dict(model: GPTModel, groups: ParallelGroups) -> dict:
    # Pass the model's own data-parallel group: megatron otherwise reads its global parallel_state.
    with global_dp_rank_of(groups):
        return model.sharded_state_dict(metadata={"dp_cp_group": groups.pg_collection.dp_cp})


@contextlib.contextmanager
def results_in_this_process() -> Iterator[None]:
    """For saves planned and written in this process (``execute_sync``): megatron-core 0.19.2 hands
    a save's write results over through one process-wide queue, which it makes on the first save
    from a *spawned* multiprocessing Manager: a new interpreter that imports the entry module, about
    3 s of CPU and up to 9 s of waiting per rank on a loaded 2-core box. Saves written here need no
    other process: a thread queue serves them. A background save (a forked writer) is planned
    outside this and gets megatron's own queue."""
    before = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = before


def dist_save_request(sharded_state_dict: dict, dist_dir: Path) -> AsyncRequest:
    """Collective. Plans a dist_checkpointing save into the existing ``dist_dir`` (with an integrity
    manifest) and returns it as megatron's ``AsyncRequest``: ``execute_sync()`` writes it here and
    now (what ``dist_checkpointing.save`` does), or ``run_checkpoint`` writes it in a background
    process. Its finalize functions write ``.metadata``, ``metadata.json`` and the manifest. A failed
    write names the file (``_naming_write_errors``)."""
    request = dist_checkpointing.save(
        sharded_state_dict, str(dist_dir), verify_integrity=True, async_sharded_save=True, async_strategy="mcore"
    )
    return request if request.async_fn is None else request._replace(async_fn=_naming_write_errors(request.async_fn))


def _naming_write_errors(write: Callable[..., None]) -> Callable[..., None]:
    """``write`` (megatron's ``write_preloaded_data_multiproc``), in whichever process runs it,
    with each shard file's failed write raised as an error naming the file (``_write_error``).
    megatron-core 0.19.2's ``FileSystemWriterAsync.write_preloaded_data`` returns the exception of
    a failed write and its caller reports only its type ("error: <class 'RuntimeError'>"); raised,
    the caller's message carries it into the ``CheckpointException`` the save's finalize raises.
    Only the caller's own bucket raises (``results_queue`` None): a worker thread must report
    through its queue, or the caller waits for it forever. With the default one thread per rank
    every bucket is the caller's."""
    original = FileSystemWriterAsync.__dict__["write_preloaded_data"]

    def write_one_bucket(
        transform_list: list,
        local_proc_idx: int,
        write_bucket: tuple,
        results_queue: Any,
        count_queue: Any,
        use_fsync: bool,
        **kwargs: Any,
    ) -> Any:
        output = original.__func__(
            transform_list, local_proc_idx, write_bucket, results_queue, count_queue, use_fsync, **kwargs
        )
        failure = output[1]
        if results_queue is None and isinstance(failure, Exception):
            path, _, (_, tensor_data) = write_bucket
            raise _write_error(failure, Path(path), sum(tensor.nbytes for _, tensor in tensor_data)) from failure
        return output

    @functools.wraps(write)
    def run(*args: Any, **kwargs: Any) -> None:
        FileSystemWriterAsync.write_preloaded_data = staticmethod(write_one_bucket)
        try:
            write(*args, **kwargs)
        finally:
            FileSystemWriterAsync.write_preloaded_data = original

    return run


def mcore_save_request(
    model: GPTModel,
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


def _write_error(failure: Exception, path: Path, size: int) -> Exception:
    """``failure`` of the write of ``size`` bytes of tensors to ``path``, naming the file. torch
    writes shards through its zip writer, whose error on a full disk is ``unexpected pos 704 vs
    598`` (the errno is lost): when the file system has less room left than the file's tensors,
    that is reported as the ENOSPC it was."""
    if isinstance(failure, OSError):
        return OSError(failure.errno, failure.strerror, str(path))
    free = shutil.disk_usage(path.parent).free
    if free < size:
        return OSError(
            errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({free} bytes free for {size} bytes of tensors)", str(path)
        )
    return RuntimeError(f"{path}: {failure}")


def save_mcore_checkpoint(
    model: GPTModel,
    arch: Architecture,
    groups: ParallelGroups,
    ckpt_dir: str | Path,
    *,
    side_files_from: str | Path | None = None,
) -> None:
    """Collective: every rank calls it with its shard."""
    with results_in_this_process():
        mcore_save_request(model, arch, groups, ckpt_dir, side_files_from=side_files_from).execute_sync()


def load_mcore_checkpoint(model: GPTModel, groups: ParallelGroups, ckpt_dir: str | Path) -> None:
    """Fill ``model`` (any layout) from a checkpoint written by ``save_mcore_checkpoint``."""
    weights = Path(ckpt_dir) / WEIGHTS_DIR
    if not weights.is_dir():
        raise FileNotFoundError(f"{weights}: missing; {ckpt_dir} is not a megatron-rlhf model checkpoint")
    verify = has_integrity_manifest(weights)
    if not verify:
        log(
            f"warning: {weights} has no {INTEGRITY_FNAME}: loaded unverified (dist_checkpointing unpickles its "
            ".metadata); load only model checkpoints you trust"
        )
    state = dist_checkpointing.load(_sharded_state_dict(model, groups), str(weights), verify_integrity=verify)
    model.load_state_dict(state, strict=True)
