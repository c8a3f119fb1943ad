"""The HF export of a LoRA model: ``hf/`` holds the merged model (transformers loads the adapted
model's logits), ``hf_adapter/`` a PEFT adapter with PEFT's own names that, loaded on the base,
gives the merged model's logits; the model's own weights are left bit-identical."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from megatron_rlhf.checkpoint.export import export_hf
from megatron_rlhf.checkpoint.sources import ModelConfig, build_role
from megatron_rlhf.models.lora_config import LoraConfig
from tests.helpers import PAD_ID, VOCAB, make_tiny_hf_model

RANK, ALPHA = 4, 8.0
TOLERANCE = 1e-4
"""float32 throughout; HF's and megatron's kernels (rotary, softmax, sums in other orders) differ by
~1e-5 in these logits, while the adapters move them by more than 0.05."""


def _arch(hf_dir: Path):
    from megatron_rlhf.models.architecture import load_architecture

    return load_architecture(hf_dir)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (safe_open is not iterable)


@pytest.mark.parametrize("targets", [["all-linear"], ["k_proj", "up_proj", "o_proj"]])
def test_hf_is_merged_and_hf_adapter_loads_in_peft(world_of_one, tmp_path: Path, targets: list[str]) -> None:
    import peft
    from transformers import AutoModelForCausalLM

    from megatron_rlhf.models.lora import adapters

    base_dir = tmp_path / "base"
    make_tiny_hf_model("qwen2", False, base_dir)
    role = build_role(
        "actor",
        ModelConfig(path=str(base_dir), lora=LoraConfig(rank=RANK, alpha=ALPHA, target_modules=targets)),
        _arch(base_dir),
        world_size=1,
        dtype=torch.float32,
        device=torch.device("cpu"),
        seed=5,
    )
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B starts at zero: give it values so that the adapters change the model
        for adapter in adapters(role.model):
            for b in adapter.lora_B.values():
                b.copy_(0.2 * torch.randn(b.shape, generator=generator))
    input_ids = torch.randint(0, PAD_ID, (2, 10), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(10)[None].expand_as(input_ids)
    with torch.no_grad():
        ours = role.model(input_ids, positions, None)[..., :VOCAB]
    before = {name: p.detach().clone() for name, p in role.model.named_parameters()}

    tokenizer: Any = types.SimpleNamespace(pad_id=PAD_ID, bos_id=None, eos_id=None, stop_ids=(), chat_template=None)
    export_hf(role, tokenizer, tmp_path / "hf", adapter_dir=tmp_path / "hf_adapter")

    for name, param in role.model.named_parameters():  # the model itself is untouched
        assert torch.equal(param, before[name]), name
    assert all(adapter.enabled for adapter in adapters(role.model))

    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).eval()
        base_logits = base(input_ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
        merged_logits = merged(input_ids).logits
        assert (ours - base_logits).abs().max() > 0.05  # the adapters matter
        assert (merged_logits - ours).abs().max() < TOLERANCE
        with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "hf_adapter").eval()
        assert (with_adapter(input_ids).logits - merged_logits).abs().max() < TOLERANCE

    # The directory is what PEFT itself saves for the same adapters: its names, shapes and settings.
    names = "all-linear" if targets == ["all-linear"] else targets
    fresh = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    real = peft.get_peft_model(
        fresh, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=names, task_type="CAUSAL_LM")
    )
    real.save_pretrained(tmp_path / "real")
    theirs = _tensors(tmp_path / "real" / "adapter_model.safetensors")
    mine = _tensors(tmp_path / "hf_adapter" / "adapter_model.safetensors")
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in theirs.items()}
    assert "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight" in mine
    their_config = json.loads((tmp_path / "real" / "adapter_config.json").read_text())
    my_config = json.loads((tmp_path / "hf_adapter" / "adapter_config.json").read_text())
    for key in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "bias", "fan_in_fan_out", "use_dora"):
        assert my_config[key] == their_config[key], key
    assert set(my_config["target_modules"]) == set(their_config["target_modules"])
    assert my_config["base_model_name_or_path"] == str(base_dir)


def test_the_adapter_of_a_hub_model_names_its_hub_id(world_of_one, tmp_path: Path, monkeypatch) -> None:
    """A base read from the Hugging Face cache by its hub id: the adapter named the snapshot's path on
    this machine, which PEFT cannot find on another. It names the hub id now, and PEFT's
    ``AutoPeftModelForCausalLM`` loads the base through it (from the same cache, with no network)."""
    from peft import AutoPeftModelForCausalLM

    from tests.unit.test_config_slips import HUB_ID, _cached_model

    snapshot = _cached_model(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)  # no directory named like the hub id here
    role = build_role(
        "actor",
        ModelConfig(path=HUB_ID, lora=LoraConfig(rank=RANK, alpha=ALPHA)),
        _arch(snapshot),
        world_size=1,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    assert role.source == snapshot and role.hub_id == HUB_ID
    tokenizer: Any = types.SimpleNamespace(pad_id=PAD_ID, bos_id=None, eos_id=None, stop_ids=(), chat_template=None)
    export_hf(role, tokenizer, tmp_path / "hf", adapter_dir=tmp_path / "hf_adapter")
    config = json.loads((tmp_path / "hf_adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == HUB_ID
    loaded = AutoPeftModelForCausalLM.from_pretrained(
        tmp_path / "hf_adapter", torch_dtype=torch.float32, cache_dir=tmp_path / "hub", local_files_only=True
    )
    assert loaded.peft_config["default"].base_model_name_or_path == HUB_ID
