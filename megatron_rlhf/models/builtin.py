"""Built-in models: HF-format checkpoints with seeded random weights, made on first use.

``builtin:NAME`` lets every command run with no download (the default run, CI, benchmarks). The
checkpoint is written once as ordinary HF safetensors + ``config.json`` under the cache directory
and then goes through exactly the same import path as a user's checkpoint. Weights depend only on
NAME, never on the parallel layout or the world size.
"""

from __future__ import annotations

import json
import os
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megatron_rlhf.models.architecture import architecture_from_hf_config
from megatron_rlhf.models.hf_weights import hf_tensor_shapes

PREFIX = "builtin:"
_LLAMA = {"model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
_TINY = {
    **_LLAMA,
    "vocab_size": 512, "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
}  # fmt: skip
# The arithmetic task's model: its SentencePiece vocabulary (32 pieces, data/arithmetic.py), 0.8M
# parameters: it learns 2-digit addition and subtraction with worked steps from scratch on one CPU
# core, about 57% greedy test accuracy after 300 SFT steps (~100 CPU seconds), 97% after 600.
_ARITH = {
    **_LLAMA,
    "vocab_size": 32, "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 256,
    "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}  # fmt: skip
# Qwen2.5-1.5B dimensions with Llama layers: the benchmark shape.
_LLAMA_1_5B = {
    **_LLAMA,
    "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
    "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
}  # fmt: skip

BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-llama": {**_TINY, "architectures": ["LlamaForCausalLM"], "dtype": "float32"},
    "tiny-llama-rm": {**_TINY, "architectures": ["LlamaForSequenceClassification"], "num_labels": 1, "dtype": "float32"},
    "arith-llama": {**_ARITH, "architectures": ["LlamaForCausalLM"], "dtype": "float32"},
    "arith-llama-rm": {**_ARITH, "architectures": ["LlamaForSequenceClassification"], "num_labels": 1,
                       "dtype": "float32"},
    "llama-1.5b": {**_LLAMA_1_5B, "architectures": ["LlamaForCausalLM"], "dtype": "bfloat16"},
}
INIT_STD = 0.02
ARITHMETIC_MODELS = ("arith-llama", "arith-llama-rm")
"""Built-in models that ship the arithmetic task's tokenizer files; the others use bytes as tokens."""


def is_builtin(path: str) -> bool:
    return path.startswith(PREFIX)


def cache_dir() -> Path:
    return Path(os.environ.get("MEGATRON_RLHF_CACHE", Path.home() / ".cache" / "megatron_rlhf"))


def _write_checkpoint(name: str, target: Path) -> None:
    config = BUILTIN_CONFIGS[name]
    arch = architecture_from_hf_config(config, source=PREFIX + name)
    dtype = getattr(torch, config["dtype"])
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    tensors = {}
    for tensor_name, shape in hf_tensor_shapes(arch).items():
        if len(shape) == 1 and tensor_name.endswith("norm.weight"):
            tensors[tensor_name] = torch.ones(shape, dtype=dtype)
        else:
            tensors[tensor_name] = (torch.randn(shape, generator=generator) * INIT_STD).to(dtype)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if name in ARITHMETIC_MODELS:
        from megatron_rlhf.data.arithmetic import write_tokenizer  # lazy: data imports this module

        write_tokenizer(tmp)
    os.replace(tmp, target)  # atomic: a half-written checkpoint is never visible


def builtin_config(path: str) -> dict[str, Any]:
    """The HF config of ``builtin:NAME``."""
    name = path[len(PREFIX):]
    if name not in BUILTIN_CONFIGS:
        raise ValueError(f"unknown built-in model '{path}'; available: {[PREFIX + n for n in BUILTIN_CONFIGS]}")
    return BUILTIN_CONFIGS[name]


def made_once(target: Path, write: Callable[[Path], None]) -> Path:
    """``target`` in the cache, written by ``write(target)`` on rank 0 if it does not exist yet
    (``write`` must make it appear atomically); collective: every rank waits for it."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            write(target)
        except OSError:
            if not target.exists():  # another job may have won the race
                raise
    if dist.is_initialized():
        dist.barrier()
    return target


def builtin_checkpoint(path: str) -> Path:
    """The HF directory for ``builtin:NAME``, written by rank 0 on first use (collective)."""
    builtin_config(path)
    name = path[len(PREFIX):]
    return made_once(cache_dir() / "builtin" / f"{name}-v1", lambda target: _write_checkpoint(name, target))
