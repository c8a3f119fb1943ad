"""A LoRA model's adapters as a PEFT adapter directory (``PeftModel.from_pretrained(base, dir)``).

PEFT's names and shapes per adapted HF projection: ``lora_A`` (rank, in) and ``lora_B`` (out, rank)
under ``base_model.model.model.layers.<layer>.<self_attn|mlp>.<name>``. Our adapters already hold one
A and one B per PEFT name in HF's row order (``models/lora.py``); under TP, a column-parallel B is
split by rows (this rank's query groups or gate/up rows, in order) and a row-parallel A by columns,
so each is gathered by concatenating the TP ranks' shards. Each pipeline stage names its own layers
by their global numbers; rank 0 writes the one file. Causal LMs only: a score-head model would need
PEFT's ``modules_to_save`` for its head (SEQ_CLS), which is not written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megatron_rlhf.parallel.layout import ParallelGroups

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_HF_BLOCK = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def peft_prefix(layer: int, name: str) -> str:
    """PEFT's module path of HF projection ``name`` of decoder layer ``layer`` (0-based) in a saved
    causal-LM adapter."""
    return f"base_model.model.model.layers.{layer}.{_HF_BLOCK[name]}.{name}"


def _gather(shard: torch.Tensor, dim: int, groups: ParallelGroups) -> torch.Tensor:
    if groups.layout.tp == 1:
        return shard.detach()
    shards = [torch.empty_like(shard) for _ in range(groups.layout.tp)]
    dist.all_gather(shards, shard.detach().contiguous(), group=groups.pg_collection.tp)
    return torch.cat(shards, dim=dim)


def save_peft_adapter(model: GPTModel, groups: ParallelGroups, out_dir: str | Path, *, base_model: str) -> bool:
    """Write ``model``'s adapters to ``out_dir`` as a PEFT LoRA adapter of ``base_model`` (the path
    written as ``base_model_name_or_path``). Collective over the whole world. Returns False (and
    writes nothing) for a model without adapters."""
    from megatron_rlhf.models.lora import adapted_linears

    out = Path(out_dir)
    tensors: dict[str, torch.Tensor] = {}
    settings: set[tuple[int, float, float]] = set()
    targets: set[str] = set()
    is_writer = groups.tp_rank == 0 and groups.dp_rank == 0
    for layer_number, _, adapter in adapted_linears(model):
        settings.add((adapter.rank, adapter.scaling, adapter.dropout))
        for name in adapter.targets:
            targets.add(name)
            a, b = adapter.lora_A[name], adapter.lora_B[name]
            if adapter.input_is_split:  # row-parallel: A split by input columns, B whole
                a = _gather(a, 1, groups)
            else:  # column-parallel: B split by output rows, A whole
                b = _gather(b, 0, groups)
            if is_writer:
                prefix = peft_prefix(layer_number - 1, name)  # megatron counts layers from 1
                tensors[f"{prefix}.lora_A.weight"] = a.detach().to("cpu").contiguous()
                tensors[f"{prefix}.lora_B.weight"] = b.detach().to("cpu").contiguous()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (tensors, settings, targets))
    everyone: list[tuple[dict[str, torch.Tensor], set[tuple[int, float, float]], set[str]]] = gathered
    all_settings = {setting for _, found, _ in everyone for setting in found}
    if not all_settings:
        return False
    if len(all_settings) != 1:
        raise ValueError(f"the adapters differ in (rank, scaling, dropout): {sorted(all_settings)}; PEFT needs one")
    rank, scaling, dropout = all_settings.pop()
    if dist.get_rank() == 0:
        merged = {name: t for found, _, _ in everyone for name, t in found.items()}
        all_targets = {name for _, _, names in everyone for name in names}
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": rank,
            "lora_alpha": scaling * rank,
            "lora_dropout": dropout,
            "target_modules": sorted(all_targets),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "inference_mode": True,
        }
        out.mkdir(parents=True, exist_ok=True)
        save_file(dict(sorted(merged.items())), out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    dist.barrier()
    return True
