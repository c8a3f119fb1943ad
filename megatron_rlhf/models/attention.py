"""Attention for the TE-free spec: SDPA core attention, and self-attention with a KV-cache path.

Core attention goes through ``torch.nn.functional.scaled_dot_product_attention``.

A drop-in for megatron's ``DotProductAttention`` (same constructor and forward signature) that
lets torch pick its fused kernels (flash / memory-efficient on GPU, math on CPU) and handles GQA
without materialising repeated K/V heads, except with an explicit mask on GPU (see ``forward``).

Packed rows (several sequences one after the other in a row, each attending only to itself) come
as megatron's ``PackedSeqParams`` in the ``sbhd`` layout: ``cu_seqlens_q`` marks where each
sequence starts in the micro-batch's tokens read row by row. On a GPU in half precision they go to
flash attention's variable-length kernel (``torch.nn.attention.varlen``), which computes each
sequence's own causal triangle only; elsewhere (CPU, float32) to the same SDPA call with the
block-diagonal mask they imply.

Shapes (megatron's convention): query (sq, b, np, hn); key/value (sk, b, ng, hn) with np a multiple
of ng (heads and query groups of this TP rank); output (sq, b, np * hn).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol, cast

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    from torch.nn.attention.varlen import varlen_attn

    HAS_VARLEN_ATTN = True
except ImportError:  # torch < 2.10 (e.g. an older NGC image): packed rows take the masked path
    HAS_VARLEN_ATTN = False

from megatron_rlhf.fusion import gpu_fused
from megatron_rlhf.models import decode_attention
from megatron_rlhf.models.swiglu import swiglu_reference


def _allowed_positions(sq: int, sk: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Bool (sq, sk), True where a query may attend: causal, aligned to the end of the keys
    (queries are the last ``sq`` positions, as with a KV cache), optionally a sliding window."""
    q_pos = torch.arange(sk - sq, sk, device=device)[:, None]
    k_pos = torch.arange(sk, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= q_pos - k_pos <= window
    return allowed


def packed_rows_mask(cu_seqlens: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """megatron's mask (True = masked out), (rows, 1, width, width), of packed rows whose sequences
    start at ``cu_seqlens`` (offsets into the rows' tokens read row by row, ending with
    ``rows * width``): a query attends the keys of its own sequence at or before it."""
    tokens = torch.arange(rows * width, device=cu_seqlens.device)
    sequence = torch.searchsorted(cu_seqlens, tokens, right=True).view(rows, width)
    causal = torch.ones(width, width, dtype=torch.bool, device=cu_seqlens.device).tril()
    return ~((sequence[:, :, None] == sequence[:, None, :]) & causal)[:, None]


class _AttentionPlans:
    """The SDPA calls (shapes, dtype, causal, GQA) that ran while the start-up warm-up planned them."""

    planning: ClassVar[bool] = False
    calls: ClassVar[set[tuple[object, ...]]] = set()


@contextlib.contextmanager
def planning_attention() -> Iterator[None]:
    """The start-up warm-up's scope: SDPA calls in it take torch's choice of kernel, and their shapes
    keep that kernel for the rest of the run; outside it, a shape it never ran takes flash attention.

    Why: torch's choice on Hopper is cuDNN, which builds a plan the first time it meets a shape, about
    300 ms on an H200 (133 ms when forced), where flash attention's first call costs 3 ms; once
    planned, cuDNN is faster (0.39 against 0.71 ms forward + backward at 43 x 384, docs/benchmarks.md,
    Kernels). The warm-up runs the shapes of a step of full-length responses, which recur at every
    such step; a run whose lengths vary meets new shapes at most steps, each of which would pay for
    a plan it may never use again. Until a warm-up has planned, every call takes torch's choice."""
    _AttentionPlans.planning = True
    try:
        yield
    finally:
        _AttentionPlans.planning = False


def _kernel_choice(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, dropout_p: float, is_causal: bool, gqa: bool
) -> contextlib.AbstractContextManager[object]:
    """Torch's choice of SDPA kernel for q, k (b, heads, s, hn) where the warm-up planned the call, where
    flash cannot take it, and in a process no warm-up planned in (``generate``, a run with
    warmup=never: every call as torch chooses); else torch's choice without cuDNN (flash first): see
    ``planning_attention``."""
    planned_any = _AttentionPlans.planning or _AttentionPlans.calls
    if not planned_any or mask is not None or not _flash_varlen_usable(q, dropout_p):
        return contextlib.nullcontext()
    call = (tuple(q.shape), tuple(k.shape), q.dtype, is_causal, gqa)
    if _AttentionPlans.planning:
        _AttentionPlans.calls.add(call)
        return contextlib.nullcontext()
    if call in _AttentionPlans.calls:
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _flash_varlen_usable(query: torch.Tensor, dropout_p: float) -> bool:
    """Whether flash attention's variable-length kernel runs these inputs (sq, b, np, hn)."""
    return (
        HAS_VARLEN_ATTN
        and query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and dropout_p == 0.0
        and query.shape[-1] % 8 == 0
        and query.shape[-1] <= 256
        and _flash_on(query.device)
    )


@functools.cache
def _flash_on(device: torch.device) -> bool:
    """Whether this build and ``device`` (a GPU) have flash attention: asked once per device, not
    at every layer's call."""
    return torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability(device) >= (8, 0)


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
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention does not support attention bias")
        sq, batch, num_heads, head_dim = query.shape
        sk = key.shape[0]
        dropout_p = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "sbhd" or attention_mask is not None or sq != sk:
                raise NotImplementedError("SDPAttention takes packed rows as 'sbhd' PackedSeqParams, without a mask")
            if _flash_varlen_usable(query, dropout_p):
                return self._packed_flash(query, key, value, packed_seq_params.cu_seqlens_q)
            attention_mask = packed_rows_mask(packed_seq_params.cu_seqlens_q, batch, sq)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, heads, s, hn)
        mask_type = attn_mask_type or self.attn_mask_type
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask  # megatron: True = masked out; SDPA: True = attend. (b or 1, 1, sq, sk)
            if self.window is not None:
                mask = mask & _allowed_positions(sq, sk, self.window, query.device)
        is_causal = mask is None and mask_type == AttnMaskType.causal
        if is_causal and (sq != sk or (self.window is not None and sk > self.window)):
            # SDPA's is_causal aligns queries to the start of the keys; build the mask ourselves.
            mask, is_causal = _allowed_positions(sq, sk, self.window, query.device), False
        gqa = num_heads != k.shape[1]
        if gqa and mask is not None and q.is_cuda:
            # CUDA's memory-efficient kernel takes a mask but not enable_gqa: with both, torch falls
            # back to the math kernel (the whole score matrix in memory). Repeat K/V heads instead.
            k, v = (t.repeat_interleave(num_heads // t.shape[1], dim=1) for t in (k, v))
            gqa = False
        with _kernel_choice(q, k, mask, dropout_p, is_causal, gqa):
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=self.softmax_scale,
                enable_gqa=gqa,
            )
        return out.permute(2, 0, 1, 3).reshape(sq, batch, num_heads * head_dim)

    def _packed_flash(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        """Packed rows through flash attention's variable-length kernel: the rows' tokens one after
        the other, each sequence causal within itself (and within the window). The row width bounds
        every sequence's length, which is all the kernel needs of ``max_q``/``max_k``."""
        width, batch, num_heads, head_dim = query.shape
        q, k, v = (t.transpose(0, 1).reshape(batch * width, t.shape[2], head_dim) for t in (query, key, value))
        window = (self.window if self.window is not None else -1, 0)
        # varlen_attn returns a tuple only when return_aux asks for more than the output
        out = cast(
            torch.Tensor,
            varlen_attn(q, k, v, cu_seqlens, cu_seqlens, width, width, scale=self.softmax_scale, window_size=window),
        )
        return out.view(batch, width, num_heads * head_dim).transpose(0, 1).contiguous()


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``t`` (..., hn) with precomputed ``cos``/``sin`` in t's dtype, broadcast
    against it: megatron's unfused non-interleaved formula and rounding (``_apply_rotary_pos_emb_bshd``),
    without recomputing the angles' cosines in every layer."""
    first, second = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((-second, first), dim=-1) * sin


def _rotate_into_cache(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated query, and the cache entry [rotated key | value] (last dim 2 * hn), also written
    into ``cache`` (slots, groups, max_len, 2 * hn) at each row's ``positions`` (b, sq) of its slot
    in ``slots`` (b,). On GPU it is compiled: the rotation in float32, rounded once, and the store
    in a few generated kernels (the query's rotation, the cache entry and the scatter into the
    cache) instead of eager indexing, copy and elementwise ones."""
    entry = torch.cat([rotate(key, cos, sin), value], dim=-1)
    cache[slots[:, None], :, positions] = entry.transpose(0, 1).to(cache.dtype)  # (b, sq, groups, 2hn)
    return rotate(query, cos, sin), entry


rotate_into_cache = gpu_fused(_rotate_into_cache)


@gpu_fused
def rotary_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (sq, b, 1, hn) in ``dtype`` of the rotary angles of ``positions`` (b, sq), shared by
    every layer of a forward: megatron's table (angles in float32, both halves alike). One kernel on GPU."""
    angles = positions.t().float()[..., None] * inv_freq.float()  # (sq, b, hn / 2)
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def split_qkv(
    mixed: torch.Tensor, groups: int, heads_per_group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query (sq, b, groups * heads_per_group, hn), key and value (sq, b, groups, hn) of megatron's
    fused QKV projection output (sq, b, groups * (heads_per_group + 2) * hn): per KV group, its
    query heads, then its key, then its value (``SelfAttention.get_query_key_value_tensors``)."""
    sq, batch, _ = mixed.shape
    grouped = mixed.view(sq, batch, groups, -1)
    head_dim = grouped.shape[-1] // (heads_per_group + 2)
    query, key, value = torch.split(grouped, [heads_per_group * head_dim, head_dim, head_dim], dim=3)
    return query.reshape(sq, batch, groups * heads_per_group, head_dim), key, value


@gpu_fused
def split_rotate_into_cache(
    mixed: torch.Tensor,
    heads_per_group: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotate_into_cache`` of the fused QKV projection's output, split (``split_qkv``) inside the
    same compiled function: megatron's split makes the query contiguous with a copy kernel of its
    own."""
    query, key, value = split_qkv(mixed, cache.shape[1], heads_per_group)
    return _rotate_into_cache(query, key, value, cos, sin, cache, slots, positions)


swiglu = gpu_fused(swiglu_reference)
"""The decode step's SwiGLU of the gated MLP's fc1 output: megatron's ``glu`` eagerly, compiled (one
kernel, rounded once, as megatron's ``swiglu``) on GPU, where it runs inside the decode graphs."""


@gpu_fused
def add_rms_norm(
    hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden + delta, RMSNorm of that sum): a residual add and the norm after it in one kernel on
    GPU. The norm is torch's ``rms_norm``'s arithmetic (statistics in at least float32, the weight
    applied before the single rounding), as the training forward computes it."""
    hidden = hidden + delta
    wide = torch.promote_types(hidden.dtype, torch.float32)
    x = hidden.to(wide)
    return hidden, (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(wide)).to(hidden.dtype)


def decode_score_bias(positions: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
    """Additive attention bias of a decode step over the cache slice [0, kv_len): (slots, kv_len)
    float32, 0 where slot i's query (at ``positions[i, 0]``) may attend the cached key (causal, and
    within the sliding ``window`` if any), -inf elsewhere."""
    key_pos = torch.arange(kv_len, device=positions.device)
    masked = key_pos[None, :] > positions  # (slots, kv_len)
    if window is not None:
        masked |= positions - key_pos[None, :] > window
    return torch.zeros(masked.shape, dtype=torch.float32, device=positions.device).masked_fill_(masked, float("-inf"))


def cached_decode_attention(
    query: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor, kv_len: int, window: int | None, scale: float
) -> torch.Tensor:
    """Attention of one query per cache slot over that slot's cached keys, read in place.

    query (1, slots, heads, hn): row i is slot i's newest token, at ``positions[i, 0]``; cache
    (slots, groups, max_len, 2 * hn), keys then values in the last dim, already holding this step's
    entries. Slot i attends its keys at positions <= its own (within the sliding ``window`` if
    any), below ``kv_len``. Returns (1, slots, heads * hn).

    The query heads of a KV group are the query rows of one attention over that group's keys, so
    the cache is read once per group, in place. On a GPU: one Triton kernel, one pass over each
    slot's own prefix with the softmax inside (``decode_attention.py``); elsewhere two batched
    matmuls around a softmax over the slice [0, kv_len) of every slot (``matmul_decode_attention``).
    Why not SDPA: with GQA and a per-row mask torch falls back to kernels that repeat each KV head
    per query head, or it needs the rows' prefixes gathered into a fresh tensor.
    """
    _, slots, heads, head_dim = query.shape
    groups = cache.shape[1]
    q = query[0].reshape(slots, groups, heads // groups, head_dim)
    if decode_attention.available(q):
        out = decode_attention.decode_attention(q, cache, positions, kv_len, window, scale)
    else:
        cached = cache[:, :, :kv_len]  # (slots, groups, kv_len, 2 * hn): a view
        bias = decode_score_bias(positions, kv_len, window)
        out = matmul_decode_attention(q, cached[..., :head_dim], cached[..., head_dim:], bias, scale)
    return out.reshape(1, slots, heads * head_dim)


def continued_prefill_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Attention of a prefill whose rows continue what their cache slots hold: row i's queries
    (sq, b, heads, hn), at ``positions[i]`` (b, sq), attend the keys of slot ``slots[i]`` at or
    before their own position (this prefill's keys already stored), within the sliding ``window``
    if any. Returns (sq, b, heads * hn).

    The rows' cached prefixes are gathered into one (b, groups, kv_len, 2 * hn) copy: a later turn's
    prefill is a tool result of tens of tokens after a prefix of hundreds, a small fraction of the
    work of recomputing the prefix (which is what it saves)."""
    sq, rows, heads, head_dim = query.shape
    kv_len = int(positions.max()) + 1
    cached = cache[slots, :, :kv_len]
    keys, values = cached[..., :head_dim], cached[..., head_dim:]
    key_positions = torch.arange(kv_len, device=query.device)
    allowed = key_positions[None, None, :] <= positions[:, :, None]  # (b, sq, kv_len)
    if window is not None:
        allowed &= positions[:, :, None] - key_positions[None, None, :] <= window
    q = query.permute(1, 2, 0, 3)  # (b, heads, sq, hn)
    groups = keys.shape[1]
    if heads != groups:  # the mask rules out SDPA's GQA path on CUDA (see SDPAttention.forward)
        keys, values = (t.repeat_interleave(heads // groups, dim=1) for t in (keys, values))
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None], scale=scale)
    return out.permute(2, 0, 1, 3).reshape(sq, rows, heads * head_dim)


def rotate_store_attend(
    mixed: torch.Tensor,
    heads_per_group: int,
    step_cos: torch.Tensor,
    step_sin: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    kv_len: int,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """A decode step's attention from the fused QKV projection's output (1, slots, width), row i
    being cache slot i (``slots`` is arange): ``split_rotate_into_cache`` then
    ``cached_decode_attention``; on a GPU one Triton kernel does both
    (``decode_attention.rotate_store_attend``). Returns (1, slots, heads * hn)."""
    if decode_attention.available(mixed):
        return decode_attention.rotate_store_attend(
            mixed, heads_per_group, step_cos, step_sin, cache, positions, kv_len, window, scale
        )
    query, _ = split_rotate_into_cache(mixed, heads_per_group, step_cos, step_sin, cache, slots, positions)
    return cached_decode_attention(query, cache, positions, kv_len, window, scale)


def matmul_decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, score_bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """query (slots, groups, rows, hn) over keys/values (slots, groups, kv_len, hn) with the
    (slots, kv_len) additive ``score_bias``: scores and softmax in float32 (or the inputs' wider
    dtype); (slots, groups, rows, hn). The slot and group dims fold into one batch stride."""
    slots, groups, rows, _ = query.shape
    scores = _bmm_float32(query.flatten(0, 1), keys.flatten(0, 1).transpose(1, 2)).view(slots, groups, rows, -1)
    probs = _masked_softmax(scores, score_bias[:, None, None, :], scale, values.dtype)
    return torch.bmm(probs.flatten(0, 1), values.flatten(0, 1)).view(query.shape)


def _bmm_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in at least float32; half-precision inputs on GPU accumulate and write float32 directly."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a, b).to(torch.promote_types(a.dtype, torch.float32))


@gpu_fused
def _masked_softmax(scores: torch.Tensor, bias: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.softmax(scores * scale + bias, dim=-1).to(dtype)


class LayerCaches(Protocol):
    def layer(self, layer_number: int) -> torch.Tensor:
        """(slots, groups, max_len, 2 * hn): the cache of layer ``layer_number`` (from 1)."""
        ...


class KVStep(Protocol):
    """What the cached attention reads of one generation forward: the engine's ``DecodeStep``
    (``rollout/kv_cache.py``, which documents the fields), seen from this lower layer."""

    @property
    def cache(self) -> LayerCaches: ...

    @property
    def slots(self) -> torch.Tensor: ...

    @property
    def positions(self) -> torch.Tensor: ...

    @property
    def cos(self) -> torch.Tensor: ...

    @property
    def sin(self) -> torch.Tensor: ...

    @property
    def prefill(self) -> bool: ...

    @property
    def kv_len(self) -> int | None: ...

    @property
    def window(self) -> int | None: ...

    @property
    def continued(self) -> bool: ...


class CachedSelfAttention(SelfAttention):
    """megatron's SelfAttention, plus a KV-cache path used by the generation engine.

    Parameters and checkpoint names are those of ``SelfAttention``: training and generation share
    one module (no weight copy when their layouts match). When the engine attaches a ``DecodeStep``
    (``kv_step``), the forward writes this step's keys/values into the engine's cache at each row's
    own positions, then attends: a prefill (prompts from position 0) over its own keys with causal
    core attention; a decode step (one token per cache slot) over the cache in place. Otherwise it
    is megatron's forward unchanged. A continued prefill (a later turn's new tokens) attends over
    its slot's cache (``continued_prefill_attention``).
    """

    kv_step: KVStep | None = None

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        step = self.kv_step
        if step is None:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        query, key, value = self.get_query_key_value_tensors(hidden_states, None)  # (sq, b, heads, hn)
        cache = step.cache.layer(self.layer_number)  # (slots, groups, max_len, 2 * hn)
        query, entry = rotate_into_cache(query, key, value, step.cos, step.sin, cache, step.slots, step.positions)
        if step.prefill and step.continued:
            out = continued_prefill_attention(
                query, cache, step.slots, step.positions, step.window, self.core_attention.softmax_scale
            )
        elif step.prefill:
            head_dim = query.shape[-1]
            key, value = entry[..., :head_dim], entry[..., head_dim:]  # views: rotated key, value
            out = self.core_attention(query, key, value, None, attn_mask_type=AttnMaskType.causal)
        else:
            assert step.kv_len is not None, "a decode step attends over cache positions [0, kv_len)"
            out = cached_decode_attention(
                query, cache, step.positions, step.kv_len, step.window, self.core_attention.softmax_scale
            )
        return self.linear_proj(out)
