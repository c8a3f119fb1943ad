"""A trainer's final export: the trained model as an HF checkpoint that ``from_pretrained`` loads."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rlhf.checkpoint.hf import save_hf_checkpoint, side_files_in
from megatron_rlhf.checkpoint.peft_adapter import save_peft_adapter
from megatron_rlhf.data.tokenizer import Tokenizer, template_turn_end
from megatron_rlhf.metrics.log import log
from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.models.lora import adapted_weights
from megatron_rlhf.models.roles import RoleModel


def with_token_ids(arch: Architecture, tokenizer: Tokenizer) -> tuple[Architecture, dict[str, int]]:
    """The architecture with the tokenizer's special ids in its HF config where it names none, and
    those it added. ``pad_token_id`` only for a score-head model: transformers needs it to find each
    row's last token when it scores a batch. A causal LM keeps the config's (often none): written
    there, the pad (often the EOS) becomes its embedding's ``padding_idx`` in transformers, whose
    row then gets no gradient in further training."""
    hf_config = dict(arch.hf_config)
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    if arch.score_head:
        ids["pad_token_id"] = tokenizer.pad_id
    added = {key: value for key, value in ids.items() if hf_config.get(key) is None and value is not None}
    return dataclasses.replace(arch, hf_config={**hf_config, **added}), added


def stop_at_turn_end(hf_dir: Path, tokenizer: Tokenizer) -> int | None:
    """Add the chat template's turn end (``template_turn_end``) to ``hf_dir``'s generation_config.json
    eos_token_id where the tokenizer does not stop there (a base model's EOS beside ChatML's
    <|im_end|>, Qwen2.5's base models), as such models' instruct releases do: transformers'
    generate, vLLM and a later run of this stack then end a reply where the template ends a turn, not
    past it. Returns the id added (None: nothing to add)."""
    turn_end = template_turn_end(tokenizer)
    if turn_end is None or turn_end in tokenizer.stop_ids:
        return None
    path = hf_dir / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {"bos_token_id": tokenizer.bos_id}
    eos = config.get("eos_token_id")
    named = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    config["eos_token_id"] = [*dict.fromkeys([*named, *tokenizer.stop_ids]), turn_end]
    path.write_text(json.dumps(config, indent=2) + "\n")
    return turn_end


def export_hf(role: RoleModel, tokenizer: Tokenizer | None, hf_dir: Path, *, adapter_dir: Path | None = None) -> None:
    """Write ``role``'s model to ``hf_dir`` with the tokenizer files of ``role.source`` (collective);
    ``tokenizer``'s special ids go into config.json where it names none (``with_token_ids``; None: the config as
    recorded). A model with a non-finite weight on any rank is refused: it
    would load and produce garbage. A LoRA model is written merged; a LoRA causal LM's adapters also
    go to ``adapter_dir`` (when given) as a PEFT adapter of ``role.hub_id`` or else ``role.source``
    (a score-head model's are not: PEFT would need its head too)."""
    local_ok = all(bool(torch.isfinite(param).all()) for param in role.model.parameters())
    bad = torch.tensor([0.0 if local_ok else 1.0], device=next(role.model.parameters()).device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item():
        raise ValueError(f"the {role.role} has non-finite weights: not exported to {hf_dir}")
    arch, added = (role.arch, {}) if tokenizer is None else with_token_ids(role.arch, tokenizer)
    if added:
        log(f"config.json of {hf_dir} names the tokenizer's {added}, which {role.source}'s config left unset")
    start = time.perf_counter()
    staging = _staging(hf_dir)
    if dist.get_rank() == 0:  # what an export cut short left
        for leftover in (staging, *([_staging(adapter_dir)] if adapter_dir is not None else [])):
            shutil.rmtree(leftover, ignore_errors=True)
    save_hf_checkpoint(role.model, arch, role.groups, staging, side_files_from=role.source)
    lora = any(True for _ in adapted_weights(role.model))
    merged = "merged LoRA adapters; " if lora else ""
    log(
        f"{merged}saved HF checkpoint ({arch.hf_class_name}) to {hf_dir} in {time.perf_counter() - start:.1f}s; "
        f"copied {', '.join(side_files_in(role.source))} from {role.source}"
    )
    if tokenizer is not None and not arch.score_head and dist.get_rank() == 0:
        turn_end = stop_at_turn_end(staging, tokenizer)
        if turn_end is not None:
            log(
                f"generation_config.json of {hf_dir}: eos_token_id now also names {tokenizer.decode([turn_end])!r} "
                f"(id {turn_end}), where the chat template ends a turn: generate stops a reply there"
            )
    finished = [(staging, hf_dir)]
    if lora and adapter_dir is not None and not arch.score_head:
        base = role.hub_id or str(role.source)
        save_peft_adapter(role.model, role.groups, _staging(adapter_dir), base_model=base)
        finished.append((_staging(adapter_dir), adapter_dir))
        log(f"saved the LoRA adapters as a PEFT adapter of {base} to {adapter_dir}")
    if dist.get_rank() == 0:
        for written, final in finished:
            _move_into_place(written, final)
    dist.barrier()


def _staging(final: Path) -> Path:
    """Where an export into ``final`` is written before it takes ``final``'s place (``_move_into_place``)."""
    return final.with_name(f".{final.name}.partial")


def _move_into_place(written: Path, final: Path) -> None:
    """``written`` becomes ``final``, whatever ``final`` held going whole: an earlier export's files
    (another layout's shards, a side file this model lacks) never stay beside the new ones, and an
    export cut short leaves the earlier one in place."""
    old = final.with_name(f".{final.name}.replaced")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    written.rename(final)
    shutil.rmtree(old, ignore_errors=True)
