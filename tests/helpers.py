"""Shared test helpers: tiny random HF models made with transformers, torchrun launching."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
VOCAB = 97  # prime: never a multiple of the padding step, so padding is always exercised
PAD_ID = VOCAB - 1  # inputs never contain it, so HF pools sequence scores at the last position

# Each family exercises the feature it is known for.
FAMILY_OVERRIDES = {
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                  max_position_embeddings=64, rope_theta=500000.0),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=24),  # head_dim != hidden/heads
    "mistral": dict(sliding_window=6),  # shorter than the test sequences
}  # fmt: skip


def hf_classes(family: str):
    import transformers

    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[family]
    return (
        getattr(transformers, prefix + "Config"),
        getattr(transformers, prefix + "ForCausalLM"),
        getattr(transformers, prefix + "ForSequenceClassification"),
    )


def make_tiny_hf_model(family: str, score_head: bool, out_dir: str | Path, *, seed: int = 0, **overrides):
    """Save a tiny random HF model (fp32) made with transformers, and return it (eval mode)."""
    config_cls, lm_cls, cls_cls = hf_classes(family)
    sharded = overrides.pop("sharded", False)
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=PAD_ID, num_labels=1,
        attn_implementation="eager",
    )  # fmt: skip
    kwargs.update(FAMILY_OVERRIDES[family])
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = (cls_cls if score_head else lm_cls)(config).eval()
    with torch.no_grad():  # larger than HF's init so that layout bugs show up in the logits
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    save_kwargs = dict(max_shard_size="40KB") if sharded else {}
    model.save_pretrained(out_dir, **save_kwargs)
    return model


def hf_reference_outputs(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-token logits (causal LM) or per-token scores (sequence classifier)."""
    with torch.no_grad():
        if hasattr(model, "score"):
            hidden = model.model(input_ids).last_hidden_state
            return model.score(hidden)
        return model(input_ids).logits


def load_all_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(str(Path(model_dir) / "*.safetensors"))):
        tensors.update(load_file(path))
    return tensors


def subprocess_env() -> dict[str, str]:
    """This environment with the repo first on PYTHONPATH (carried packages stay reachable)."""
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1")


def run_torchrun(script: Path, nproc: int, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = subprocess_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
