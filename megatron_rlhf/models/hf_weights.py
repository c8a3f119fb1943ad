"""The map between HF tensor names and megatron-core parameters, and how each is sharded.

One ``TensorMap`` per megatron parameter of this rank's pipeline stage. Its ``kind`` says how the
HF tensor(s) become the TP shard:

  replicated  same tensor on every TP rank (norms, the value head)
  row         split along dim 1 (input features)
  vocab       split along dim 0 after zero-padding the vocabulary (embedding, LM head)
  qkv         HF q/k/v merged into megatron's per-query-group layout [q_g..., k_g, v_g], split by groups
  gate_up     HF gate/up merged as [gate_shard; up_shard] on each TP rank (SwiGLU fc1)

``shard_from_hf`` builds one rank's shard reading only the rows it needs; ``hf_from_shards`` puts
the full HF tensors back together from all TP shards. They are exact inverses.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from megatron_rlhf.models.architecture import Architecture

KINDS = ("replicated", "row", "vocab", "qkv", "gate_up")

ALL = slice(None)
SCORE_HEAD_TENSOR = "score.weight"
LM_HEAD_TENSOR = "lm_head.weight"


class TensorSource(Protocol):
    """HF tensors by name, read piecewise (a safetensors checkpoint, or tensors in memory)."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, rows: slice = ALL, cols: slice = ALL) -> torch.Tensor:
        """``tensor[rows, cols]`` (``cols`` ignored for 1-D tensors) without loading the rest."""
        ...


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One megatron parameter, the HF tensor(s) it is made of, and their full HF shapes."""

    mcore: str
    hf: tuple[str, ...]
    kind: str
    hf_shapes: tuple[tuple[int, ...], ...]


def layers_of_stage(arch: Architecture, pp: int, pp_rank: int) -> range:
    """Global indices of the decoder layers held by pipeline stage ``pp_rank`` (uniform split)."""
    per_stage = arch.num_layers // pp
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def tensor_maps(arch: Architecture, pp: int, pp_rank: int) -> list[TensorMap]:
    """The maps of every parameter on pipeline stage ``pp_rank``, in a fixed order."""
    h, f, hn = arch.hidden_size, arch.ffn_hidden_size, arch.head_dim
    q_out, kv_out = arch.num_attention_heads * hn, arch.num_query_groups * hn
    first, last = pp_rank == 0, pp_rank == pp - 1
    maps: list[TensorMap] = []

    def add(mcore: str, hf: tuple[str, ...], kind: str, *shapes: tuple[int, ...]) -> None:
        maps.append(TensorMap(mcore, hf, kind, shapes))

    if first:
        add("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", (arch.vocab_size, h))
    for local, layer in enumerate(layers_of_stage(arch, pp, pp_rank)):
        hf, mc = f"model.layers.{layer}.", f"decoder.layers.{local}."
        qkv = tuple(f"{hf}self_attn.{p}_proj" for p in "qkv")
        add(mc + "input_layernorm.weight", (hf + "input_layernorm.weight",), "replicated", (h,))
        add(
            mc + "self_attention.linear_qkv.weight",
            tuple(n + ".weight" for n in qkv),
            "qkv",
            (q_out, h),
            (kv_out, h),
            (kv_out, h),
        )
        if arch.qkv_bias:
            add(
                mc + "self_attention.linear_qkv.bias",
                tuple(n + ".bias" for n in qkv),
                "qkv",
                (q_out,),
                (kv_out,),
                (kv_out,),
            )
        if arch.qk_norm:
            add(mc + "self_attention.q_layernorm.weight", (hf + "self_attn.q_norm.weight",), "replicated", (hn,))
            add(mc + "self_attention.k_layernorm.weight", (hf + "self_attn.k_norm.weight",), "replicated", (hn,))
        add(mc + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",), "row", (h, q_out))
        add(mc + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), "replicated", (h,))
        add(
            mc + "mlp.linear_fc1.weight",
            (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
            "gate_up",
            (f, h),
            (f, h),
        )
        add(mc + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "row", (h, f))
    if last:
        add("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated", (h,))
        if arch.score_head:
            add("output_layer.weight", (SCORE_HEAD_TENSOR,), "replicated", (arch.num_labels, h))
        elif not arch.tie_word_embeddings:
            add("output_layer.weight", (LM_HEAD_TENSOR,), "vocab", (arch.vocab_size, h))
        elif not first:
            # Tied embeddings across stages: the last stage keeps its own copy of the embedding.
            add("output_layer.weight", ("model.embed_tokens.weight",), "vocab", (arch.vocab_size, h))
    return maps


def hf_tensor_shapes(arch: Architecture) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint with its shape, as implied by the architecture."""
    return {
        name: shape for tmap in tensor_maps(arch, 1, 0) for name, shape in zip(tmap.hf, tmap.hf_shapes, strict=True)
    }


def exported_maps(arch: Architecture, pp: int, pp_rank: int) -> list[TensorMap]:
    """The maps whose HF tensors this stage writes on export (the tied copy is written once)."""
    maps = tensor_maps(arch, pp, pp_rank)
    if arch.tie_word_embeddings and pp_rank != 0:
        maps = [m for m in maps if m.hf != ("model.embed_tokens.weight",)]
    return maps


def _span(total: int, tp: int, tp_rank: int) -> tuple[int, int]:
    size = total // tp
    return tp_rank * size, (tp_rank + 1) * size


def shard_from_hf(
    tmap: TensorMap, source: TensorSource, arch: Architecture, tp: int, tp_rank: int, padded_vocab: int
) -> torch.Tensor:
    """This TP rank's shard of ``tmap``'s parameter, reading only the HF rows it needs."""
    kind = tmap.kind
    if kind == "replicated":
        return source.read(tmap.hf[0], ALL, ALL)
    if kind == "row":
        in_features = source.shape(tmap.hf[0])[1]
        return source.read(tmap.hf[0], ALL, slice(*_span(in_features, tp, tp_rank)))
    if kind == "vocab":
        start, stop = _span(padded_vocab, tp, tp_rank)
        real = source.read(tmap.hf[0], slice(min(start, arch.vocab_size), min(stop, arch.vocab_size)), ALL)
        pad = torch.zeros((stop - start - real.shape[0],) + tuple(real.shape[1:]), dtype=real.dtype)
        return torch.cat([real, pad])
    if kind == "qkv":
        groups = arch.num_query_groups // tp
        q_rows = arch.num_attention_heads // arch.num_query_groups * arch.head_dim
        g0, g1 = tp_rank * groups, (tp_rank + 1) * groups
        q = source.read(tmap.hf[0], slice(g0 * q_rows, g1 * q_rows), ALL)
        k = source.read(tmap.hf[1], slice(g0 * arch.head_dim, g1 * arch.head_dim), ALL)
        v = source.read(tmap.hf[2], slice(g0 * arch.head_dim, g1 * arch.head_dim), ALL)
        rest = tuple(q.shape[1:])
        merged = torch.cat(
            [
                q.reshape((groups, q_rows) + rest),
                k.reshape((groups, arch.head_dim) + rest),
                v.reshape((groups, arch.head_dim) + rest),
            ],
            dim=1,
        )
        return merged.reshape((-1,) + rest)
    if kind == "gate_up":
        rows = slice(*_span(arch.ffn_hidden_size, tp, tp_rank))
        return torch.cat([source.read(tmap.hf[0], rows, ALL), source.read(tmap.hf[1], rows, ALL)])
    raise ValueError(f"unknown tensor kind {kind!r}; expected one of {KINDS}")


def hf_from_shards(tmap: TensorMap, shards: list[torch.Tensor], arch: Architecture) -> dict[str, torch.Tensor]:
    """Full HF tensors from the TP shards of one parameter, in TP-rank order."""
    kind, tp = tmap.kind, len(shards)
    if kind == "replicated":
        return {tmap.hf[0]: shards[0]}
    if kind == "row":
        return {tmap.hf[0]: torch.cat(shards, dim=1)}
    if kind == "vocab":
        return {tmap.hf[0]: torch.cat(shards)[: arch.vocab_size]}
    if kind == "qkv":
        groups = arch.num_query_groups // tp
        q_rows = arch.num_attention_heads // arch.num_query_groups * arch.head_dim
        rest = tuple(shards[0].shape[1:])
        per_group = [s.reshape((groups, q_rows + 2 * arch.head_dim) + rest) for s in shards]
        merged = torch.cat(per_group)  # (num_query_groups, q_rows + 2 * head_dim, ...)
        q, k, v = merged.split([q_rows, arch.head_dim, arch.head_dim], dim=1)
        return {name: t.reshape((-1,) + rest) for name, t in zip(tmap.hf, (q, k, v), strict=True)}
    if kind == "gate_up":
        halves = [s.chunk(2) for s in shards]
        return {tmap.hf[0]: torch.cat([h[0] for h in halves]), tmap.hf[1]: torch.cat([h[1] for h in halves])}
    raise ValueError(f"unknown tensor kind {kind!r}; expected one of {KINDS}")
