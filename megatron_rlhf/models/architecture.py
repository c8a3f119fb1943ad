"""What a model is, read from a Hugging Face ``config.json``: the one place HF configs are parsed.

Supported families: Llama (2, 3, 3.1 rope scaling), Qwen2/2.5 (qkv bias), Qwen3 (qk-norm),
Mistral (optional sliding window). Both the causal-LM head and the ``*ForSequenceClassification``
``score`` head (used by critics and reward models) are read. Both the transformers 4.x config
layout (``rope_theta`` + ``rope_scaling``) and the 5.x one (``rope_parameters``) are accepted.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
_CLASS_SUFFIXES = ("ForCausalLM", "ForSequenceClassification")
_FAMILY_CLASS_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this stack cannot build; the message says which field."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Llama3RopeScaling:
    """Llama 3.1-style frequency-dependent rope scaling (HF ``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Architecture:
    """The shape of a decoder-only transformer, independent of the parallel layout."""

    family: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    # A score head (hidden -> num_labels) replaces the LM head: critics and reward models.
    score_head: bool = False
    num_labels: int = 1
    # The HF config this was read from, kept verbatim so that export writes it back unchanged.
    hf_config: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def checkpoint_dtype(self) -> str | None:
        """The dtype the HF checkpoint declares (``dtype`` in transformers 5, ``torch_dtype`` before)."""
        return self.hf_config.get("dtype") or self.hf_config.get("torch_dtype")

    @property
    def hf_class_name(self) -> str:
        suffix = "ForSequenceClassification" if self.score_head else "ForCausalLM"
        return _FAMILY_CLASS_PREFIX[self.family] + suffix

    def with_score_head(self, num_labels: int = 1) -> Architecture:
        """The same backbone with a score head, e.g. a critic initialised from an actor."""
        hf_config = copy.deepcopy(self.hf_config)
        hf_config["architectures"] = [_FAMILY_CLASS_PREFIX[self.family] + "ForSequenceClassification"]
        hf_config["num_labels"] = num_labels
        hf_config["tie_word_embeddings"] = False
        return dataclasses.replace(
            self, score_head=True, num_labels=num_labels, tie_word_embeddings=False, hf_config=hf_config
        )


def _require(cfg: dict[str, Any], key: str, source: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise UnsupportedModelError(f"{source}: required field '{key}' is missing")
    return cfg[key]


def _rope(cfg: dict[str, Any], source: str) -> tuple[float, Llama3RopeScaling | None]:
    params = cfg.get("rope_parameters") or {}
    legacy_scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = params if params.get("rope_type", "default") != "default" else legacy_scaling
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise UnsupportedModelError(f"{source}: rope type '{rope_type}' is not supported (supported: default, llama3)")
    return float(theta), Llama3RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def _family(cfg: dict[str, Any], source: str) -> tuple[str, bool]:
    """(family, has_score_head) from ``architectures`` (preferred) or ``model_type``."""
    model_type = cfg.get("model_type")
    classes = cfg.get("architectures") or []
    if classes:
        name = classes[0]
        for family, prefix in _FAMILY_CLASS_PREFIX.items():
            for suffix in _CLASS_SUFFIXES:
                if name == prefix + suffix:
                    return family, suffix == "ForSequenceClassification"
        supported = [p + s for p in _FAMILY_CLASS_PREFIX.values() for s in _CLASS_SUFFIXES]
        raise UnsupportedModelError(
            f"{source}: architectures[0]='{name}' is not supported; expected one of {supported}"
        )
    if model_type in FAMILIES:
        return model_type, False
    raise UnsupportedModelError(
        f"{source}: model_type='{model_type}' is not supported; expected one of {list(FAMILIES)}"
    )


def architecture_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> Architecture:
    """Parse an HF config dict; ``source`` names it in error messages."""
    family, score_head = _family(cfg, source)
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act='{cfg['hidden_act']}' is not supported (expected silu)")
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported")
    if family in ("llama", "qwen3") and cfg.get("attention_bias"):
        raise UnsupportedModelError(
            f"{source}: attention_bias=true (bias on the output projection) is not supported for {family}"
        )
    hidden = int(_require(cfg, "hidden_size", source))
    heads = int(_require(cfg, "num_attention_heads", source))
    groups = int(cfg.get("num_key_value_heads") or heads)
    if heads % groups:
        raise UnsupportedModelError(
            f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}"
        )
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    theta, scaling = _rope(cfg, source)
    sliding_window = cfg.get("sliding_window")
    if family == "qwen2" or family == "qwen3":
        sliding_window = sliding_window if cfg.get("use_sliding_window") else None
        if sliding_window is not None:
            raise UnsupportedModelError(f"{source}: use_sliding_window=true is not supported for {family}")
    return Architecture(
        family=family,
        vocab_size=int(_require(cfg, "vocab_size", source)),
        hidden_size=hidden,
        ffn_hidden_size=int(_require(cfg, "intermediate_size", source)),
        num_layers=int(_require(cfg, "num_hidden_layers", source)),
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) and not score_head,
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        sliding_window=int(sliding_window) if sliding_window else None,
        score_head=score_head,
        # As transformers reads it: without num_labels or id2label, a config has 2 labels.
        num_labels=int(cfg.get("num_labels", len(cfg.get("id2label") or {}) or 2)) if score_head else 1,
        hf_config=copy.deepcopy(cfg),
    )


def load_architecture(model_dir: str | Path) -> Architecture:
    """Read ``model_dir/config.json``; errors name the file."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        run = Path(model_dir)
        hint = (
            f"; {run} is a run's output_dir: its trained model is {run / 'hf'}, its checkpoints are under "
            f"{run / 'checkpoints'}"
            if (run / "hf" / "config.json").is_file() or (run / "checkpoints").is_dir()
            else ""
        )
        raise FileNotFoundError(f"{path}: no config.json here; expected an HF model directory{hint}")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UnsupportedModelError(f"{path}: not valid JSON ({err})") from err
    return architecture_from_hf_config(cfg, source=str(path))


VOCAB_PAD_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = VOCAB_PAD_MULTIPLE) -> int:
    """Round the vocabulary up so that every TP rank holds an equal, aligned slice.

    The padding rows are zero and are stripped on export; samplers and log-prob code mask them.
    """
    step = multiple * tp
    return -(-vocab_size // step) * step


def matching_vocab_pad_multiple(vocab_size: int, source_padded_vocab: int, tp: int) -> int:
    """The ``vocab_pad_multiple`` that gives a model at tensor-parallel size ``tp`` the source
    model's padded vocabulary.

    megatron's refit needs equal padded vocab sizes on both sides; with multiple = padded // tp the
    padding step is the source model's padded size itself, which rounds ``vocab_size`` up to it.
    """
    if not 0 < vocab_size <= source_padded_vocab:
        raise ValueError(
            f"the source model's padded vocabulary {source_padded_vocab} does not hold "
            f"the vocabulary of {vocab_size} tokens"
        )
    if source_padded_vocab % tp:
        raise ValueError(
            f"tp={tp} must divide the source model's padded vocabulary {source_padded_vocab} "
            f"(vocab {vocab_size}): megatron's weight copy needs the same padded vocabulary in both layouts"
        )
    multiple = source_padded_vocab // tp
    padded = padded_vocab_size(vocab_size, tp, multiple)
    if padded != source_padded_vocab:  # cannot happen for 0 < vocab_size <= source_padded_vocab
        raise ValueError(f"cannot pad vocab {vocab_size} at tp={tp} to {source_padded_vocab} (got {padded})")
    return multiple
