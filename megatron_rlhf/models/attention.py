"""Attention for the TE-free spec: SDPA core attention, and self-attention with a KV-cache path.

Core attention goes through ``torch.nn.functional.scaled_dot_product_attention``.

A drop-in for megatron's ``DotProductAttention`` (same constructor and forward signature) that
lets torch pick its fused kernels (flash / memory-efficient on GPU, math on CPU) and handles GQA
without materialising repeated K/V heads.

Shapes (megatron's convention): query (sq, b, np, hn); key/value (sk, b, ng, hn) with np a multiple
of ng (heads and query groups of this TP rank); output (sq, b, np * hn).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


def _allowed_positions(sq: int, sk: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Bool (sq, sk), True where a query may attend: causal, aligned to the end of the keys
    (queries are the last ``sq`` positions, as with a KV cache), optionally a sliding window."""
    q_pos = torch.arange(sk - sq, sk, device=device)[:, None]
    k_pos = torch.arange(sk, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= q_pos - k_pos <= window
    return allowed


class SDPAttention(MegatronModule):
    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism")
        self.tp_group = pg_collection.tp if pg_collection is not None else None  # read by checkpointing
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        # megatron's window_size is (left, right); only a left (causal) window is meaningful here.
        self.window = config.window_size[0] if config.window_size is not None else None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: object | None = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention supports neither packed sequences nor attention bias")
        sq, batch, num_heads, head_dim = query.shape
        sk = key.shape[0]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, heads, s, hn)
        mask_type = attn_mask_type or self.attn_mask_type
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask  # megatron: True = masked out; SDPA: True = attend
        is_causal = mask is None and mask_type == AttnMaskType.causal
        if is_causal and (sq != sk or (self.window is not None and sk > self.window)):
            # SDPA's is_causal aligns queries to the start of the keys; build the mask ourselves.
            mask, is_causal = _allowed_positions(sq, sk, self.window, query.device), False
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=is_causal,
            scale=self.softmax_scale,
            enable_gqa=num_heads != k.shape[1],
        )
        return out.permute(2, 0, 1, 3).reshape(sq, batch, num_heads * head_dim)


class CachedSelfAttention(SelfAttention):
    """megatron's SelfAttention, plus a KV-cache path used by the generation engine.

    Parameters and checkpoint names are those of ``SelfAttention``: training and generation share
    one module (no weight copy when their layouts match). When the engine attaches a ``DecodeStep``
    (``kv_step``), the forward writes this step's keys/values into the engine's cache at each row's
    own positions (slots of a continuous batch are at different lengths) and attends over the
    cached prefix; otherwise it is megatron's forward unchanged.
    """

    kv_step: object | None = None

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, *args, **kwargs):
        step = self.kv_step
        if step is None:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        query, key, value = self.get_query_key_value_tensors(hidden_states, None)  # (sq, b, heads, hn)
        query = apply_rotary_pos_emb(query, step.rotary_freqs, config=self.config, cp_group=self.pg_collection.cp)
        key = apply_rotary_pos_emb(key, step.rotary_freqs, config=self.config, cp_group=self.pg_collection.cp)
        cache_k, cache_v = step.cache.layer(self.layer_number)  # (slots, max_len, groups, hn)
        rows, cols = step.slots[:, None], step.positions  # (b, 1), (b, sq)
        cache_k[rows, cols] = key.transpose(0, 1).to(cache_k.dtype)
        cache_v[rows, cols] = value.transpose(0, 1).to(cache_v.dtype)
        keys = cache_k[step.slots, : step.kv_len].transpose(1, 2)  # (b, groups, kv_len, hn)
        values = cache_v[step.slots, : step.kv_len].transpose(1, 2)
        key_pos = torch.arange(step.kv_len, device=query.device)
        allowed = key_pos[None, None, :] <= step.positions[:, :, None]  # (b, sq, kv_len): causal per row
        if self.core_attention.window is not None:
            allowed &= step.positions[:, :, None] - key_pos[None, None, :] <= self.core_attention.window
        q = query.permute(1, 2, 0, 3)  # (b, heads, sq, hn)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=allowed[:, None], scale=self.core_attention.softmax_scale,
            enable_gqa=q.shape[1] != keys.shape[1],
        )  # fmt: skip
        sq, batch = hidden_states.shape[0], hidden_states.shape[1]
        out = out.permute(2, 0, 1, 3).reshape(sq, batch, -1)
        return self.linear_proj(out)
