"""``megatron-rlhf convert``: HF safetensors <-> megatron-rlhf checkpoints, in any layout.

``mcore-to-hf`` also reads a trained model of a run checkpoint (``.../checkpoints/step_N/models/<name>``,
``train_state.py``'s format): its weights (the optimizer's state is left), and its architecture
from the ``models`` the training loop records in the checkpoint's ``run_state.json``. It is written
as the run's own export writes it (``export_hf``, with the tokenizer files of the run's base model).
A model trained with LoRA (its settings read from the run's ``config.yaml`` saved in the checkpoint)
gets its adapters before the load: ``output`` is then the merged model and, for a causal LM, the
PEFT adapter goes to ``<output>_adapter`` (``hf`` -> ``hf_adapter``, the run's names)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from megatron.core import dist_checkpointing
from megatron.core.models.gpt import GPTModel

from megatron_rlhf.checkpoint.export import export_hf
from megatron_rlhf.checkpoint.hf import checkpoint_torch_dtype, load_hf_weights, save_hf_checkpoint
from megatron_rlhf.checkpoint.mcore import (
    global_dp_rank_of,
    has_integrity_manifest,
    load_mcore_checkpoint,
    save_mcore_checkpoint,
)
from megatron_rlhf.checkpoint.mcore_meta import is_trained_model, read_architecture
from megatron_rlhf.checkpoint.run_checkpoint import RUN_STATE_FILE
from megatron_rlhf.checkpoint.sources import FOLLOW_ACTOR, local_dir, model_dir
from megatron_rlhf.data.tokenizer import Tokenizer, has_tokenizer, load_tokenizer
from megatron_rlhf.metrics.log import log, timed
from megatron_rlhf.models.architecture import Architecture, architecture_from_hf_config, load_architecture
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.lora import apply_lora
from megatron_rlhf.models.lora_config import LoraConfig
from megatron_rlhf.models.roles import RoleModel
from megatron_rlhf.parallel.distributed import init_distributed
from megatron_rlhf.parallel.layout import Layout, ParallelGroups, layout_errors, parallel_groups

DIRECTIONS = ("hf-to-mcore", "mcore-to-hf")


def convert(direction: str, source: str, output: str, *, tp: int, pp: int, device: str = "auto") -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"convert direction {direction!r} must be one of {list(DIRECTIONS)}")
    _check_output(Path(source), Path(output))
    trained = direction == "mcore-to-hf" and is_trained_model(source)
    if trained:  # a LoRA model's adapters go beside it
        _check_output(Path(source), Path(output).with_name(Path(output).name + "_adapter"))
    if direction == "hf-to-mcore":
        source = str(model_dir(source, setting="source"))  # a hub id: its snapshot in the local HF cache
        arch = load_architecture(source)
    else:
        arch = _trained_architecture(Path(source)) if trained else read_architecture(source)
    lora, base = _trained_lora(Path(source)) if trained else (LoraConfig(), "")
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
    if lora.enabled:  # the adapters' values come from the checkpoint (a strict load: they must be there)
        apply_lora(model, arch, lora, groups.pg_collection.tp, seed=0)
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
        elif trained:
            hf, base_dir = Path(output), _base_dir(base)
            role = RoleModel(role=Path(source).name, arch=arch, groups=groups, model=model, source=base_dir)
            export_hf(role, _tokenizer_of(base_dir), hf, adapter_dir=hf.with_name(hf.name + "_adapter"))
        else:
            save_hf_checkpoint(model, arch, groups, output, side_files_from=source)
    log(f"wrote {output} ({arch.hf_class_name}, layout {groups.layout})")
    dist.barrier()


def _check_output(source: Path, output: Path) -> None:
    """``output`` must be a new or empty directory: weight files beside an older model's would be
    read with or instead of the converted ones (an HF loader takes model.safetensors before an
    index of shards), and the source must stay as it is."""
    if output.exists() and not output.is_dir():
        raise ValueError(f"output {output} is a file; give the directory to write the converted model to")
    same = output.resolve() == source.resolve()
    if same or (output.exists() and any(output.iterdir())):
        raise ValueError(
            f"output {output} is {'the source' if same else 'not empty'}: give a new directory (a converted "
            "model's files beside another model's would mix the two)"
        )


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


def _trained_lora(model_dir: Path) -> tuple[LoraConfig, str]:
    """The LoRA settings and the base model path of a run checkpoint's trained model, from the
    ``config.yaml`` saved with it: the section named like the model (ppo's actor, critic), else
    ``model`` (sft's and rm's one model)."""
    config_file = model_dir.parent.parent / "config.yaml"
    if not config_file.is_file():
        raise ValueError(
            f"{model_dir}: {config_file} is missing, so whether the model has LoRA adapters is unknown "
            "(converted without them, it would be written as its base): convert the run's hf/ export instead"
        )
    run = yaml.safe_load(config_file.read_text())
    section = run.get(model_dir.name) if isinstance(run.get(model_dir.name), dict) else run.get("model")
    if not isinstance(section, dict):
        raise ValueError(f"{config_file}: neither a {model_dir.name} nor a model section (the model's settings)")
    path = section.get("path")
    if not path and model_dir.name in FOLLOW_ACTOR:  # an empty path started it from the actor's model
        path = (run.get("actor") or {}).get("path")
    if not path:
        raise ValueError(f"{config_file}: neither {model_dir.name}.path nor model.path is set (the model's section)")
    lora = section.get("lora") or {}  # none: a run from before LoRA, without adapters
    settings = {key: lora[key] for key in ("rank", "alpha", "dropout", "target_modules") if key in lora}
    return LoraConfig(**settings), str(path)


def _base_dir(path: str) -> Path:
    """Where the run read its base model (the PEFT adapter's base and the tokenizer files' source):
    its local directory, or the path as the run's config names it when that is no longer there."""
    try:
        return local_dir(path)
    except FileNotFoundError:
        return Path(path)


def _tokenizer_of(base_dir: Path) -> Tokenizer | None:
    """The run's tokenizer (its base model's files), whose special ids its export wrote into
    config.json: the conversion writes the same. None (the config as recorded) without the files."""
    if has_tokenizer(base_dir):
        return load_tokenizer(base_dir)
    log(f"no tokenizer files in {base_dir}: config.json gets the special ids the run's model config names only")
    return None


def _load_trained_weights(model: GPTModel, groups: ParallelGroups, model_dir: Path) -> None:
    """Fill ``model`` (any layout) with the weights of a run checkpoint's trained model."""
    dist_dir = model_dir / "dist"
    with global_dp_rank_of(groups):
        sharded = model.sharded_state_dict(metadata={"dp_cp_group": groups.pg_collection.dp_cp})
    loaded = dist_checkpointing.load(sharded, str(dist_dir), verify_integrity=has_integrity_manifest(dist_dir))
    model.load_state_dict(
        {key: value for key, value in loaded.items() if key in sharded}, strict=True
    )  # not the optimizer
