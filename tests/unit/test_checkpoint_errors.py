"""Bad checkpoints get errors that name the file, the tensor and what was expected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import make_tiny_hf_model


def _import(hf_dir: Path) -> None:
    from megatron_rlhf.checkpoint.hf import load_hf_weights
    from megatron_rlhf.models.architecture import load_architecture
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.parallel.layout import Layout, parallel_groups

    arch = load_architecture(hf_dir)
    groups = parallel_groups(Layout.for_world(1, 1, 1))
    model = build_model(arch, groups, dtype=torch.float32, device=torch.device("cpu"))
    load_hf_weights(model, arch, groups, hf_dir)


def _edit_tensors(hf_dir: Path, edit) -> None:
    path = hf_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture
def llama_dir(tmp_path: Path, world_of_one) -> Path:
    make_tiny_hf_model("llama", False, tmp_path / "hf")
    return tmp_path / "hf"


def test_clean_checkpoint_imports(llama_dir: Path) -> None:
    _import(llama_dir)  # the control: the edits below are what breaks it


def test_missing_tensor_is_named(llama_dir: Path) -> None:
    _edit_tensors(llama_dir, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    from megatron_rlhf.checkpoint.hf import CheckpointError

    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.2\.mlp\.up_proj\.weight' is missing"):
        _import(llama_dir)


def test_shape_mismatch_names_file_tensor_and_shapes(llama_dir: Path) -> None:
    def shrink(tensors):
        tensors["model.layers.1.self_attn.k_proj.weight"] = tensors["model.layers.1.self_attn.k_proj.weight"][:8]

    _edit_tensors(llama_dir, shrink)
    from megatron_rlhf.checkpoint.hf import CheckpointError

    with pytest.raises(CheckpointError) as err:
        _import(llama_dir)
    message = str(err.value)
    assert "model.safetensors" in message and "model.layers.1.self_attn.k_proj.weight" in message
    assert "[8, 64]" in message and "[32, 64]" in message


def test_unexpected_tensor_is_refused(llama_dir: Path) -> None:
    _edit_tensors(llama_dir, lambda t: t.__setitem__("model.layers.9.mlp.up_proj.weight", torch.zeros(2)))
    from megatron_rlhf.checkpoint.hf import CheckpointError

    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) do not belong to a LlamaForCausalLM.*layers\.9"):
        _import(llama_dir)


def test_unsupported_architecture_names_field(llama_dir: Path) -> None:
    config = json.loads((llama_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (llama_dir / "config.json").write_text(json.dumps(config))
    from megatron_rlhf.models.architecture import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=r"config\.json: architectures\[0\]='GPT2LMHeadModel'"):
        _import(llama_dir)


def test_index_listing_a_missing_shard(tmp_path: Path, world_of_one) -> None:
    hf_dir = tmp_path / "hf"
    make_tiny_hf_model("qwen2", False, hf_dir, sharded=True)
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (hf_dir / victim).unlink()
    from megatron_rlhf.checkpoint.hf import CheckpointError

    with pytest.raises(CheckpointError, match=rf"lists {victim}, which does not exist"):
        _import(hf_dir)


def test_a_truncated_weights_file_is_named(llama_dir: Path) -> None:
    """Before: 13 frames ending in safetensors' "incomplete metadata", no file named."""
    from megatron_rlhf.checkpoint.hf import CheckpointError

    weights = llama_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=f"{weights}: not a readable safetensors file .*truncated or damaged"):
        _import(llama_dir)


def test_pytorch_bin_weights_are_named_as_unread(llama_dir: Path) -> None:
    (llama_dir / "model.safetensors").rename(llama_dir / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin: PyTorch \.bin weights, which are not read"):
        _import(llama_dir)
