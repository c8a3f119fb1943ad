"""HF config.json -> Architecture, checked against configs built by transformers itself and
hand-written legacy (transformers 4.x layout) dicts."""

from __future__ import annotations

import dataclasses
import json

import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from megatron_rlhf.models.architecture import (
    Architecture,
    Llama3RopeScaling,
    UnsupportedModelError,
    architecture_from_hf_config,
    load_architecture,
)

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=56,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

CONFIG_CLASSES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}
PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}


def hf_dict(family: str, head: str = "ForCausalLM", **kwargs) -> dict:
    params = {**TINY, **kwargs}
    return CONFIG_CLASSES[family](architectures=[PREFIX[family] + head], **params).to_dict()


# ------------------------------------------------------------------ families


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_family_and_shape_fields(family):
    # Give every family an explicit head_dim of hidden/heads except qwen3 (checked separately).
    kwargs = {"head_dim": 8} if family != "qwen3" else {"head_dim": 16}
    arch = architecture_from_hf_config(hf_dict(family, **kwargs))
    assert arch.family == family
    assert arch.vocab_size == 96
    assert arch.hidden_size == 32
    assert arch.ffn_hidden_size == 56
    assert arch.num_layers == 3
    assert arch.num_attention_heads == 4
    assert arch.num_query_groups == 2
    assert arch.head_dim == kwargs["head_dim"]
    assert arch.rms_norm_eps == 1e-5
    assert arch.max_position_embeddings == 256
    assert arch.qkv_bias is (family == "qwen2")
    assert arch.qk_norm is (family == "qwen3")
    assert arch.score_head is False
    assert arch.num_labels == 1
    assert arch.tie_word_embeddings is False
    assert arch.hf_class_name == PREFIX[family] + "ForCausalLM"


def test_qwen3_default_head_dim_differs_from_hidden_over_heads():
    d = Qwen3Config(architectures=["Qwen3ForCausalLM"], **TINY).to_dict()
    assert d["head_dim"] == 128  # transformers' Qwen3 default, independent of hidden/heads = 8
    arch = architecture_from_hf_config(d)
    assert arch.head_dim == 128
    assert arch.hidden_size // arch.num_attention_heads == 8


def test_qwen2_head_dim_defaults_to_hidden_over_heads():
    d = hf_dict("qwen2")
    d.pop("head_dim", None)
    assert architecture_from_hf_config(d).head_dim == 32 // 4


def test_num_query_groups_defaults_to_heads_when_kv_heads_absent():
    d = hf_dict("llama")
    d.pop("num_key_value_heads")
    assert architecture_from_hf_config(d).num_query_groups == 4


def test_mha_and_mqa_groups():
    assert architecture_from_hf_config(hf_dict("llama", num_key_value_heads=4)).num_query_groups == 4
    assert architecture_from_hf_config(hf_dict("llama", num_key_value_heads=1)).num_query_groups == 1


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tie_word_embeddings(family):
    assert architecture_from_hf_config(hf_dict(family, tie_word_embeddings=True)).tie_word_embeddings is True
    assert architecture_from_hf_config(hf_dict(family, tie_word_embeddings=False)).tie_word_embeddings is False


def test_model_type_without_architectures():
    d = hf_dict("qwen2")
    d["architectures"] = None
    arch = architecture_from_hf_config(d)
    assert arch.family == "qwen2" and arch.score_head is False


def test_hf_config_kept_verbatim():
    d = hf_dict("llama")
    arch = architecture_from_hf_config(d)
    assert arch.hf_config == d
    d["vocab_size"] = 1  # a copy, not the caller's dict
    assert arch.hf_config["vocab_size"] == 96


# ---------------------------------------------------------------------- rope


def test_rope_theta_transformers5_layout():
    d = hf_dict("llama", rope_parameters={"rope_type": "default", "rope_theta": 123456.0})
    assert "rope_theta" not in d or d["rope_theta"] is None
    arch = architecture_from_hf_config(d)
    assert arch.rope_theta == 123456.0
    assert arch.rope_scaling is None


def test_rope_theta_legacy_layout():
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 56,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": None,
    }
    arch = architecture_from_hf_config(d)
    assert arch.rope_theta == 500000.0 and arch.rope_scaling is None


def test_rope_theta_absent_defaults_to_10000():
    d = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    assert architecture_from_hf_config(d).rope_theta == 10000.0


LLAMA31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LLAMA31_EXPECTED = Llama3RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def test_llama3_rope_scaling_transformers5_layout():
    d = hf_dict(
        "llama",
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA31},
    )
    arch = architecture_from_hf_config(d)
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling == LLAMA31_EXPECTED


@pytest.mark.parametrize("type_key", ["type", "rope_type"])
def test_llama3_rope_scaling_legacy_layout(type_key):
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 56,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            type_key: "llama3",
            "factor": 32.0,
            "low_freq_factor": 2.0,
            "high_freq_factor": 8.0,
            "original_max_position_embeddings": 4096,
        },
    }
    arch = architecture_from_hf_config(d)
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling == Llama3RopeScaling(
        factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_position_embeddings=4096
    )
    assert isinstance(arch.rope_scaling.original_max_position_embeddings, int)


def test_llama3_rope_scaling_legacy_via_transformers():
    # transformers 5 converts legacy kwargs (rope_theta + rope_scaling) into rope_parameters.
    d = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        **{**TINY, "max_position_embeddings": 131072},
        rope_theta=321.0,
        rope_scaling={"type": "llama3", **LLAMA31},
    ).to_dict()
    arch = architecture_from_hf_config(d)
    assert arch.rope_theta == 321.0
    assert arch.rope_scaling == LLAMA31_EXPECTED


def test_unsupported_rope_type_yarn():
    d = hf_dict(
        "llama",
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    with pytest.raises(UnsupportedModelError, match="yarn") as info:
        architecture_from_hf_config(d, source="my/config.json")
    assert "my/config.json" in str(info.value)
    assert "llama3" in str(info.value)


def test_unsupported_rope_type_legacy_linear():
    d = hf_dict("llama")
    d.pop("rope_parameters")
    d["rope_theta"] = 10000.0
    d["rope_scaling"] = {"type": "linear", "factor": 2.0}
    with pytest.raises(UnsupportedModelError, match="linear"):
        architecture_from_hf_config(d)


# --------------------------------------------------------- mistral sliding window


def test_mistral_sliding_window():
    assert architecture_from_hf_config(hf_dict("mistral", sliding_window=16)).sliding_window == 16
    assert architecture_from_hf_config(hf_dict("mistral", sliding_window=None)).sliding_window is None


def test_llama_has_no_sliding_window():
    assert architecture_from_hf_config(hf_dict("llama")).sliding_window is None


def test_qwen2_sliding_window_ignored_unless_enabled():
    assert (
        architecture_from_hf_config(hf_dict("qwen2", sliding_window=16, use_sliding_window=False)).sliding_window
        is None
    )


# ------------------------------------------------------------ score head


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_sequence_classification_score_head(family):
    d = hf_dict(family, head="ForSequenceClassification", num_labels=3, tie_word_embeddings=True)
    arch = architecture_from_hf_config(d)
    assert arch.family == family
    assert arch.score_head is True
    assert arch.num_labels == 3
    assert arch.tie_word_embeddings is False  # a score head is never tied to the embedding
    assert arch.hf_class_name == PREFIX[family] + "ForSequenceClassification"


def test_score_head_num_labels_one():
    d = hf_dict("llama", head="ForSequenceClassification", num_labels=1)
    assert architecture_from_hf_config(d).num_labels == 1


def test_score_head_explicit_num_labels_key():
    d = hf_dict("llama", head="ForSequenceClassification", num_labels=3)
    d["num_labels"] = 5
    assert architecture_from_hf_config(d).num_labels == 5


def test_with_score_head():
    arch = architecture_from_hf_config(hf_dict("qwen2", tie_word_embeddings=True))
    critic = arch.with_score_head()
    assert critic.score_head is True and critic.num_labels == 1
    assert critic.tie_word_embeddings is False
    assert critic.hf_class_name == "Qwen2ForSequenceClassification"
    assert critic.hf_config["architectures"] == ["Qwen2ForSequenceClassification"]
    assert critic.hf_config["num_labels"] == 1
    assert critic.hf_config["tie_word_embeddings"] is False
    # backbone unchanged
    for field in ("family", "vocab_size", "hidden_size", "num_layers", "num_query_groups", "head_dim", "qkv_bias"):
        assert getattr(critic, field) == getattr(arch, field)
    # the original is untouched
    assert arch.score_head is False and arch.hf_config["architectures"] == ["Qwen2ForCausalLM"]
    # round trip: parsing the rewritten hf_config gives the same architecture
    assert architecture_from_hf_config(critic.hf_config) == critic
    assert arch.with_score_head(4).num_labels == 4


# ----------------------------------------------------------------- errors


def test_unsupported_architecture_gpt2():
    d = hf_dict("llama")
    d["architectures"] = ["GPT2LMHeadModel"]
    with pytest.raises(UnsupportedModelError) as info:
        architecture_from_hf_config(d, source="x/config.json")
    msg = str(info.value)
    assert "architectures" in msg and "GPT2LMHeadModel" in msg and "x/config.json" in msg
    for supported in (
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "MistralForCausalLM",
        "LlamaForSequenceClassification",
    ):
        assert supported in msg


def test_unsupported_model_type_gemma():
    d = hf_dict("llama")
    d["architectures"] = None
    d["model_type"] = "gemma"
    with pytest.raises(UnsupportedModelError) as info:
        architecture_from_hf_config(d)
    msg = str(info.value)
    assert "model_type" in msg and "gemma" in msg
    for family in ("llama", "qwen2", "qwen3", "mistral"):
        assert family in msg


def test_unsupported_head_class():
    d = hf_dict("llama")
    d["architectures"] = ["LlamaForTokenClassification"]
    with pytest.raises(UnsupportedModelError, match="LlamaForTokenClassification"):
        architecture_from_hf_config(d)


@pytest.mark.parametrize(
    "field", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
)
def test_missing_required_field(field):
    d = hf_dict("llama")
    del d[field]
    with pytest.raises(UnsupportedModelError, match=f"'{field}'") as info:
        architecture_from_hf_config(d, source="cfg-src")
    assert "cfg-src" in str(info.value)


def test_required_field_none_is_missing():
    d = hf_dict("llama")
    d["vocab_size"] = None
    with pytest.raises(UnsupportedModelError, match="vocab_size"):
        architecture_from_hf_config(d)


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_non_silu_activation(act):
    d = hf_dict("llama", hidden_act=act)
    with pytest.raises(UnsupportedModelError, match="hidden_act") as info:
        architecture_from_hf_config(d)
    assert act in str(info.value)


def test_heads_not_multiple_of_kv_heads():
    d = hf_dict("llama")
    d["num_key_value_heads"] = 3
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads"):
        architecture_from_hf_config(d)


def test_mlp_bias_refused():
    with pytest.raises(UnsupportedModelError, match="mlp_bias"):
        architecture_from_hf_config(hf_dict("llama", mlp_bias=True))


def test_llama_attention_bias_refused():
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        architecture_from_hf_config(hf_dict("llama", attention_bias=True))


def test_qwen2_use_sliding_window_refused():
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        architecture_from_hf_config(hf_dict("qwen2", sliding_window=16, use_sliding_window=True))


# ------------------------------------------------------------- load_architecture


def test_load_architecture_reads_config_json(tmp_path):
    d = hf_dict("qwen3", head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(d))
    arch = load_architecture(tmp_path)
    assert isinstance(arch, Architecture)
    assert arch.family == "qwen3" and arch.head_dim == 16 and arch.qk_norm
    assert load_architecture(str(tmp_path)) == arch


def test_load_architecture_without_config_names_path(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load_architecture(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


def test_load_architecture_invalid_json_names_path(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError) as info:
        load_architecture(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


def test_load_architecture_errors_name_the_file(tmp_path):
    d = hf_dict("llama")
    d["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(UnsupportedModelError) as info:
        load_architecture(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


def test_architecture_is_frozen():
    arch = architecture_from_hf_config(hf_dict("llama"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        arch.hidden_size = 1  # type: ignore[misc]
