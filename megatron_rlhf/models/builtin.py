"""Built-in models: HF-format checkpoints with seeded random weights, made on first use.

``builtin:NAME`` lets every command run with no download (the default run, CI, benchmarks). The
checkpoint is written once as ordinary HF safetensors + ``config.json`` + tokenizer files under the
cache directory and then goes through exactly the same import path as a user's checkpoint. Weights
depend only on NAME, never on the parallel layout or the world size.

The tokenizer is UTF-8 bytes as tokens (``data.tokenizer.ByteTokenizer`` gives the same ids), written
as an HF ``tokenizer.json``: ids pad 0, bos 1, eos 2, byte b -> b + 3; the ids from 259 up exist in
the model (a random model samples them) and decode to U+FFFD. Being an ordinary HF tokenizer, it
travels with an exported model, and transformers' ``AutoTokenizer`` reads it. Like any HF tokenizer
it reads its special-token strings (``<|eos|>``) in a text as those tokens.
"""

from __future__ import annotations

import json
import os
import re
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
from megatron_rlhf.tasks import arithmetic_tool
from megatron_rlhf.tasks.arithmetic import write_tokenizer

PREFIX = "builtin:"
_LLAMA = {"model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
_TINY = {
    **_LLAMA,
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
}
# The arithmetic task's model: its SentencePiece vocabulary (32 pieces, tasks/arithmetic.py), 0.8M
# parameters: it learns 2-digit addition and subtraction with worked steps from scratch on one CPU
# core, about 57% greedy test accuracy after 300 SFT steps (~100 CPU seconds), 97% after 600.
_ARITH = {
    **_LLAMA,
    "vocab_size": 32,
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# The tool task's model (tasks/arithmetic_tool.py): arith-llama's layers, the tool task's vocabulary.
_ARITH_TOOL = {**_ARITH, "vocab_size": arithmetic_tool.TOKENIZER_VOCAB_SIZE}
# Qwen2.5-1.5B dimensions with Llama layers: the benchmark shape.
_LLAMA_1_5B = {
    **_LLAMA,
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}

# Qwen2.5-7B dimensions with Llama layers (7.6B parameters, untied): the one-GPU 7B benchmark shape.
# Written once in bf16 (15 GB): each tensor is drawn in fp32 and cast on its own, so the host holds
# the bf16 tensors plus one fp32 tensor (the largest, an embedding, 2.2 GB) at a time.
_LLAMA_7B = {
    **_LLAMA,
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}

BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-llama": {**_TINY, "architectures": ["LlamaForCausalLM"], "dtype": "float32"},
    "tiny-llama-rm": {
        **_TINY,
        "architectures": ["LlamaForSequenceClassification"],
        "num_labels": 1,
        "dtype": "float32",
    },
    "arith-llama": {**_ARITH, "architectures": ["LlamaForCausalLM"], "dtype": "float32"},
    "arith-llama-rm": {
        **_ARITH,
        "architectures": ["LlamaForSequenceClassification"],
        "num_labels": 1,
        "dtype": "float32",
    },
    "arith-tool-llama": {**_ARITH_TOOL, "architectures": ["LlamaForCausalLM"], "dtype": "float32"},
    "llama-1.5b": {**_LLAMA_1_5B, "architectures": ["LlamaForCausalLM"], "dtype": "bfloat16"},
    "llama-1.5b-rm": {
        **_LLAMA_1_5B,
        "architectures": ["LlamaForSequenceClassification"],
        "num_labels": 1,
        "dtype": "bfloat16",
    },
    "llama-7b": {**_LLAMA_7B, "architectures": ["LlamaForCausalLM"], "dtype": "bfloat16"},
}
INIT_STD = 0.02
BYTE_SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>")
"""The byte tokenizer's special tokens (pad, bos, eos): their ids are their positions; byte b is id
b + len(BYTE_SPECIALS)."""
ARITHMETIC_MODELS = ("arith-llama", "arith-llama-rm")
"""Built-in models that ship the arithmetic task's tokenizer files; ``arith-tool-llama`` ships the
tool task's, the others the byte tokenizer."""


def is_builtin(path: str) -> bool:
    return path.startswith(PREFIX)


def cache_dir() -> Path:
    return Path(os.environ.get("MEGATRON_RLHF_CACHE", Path.home() / ".cache" / "megatron_rlhf"))


def _byte_chars() -> list[str]:
    """The stand-in character of each byte 0..255 in a byte-level ``tokenizer.json`` (GPT-2's table,
    the one the ``tokenizers`` ByteLevel pre-tokenizer and decoder use)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def _write_byte_tokenizer(directory: Path, config: dict[str, Any]) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` of the byte tokenizer (see the module docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import ByteLevel

    first_unused = len(BYTE_SPECIALS) + 256
    tokens = [*BYTE_SPECIALS, *_byte_chars(), *(f"<|unused_{i}|>" for i in range(first_unused, config["vocab_size"]))]
    tokenizer = Tokenizer(BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=[]))
    tokenizer.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)  # no merges: one token a byte
    # Decoding, token by token: specials carry no text, unused ids show as U+FFFD, then the bytes
    # (and U+FFFD's own) are read as UTF-8, each invalid sequence as U+FFFD: ByteTokenizer.decode.
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace(Regex("^(" + "|".join(map(re.escape, BYTE_SPECIALS)) + ")$"), ""),
            decoders.Replace(Regex(r"^<\|unused_\d+\|>$"), "\ufffd"),
            decoders.ByteLevel(),
        ]
    )
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in BYTE_SPECIALS])
    tokenizer.save(str(directory / "tokenizer.json"))
    pad, bos, eos = BYTE_SPECIALS
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": pad,
        "bos_token": bos,
        "eos_token": eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


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
        write_tokenizer(tmp)
    elif name == "arith-tool-llama":
        arithmetic_tool.write_tokenizer(tmp, config["max_position_embeddings"])
    else:
        _write_byte_tokenizer(tmp, config)
    os.replace(tmp, target)  # atomic: a half-written checkpoint is never visible


def builtin_config(path: str) -> dict[str, Any]:
    """The HF config of ``builtin:NAME``."""
    name = path[len(PREFIX) :]
    if name not in BUILTIN_CONFIGS:
        raise ValueError(f"unknown built-in model '{path}'; available: {[PREFIX + n for n in BUILTIN_CONFIGS]}")
    return BUILTIN_CONFIGS[name]


def made_once(target: Path, write: Callable[[Path], object]) -> Path:
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
    name = path[len(PREFIX) :]
    # v2: with tokenizer files (v1 had none); the weights are the same.
    return made_once(cache_dir() / "builtin" / f"{name}-v2", lambda target: _write_checkpoint(name, target))
