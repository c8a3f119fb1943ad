"""Build a megatron-core model for one role from an ``Architecture`` and a parallel layout.

The megatron model class and the layer spec are chosen here and nowhere else:
* ``GPTModel`` is deprecated in megatron-core 0.19.2 in favour of ``HybridModel``, whose shipped
  spec needs Transformer Engine; a move changes checkpoint key names, so it happens in this file.
* The layer spec is megatron's local (TE-free) spec with core attention swapped for
  ``SDPAttention``. A Transformer Engine spec (fused norm+QKV, different weight names in the HF
  map) belongs beside it, selected by the same function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rlhf.models import torch_fusions
from megatron_rlhf.models.architecture import VOCAB_PAD_MULTIPLE, Architecture, padded_vocab_size
from megatron_rlhf.models.attention import CachedSelfAttention, SDPAttention
from megatron_rlhf.models.value_head import ValueHead
from megatron_rlhf.parallel.layout import ParallelGroups

MODEL_CLASS = GPTModel


def layer_spec(arch: Architecture) -> ModuleSpec:
    spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    spec.submodules.self_attention.module = CachedSelfAttention
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def transformer_config(
    arch: Architecture, groups: ParallelGroups, dtype: torch.dtype, on_gpu: bool
) -> TransformerConfig:
    layout = groups.layout
    torch_fusions.install()
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        window_size=(arch.sliding_window - 1, 0) if arch.sliding_window else None,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Weights always come from a checkpoint: skip megatron's random init entirely.
        perform_initialization=False,
        use_cpu_initialization=not on_gpu,
        # SwiGLU, rotary and weight-gradient accumulation: apex/TE kernels where installed, ours
        # otherwise (torch_fusions; their torch formulas in CPU mode). The other fusions need apex/TE
        # kernels: torch paths instead.
        bias_activation_fusion=True,
        apply_rope_fusion=True,
        gradient_accumulation_fusion=True,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
    )


def build_model(
    arch: Architecture,
    groups: ParallelGroups,
    *,
    dtype: torch.dtype,
    device: torch.device,
    vocab_pad_multiple: int = VOCAB_PAD_MULTIPLE,
) -> GPTModel:
    """This rank's shard of the model (its TP slice of its PP stage), weights uninitialised."""
    on_gpu = device.type == "cuda"
    config = transformer_config(arch, groups, dtype, on_gpu)
    model = MODEL_CLASS(
        config=config,
        transformer_layer_spec=layer_spec(arch),
        vocab_size=padded_vocab_size(arch.vocab_size, groups.layout.tp, vocab_pad_multiple),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        pg_collection=groups.pg_collection,
        parallel_output=True,
    )
    if arch.rope_scaling is not None:
        # megatron hard-codes llama3.1's low/high factors and context length; apply the checkpoint's.
        rope = model.rotary_pos_emb
        scaling = arch.rope_scaling
        rope.inv_freq = rope._apply_scaling(
            rope.inv_freq,
            factor=scaling.factor,
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_position_embeddings,
        )
    if arch.score_head and groups.is_last_stage:
        model.output_layer = ValueHead(config, groups.pg_collection.tp, arch.num_labels)
    # torch's RMSNorm (the TE-free spec) creates float32 weights whatever params_dtype says; give
    # every parameter the model's dtype, as HF checkpoints and TE norms have (buffers such as the
    # rotary frequencies stay float32).
    for param in model.parameters():
        if param.dtype != dtype:
            param.data = param.data.to(dtype)
    if on_gpu:
        model.cuda(device)  # torch norms are built on the CPU even with GPU initialisation
    return model
