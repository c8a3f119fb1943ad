"""HF safetensors in and out of any TP/PP layout.

Import: every rank opens the checkpoint (single file or sharded with an index) and reads, through
safetensors' lazy slices, only the rows and columns of its own shard: no rank ever materialises a
full tensor it does not hold. Each tensor's shape is checked against ``config.json`` first.

Export: TP shards are gathered one parameter at a time to the first TP rank of data-parallel
replica 0 of each pipeline stage; each such writer streams its stage into its own safetensors
files, and rank 0 writes the index, ``config.json`` and the tokenizer files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.models.hf_weights import (
    ALL,
    LM_HEAD_TENSOR,
    SCORE_HEAD_TENSOR,
    exported_maps,
    hf_from_shards,
    hf_tensor_shapes,
    shard_from_hf,
    tensor_maps,
)
from megatron_rlhf.parallel.layout import ParallelGroups

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Files copied verbatim from the source checkpoint on export, so the result is a usable HF model.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "added_tokens.json",
    "chat_template.jinja",
)
_IGNORED_HF_TENSORS = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint does not match what its config describes; the message names file and tensor."""


class _TensorSlice(Protocol):
    """What ``safe_open(...).get_slice`` returns (safetensors types it only as Any): a tensor's
    shape, and its rows or (rows, columns) read on indexing."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


class SafetensorsCheckpoint:
    """An HF safetensors checkpoint directory, read lazily tensor by tensor."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        index = self.dir / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.file_of = {name: self.dir / file for name, file in weight_map.items()}
        elif (self.dir / SINGLE_FILE).is_file():
            with _opened(self.dir / SINGLE_FILE) as handle:
                self.file_of = {name: self.dir / SINGLE_FILE for name in handle.keys()}  # noqa: SIM118 (safe_open is not iterable)
        else:
            pickled = sorted(p.name for p in self.dir.glob("*.bin"))
            hint = (
                f" ({', '.join(pickled)}: PyTorch .bin weights, which are not read; save the model with "
                "transformers' save_pretrained, which writes safetensors)"
                if pickled
                else ""
            )
            raise FileNotFoundError(f"{self.dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found{hint}")
        for path in set(self.file_of.values()):
            if not path.is_file():
                raise CheckpointError(f"{index}: lists {path.name}, which does not exist")
        self._handles: dict[Path, safe_open] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def names(self) -> set[str]:
        return set(self.file_of)

    def _slice(self, name: str) -> _TensorSlice:
        if name not in self.file_of:
            raise CheckpointError(f"{self.dir}: tensor '{name}' is missing from the checkpoint")
        path = self.file_of[name]
        if path not in self._handles:
            self._handles[path] = _opened(path)
        return self._handles[path].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, rows: slice = ALL, cols: slice = ALL) -> torch.Tensor:
        tensor_slice = self._slice(name)
        if len(tensor_slice.get_shape()) == 1:
            return tensor_slice[rows]
        return tensor_slice[rows, cols]


def _opened(path: Path) -> safe_open:
    """``safe_open``, with a damaged file (cut short by a failed copy or download) named."""
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as err:
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({err}): truncated or damaged; copy or download it again"
        ) from None


def load_hf_weights(
    model: GPTModel, arch: Architecture, groups: ParallelGroups, model_dir: str | Path, *, new_head: bool = False
) -> None:
    """Fill this rank's shard of ``model`` from the HF checkpoint in ``model_dir``.

    ``new_head``: ``model`` has a score head and ``model_dir`` holds a causal LM (a critic or a
    reward model started from a policy): the backbone is loaded, the LM head is left out and the
    score head starts at zero (every score 0 at first, the same on every rank; the head's gradient
    is not zero, so it learns from the first step).
    """
    source = SafetensorsCheckpoint(model_dir)
    layout = groups.layout
    _check_no_unexpected_tensors(source, arch, also_expected=(LM_HEAD_TENSOR,) if new_head else ())
    params = dict(model.named_parameters())
    padded_vocab = model.vocab_size  # as built: the padding depends on the run, not the checkpoint
    loaded = set()
    for tmap in tensor_maps(arch, layout.pp, groups.pp_rank):
        if new_head and tmap.hf == (SCORE_HEAD_TENSOR,):
            with torch.no_grad():
                params[tmap.mcore].zero_()
            loaded.add(tmap.mcore)
            continue
        param = params[tmap.mcore]
        for name, shape in zip(tmap.hf, tmap.hf_shapes, strict=True):
            got = source.shape(name)
            if got != shape:
                raise CheckpointError(
                    f"{source.file_of[name]}: tensor '{name}' has shape {list(got)}, "
                    f"but config.json implies {list(shape)}"
                )
        shard = shard_from_hf(tmap, source, arch, layout.tp, groups.tp_rank, padded_vocab)
        with torch.no_grad():
            param.copy_(shard.to(dtype=param.dtype))
        loaded.add(tmap.mcore)
    unfilled = set(params) - loaded
    if unfilled:
        raise RuntimeError(f"internal error: no HF tensor maps to parameters {sorted(unfilled)}")


def _check_no_unexpected_tensors(
    source: SafetensorsCheckpoint, arch: Architecture, also_expected: tuple[str, ...] = ()
) -> None:
    expected = hf_tensor_shapes(arch).keys() | set(also_expected)
    unexpected = sorted(name for name in source.names() - expected if not name.endswith(_IGNORED_HF_TENSORS))
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        raise CheckpointError(
            f"{source.dir}: {len(unexpected)} tensor(s) do not belong to a {arch.hf_class_name} "
            f"as described by config.json: {shown}"
        )


def checkpoint_torch_dtype(arch: Architecture, fallback: torch.dtype) -> torch.dtype:
    """The dtype the HF config declares, or ``fallback`` when it declares none."""
    name = arch.checkpoint_dtype
    return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else fallback


def side_files_in(directory: str | Path) -> list[str]:
    """The tokenizer/generation files of ``directory`` that travel with exported weights."""
    return [name for name in SIDE_FILES if (Path(directory) / name).is_file()]


def copy_side_files(source: str | Path, target: str | Path) -> None:
    for name in side_files_in(source):
        shutil.copy2(Path(source) / name, Path(target) / name)


def save_hf_checkpoint(
    model: GPTModel,
    arch: Architecture,
    groups: ParallelGroups,
    out_dir: str | Path,
    *,
    side_files_from: str | Path | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> None:
    """Write ``model`` (any layout) as an HF checkpoint loadable by ``from_pretrained``. A LoRA
    model's adapted weights are written merged (``lora.merged_weight``: the model the adapters
    make), computed per tensor beside the model, whose own weights are never touched.

    Collective over the whole world: every rank must call it.
    """
    from megatron_rlhf.models.lora import adapted_weights, merged_weight

    out = Path(out_dir)
    layout = groups.layout
    is_writer = groups.tp_rank == 0 and groups.dp_rank == 0
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    params = dict(model.named_parameters())
    adapter_of = {id(weight): adapter for weight, adapter in adapted_weights(model)}
    weight_map: dict[str, str] = {}
    pending: dict[str, torch.Tensor] = {}
    pending_bytes, part = 0, 0

    def flush() -> None:
        nonlocal pending, pending_bytes, part
        if not pending:
            return
        filename = f"model-pp{groups.pp_rank:03d}-{part:05d}.safetensors"
        save_file(pending, out / filename, metadata={"format": "pt"})
        weight_map.update({name: filename for name in pending})
        pending, pending_bytes, part = {}, 0, part + 1

    for tmap in exported_maps(arch, layout.pp, groups.pp_rank):
        param = params[tmap.mcore]
        adapter = adapter_of.get(id(param))
        shard = param.detach() if adapter is None else merged_weight(param, adapter)
        if tmap.kind == "replicated" or layout.tp == 1:
            shards = [shard]
        else:
            shards = [torch.empty_like(shard) for _ in range(layout.tp)]
            dist.all_gather(shards, shard.contiguous(), group=groups.pg_collection.tp)
        if not is_writer:
            continue
        for name, tensor in hf_from_shards(tmap, shards, arch).items():
            tensor = tensor.to(device="cpu", dtype=checkpoint_torch_dtype(arch, tensor.dtype)).contiguous()
            pending[name] = tensor
            pending_bytes += tensor.numel() * tensor.element_size()
        if pending_bytes >= max_shard_bytes:
            flush()
    flush()

    all_maps: list[dict[str, str]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(all_maps, weight_map)
    if dist.get_rank() == 0:
        merged = {name: file for m in all_maps for name, file in m.items()}
        total = sum((out / f).stat().st_size for f in set(merged.values()))
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(merged.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (out / "config.json").write_text(json.dumps(arch.hf_config, indent=2) + "\n")
        if side_files_from is not None:
            copy_side_files(side_files_from, out)
    dist.barrier()
