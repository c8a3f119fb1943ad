"""A LoRA model's adapters as a PEFT adapter directory (``PeftModel.from_pretrained(base, dir)``),
written at the end of a run and read as a run's starting adapters (``lora.adapter_path``).

PEFT's names and shapes per adapted HF projection: ``lora_A`` (rank, in) and ``lora_B`` (out, rank)
under ``base_model.model.model.layers.<layer>.<self_attn|mlp>.<name>``. Our adapters already hold one
A and one B per PEFT name in HF's row order (``models/lora.py``); under TP, a column-parallel B is
split by rows (this rank's query groups or gate/up rows, in order) and a row-parallel A by columns,
so each is gathered by concatenating the TP ranks' shards. Each pipeline stage names its own layers
by their global numbers; rank 0 writes the one file. Causal LMs only: a score-head model would need
PEFT's ``modules_to_save`` for its head (SEQ_CLS), which is not written.

Reading is the reverse: each rank reads, through safetensors' lazy slices, its TP shard of each A
and B of its stage's layers. The directory is checked first (``adapter_errors``, at start-up, no
megatron needed): a LoRA adapter with the run's r, alpha and targets, no PEFT feature this stack does
not implement, and exactly the tensors, with their shapes, that the base model's adapters have.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_rlhf.metrics.log import log
from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.models.lora_config import ALL_LINEAR, TARGET_LINEARS, LoraConfig, target_shapes
from megatron_rlhf.parallel.layout import ParallelGroups

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
UNSUPPORTED_FEATURES = (
    "use_dora",
    "use_rslora",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "fan_in_fan_out",
    "layers_to_transform",
    "layers_pattern",
    "exclude_modules",
    "layer_replication",
    "lora_bias",
    "target_parameters",
    "trainable_token_indices",
    "alora_invocation_tokens",
    "use_qalora",
    "use_bdlora",
    "monteclora_config",
    "arrow_config",
    "kasa_config",
)
"""adapter_config.json keys of PEFT features that change what the adapter computes (or which modules
it holds), refused when set (not false, null or empty). Initialisation-only keys (init_lora_weights,
loftq_config, ...) do not matter for a trained adapter and are ignored, as are keys unknown here."""
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


def adapter_errors(setting: str, lora: LoraConfig, arch: Architecture) -> list[str]:
    """The problems of the adapter directory ``lora.adapter_path`` as a start for ``lora`` on
    ``arch`` (a model without adapters: none checked); ``setting`` is the LoRA section's full key
    (``actor.lora``), for the messages. Reads adapter_config.json and the safetensors header only."""
    if not (lora.enabled and lora.adapter_path):
        return []
    where = f"{setting}.adapter_path={lora.adapter_path!r}"
    config_file = Path(lora.adapter_path) / ADAPTER_CONFIG
    weights_file = Path(lora.adapter_path) / ADAPTER_WEIGHTS
    missing = [f.name for f in (config_file, weights_file) if not f.is_file()]
    if missing:
        return [f"{where}: {' and '.join(missing)} not found (expected a PEFT LoRA adapter directory)"]
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        return [f"{where}: {config_file} is not valid JSON: {err}"]
    if not isinstance(config, dict):
        return [f"{config_file}: expected a JSON object, found {type(config).__name__}"]
    errors = _feature_errors(config_file, config) + _setting_errors(setting, config_file, config, lora)
    return errors or [f"{where}: {problem}" for problem in _tensor_errors(weights_file, lora, arch)]


def _feature_errors(config_file: Path, config: dict[str, Any]) -> list[str]:
    errors = []
    if config.get("peft_type") != "LORA":
        errors.append(f"{config_file}: peft_type={config.get('peft_type')!r}, expected 'LORA'")
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        errors.append(
            f"{config_file}: task_type={config['task_type']!r}, expected 'CAUSAL_LM' (the decoder layers' "
            "adapters; a head kept in modules_to_save is not read)"
        )
    if config.get("bias", "none") != "none":
        errors.append(f"{config_file}: bias={config['bias']!r} trains biases, which is not supported (expected 'none')")
    errors += [
        f"{config_file}: {key}={config[key]!r} is a PEFT feature this stack does not implement (expected it unset)"
        for key in UNSUPPORTED_FEATURES
        if config.get(key)
    ]
    return errors


def _setting_errors(setting: str, config_file: Path, config: dict[str, Any], lora: LoraConfig) -> list[str]:
    """r, lora_alpha and target_modules against the run's settings: the run's own settings are what
    its config.yaml records, so a mismatch is an error naming the override rather than a silent
    choice of one of the two."""
    errors = []
    r, alpha, targets = config.get("r"), config.get("lora_alpha"), config.get("target_modules")
    if r != lora.rank:
        errors.append(f"{setting}.rank={lora.rank} but {config_file} has r={r!r}: pass {setting}.rank={r}")
    if not isinstance(alpha, int | float) or alpha != lora.alpha:
        errors.append(
            f"{setting}.alpha={lora.alpha} but {config_file} has lora_alpha={alpha!r}: pass {setting}.alpha={alpha}"
        )
    names = [targets] if targets == ALL_LINEAR else targets
    if not isinstance(names, list):
        errors.append(f"{config_file}: target_modules={targets!r}, expected a list of module names (not a pattern)")
        return errors
    unknown = [name for name in names if name not in TARGET_LINEARS and name != ALL_LINEAR]
    if unknown:
        errors.append(
            f"{config_file}: target_modules has {unknown}, which this stack does not adapt "
            f"(expected names from {[*TARGET_LINEARS, ALL_LINEAR]})"
        )
    elif set(adapted := LoraConfig(rank=1, target_modules=names).targets()) != set(lora.targets()):
        override = ALL_LINEAR if set(adapted) == set(TARGET_LINEARS) else ",".join(sorted(names))
        errors.append(
            f"{setting}.target_modules={lora.target_modules} but {config_file} has target_modules={names}: "
            f"pass {setting}.target_modules=[{override}]"
        )
    return errors


def expected_adapter_tensors(lora: LoraConfig, arch: Architecture) -> dict[str, tuple[int, int]]:
    """PEFT's name and full shape of every A and B of ``lora`` on ``arch``."""
    shapes = target_shapes(arch)
    expected = {}
    for layer in range(arch.num_layers):
        for name in lora.targets():
            prefix = peft_prefix(layer, name)
            expected[f"{prefix}.lora_A.weight"] = (lora.rank, shapes[name].in_features)
            expected[f"{prefix}.lora_B.weight"] = (shapes[name].out_features, lora.rank)
    return expected


def _tensor_errors(weights_file: Path, lora: LoraConfig, arch: Architecture) -> list[str]:
    expected = expected_adapter_tensors(lora, arch)
    with safe_open(weights_file, framework="pt") as handle:
        found = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118 (safe_open is not iterable)
    base = (
        f"for r={lora.rank} on a {arch.hf_class_name} of {arch.num_layers} layers (an adapter of another base model?)"
    )
    wrong = [name for name, shape in expected.items() if name in found and found[name] != shape]
    errors = (
        [
            f"{weights_file}: {len(wrong)} tensor(s) of another shape, e.g. {wrong[0]!r} has "
            f"{list(found[wrong[0]])}, expected {list(expected[wrong[0]])} {base}"
        ]
        if wrong
        else []
    )
    missing = [name for name in expected if name not in found]
    if missing:
        errors.append(
            f"{weights_file}: {len(missing)} tensor(s) missing, e.g. {missing[0]!r} "
            f"(expected shape {list(expected[missing[0]])}) {base}"
        )
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        errors.append(
            f"{weights_file}: {len(unexpected)} unexpected tensor(s), e.g. {unexpected[0]!r} "
            f"{list(found[unexpected[0]])} {base}"
        )
    return errors


def load_peft_adapter(
    model: GPTModel, groups: ParallelGroups, lora: LoraConfig, arch: Architecture, setting: str
) -> None:
    """Set ``model``'s adapters (``apply_lora``'s, for ``lora`` on ``arch``) to the PEFT adapter at
    ``lora.adapter_path``, each rank reading only its TP shard of its stage's layers (the reverse of
    ``save_peft_adapter``'s gather). Checked again here (``adapter_errors``; ``setting`` names the
    LoRA section) for a model built without the start-up check."""
    from megatron_rlhf.models.lora import adapted_linears

    errors = adapter_errors(setting, lora, arch)
    if errors:
        raise ValueError("; ".join(errors))
    trained_with = json.loads((Path(lora.adapter_path) / ADAPTER_CONFIG).read_text()).get("lora_dropout")
    if trained_with is not None and trained_with != lora.dropout:
        log(
            f"{setting}.dropout={lora.dropout} is this run's; the adapter at {lora.adapter_path} was trained with "
            f"lora_dropout={trained_with} (pass {setting}.dropout={trained_with} to keep it)"
        )
    tp_rank = groups.tp_rank
    with safe_open(Path(lora.adapter_path) / ADAPTER_WEIGHTS, framework="pt") as handle, torch.no_grad():
        for layer_number, _, adapter in adapted_linears(model):
            for name in adapter.targets:
                prefix = peft_prefix(layer_number - 1, name)
                a, b = handle.get_slice(f"{prefix}.lora_A.weight"), handle.get_slice(f"{prefix}.lora_B.weight")
                if adapter.input_is_split:  # row-parallel: this rank's input columns of A, B whole
                    width = adapter.lora_A[name].shape[1]
                    a_shard, b_shard = a[:, tp_rank * width : (tp_rank + 1) * width], b[:]
                else:  # column-parallel: A whole, this rank's output rows of B (in HF's row order)
                    rows = adapter.lora_B[name].shape[0]
                    a_shard, b_shard = a[:], b[tp_rank * rows : (tp_rank + 1) * rows]
                adapter.lora_A[name].copy_(a_shard)
                adapter.lora_B[name].copy_(b_shard)
