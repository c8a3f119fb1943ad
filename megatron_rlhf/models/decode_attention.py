"""Decode attention over the generation engine's KV cache in one pass: a Triton kernel.

A decode step attends one query per cache slot over that slot's cached keys. Each KV group's query
heads are the rows of one small query matrix, so a slot's keys and values are read once per group.
One program per (slot, group) streams the cache rows that slot attends, as contiguous blocks (the
cache keeps a position's key and value side by side, ``rollout/kv_cache.py``), and keeps an online
softmax (flash attention's running maximum and sum) in float32. So: one kernel per layer, no score
tensor in memory, and each slot reads its own prefix only, where two batched matmuls around a
softmax read every slot's cache up to the longest one's and write and read the scores. The engine's
own decode layer (``rotate_store_attend``) also hands the kernel the QKV projection's output: the
same program splits it, rotates the query and key, stores the new key and value, and attends this
step's key from registers, in place of three compiled kernels before the attention.

Why our own kernel: FlexAttention's decoding kernel needs a power-of-two number of query heads per
KV group (Qwen2.5-1.5B has 6), and with the heads as query rows it and SDPA's kernels were slower
than the two matmuls (``scripts/bench/decode_kernels.py``; docs/benchmarks.md, "Kernels").
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch without its Triton (e.g. CPU wheels of some platforms): the matmul path
    triton = None

BLOCK_POSITIONS = 64
"""Cache positions per loop iteration of a program (tuned with ``scripts/bench/decode_kernels.py``)."""
NUM_WARPS = 4


def available(query: torch.Tensor) -> bool:
    """Whether the kernels run for this query: on a GPU, in a dtype Triton's dot takes."""
    return triton is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16, torch.float32)


def _grid_arguments(rows: int, head_dim: int, dtype: torch.dtype, block_positions: int) -> dict:
    return dict(
        ROWS=rows,
        ROWS_PADDED=max(16, triton.next_power_of_2(rows)),
        HEAD_DIM=head_dim,
        DIMS_PADDED=max(16, triton.next_power_of_2(head_dim)),
        BLOCK=block_positions,
        EXACT=dtype == torch.float32,
    )


def decode_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    positions: torch.Tensor,
    kv_len: int,
    window: int | None,
    scale: float,
    *,
    block_positions: int = BLOCK_POSITIONS,
    num_warps: int = NUM_WARPS,
    num_stages: int = 2,
) -> torch.Tensor:
    """query (slots, groups, rows, hn): each slot's newest query heads, grouped by KV group; cache
    (slots, groups, max_len, 2 * hn) with keys then values in the last dim, holding this step's
    entries; ``positions`` (slots, 1): each query's position. Slot i attends its cached keys at
    positions [0, positions[i]] (from ``positions[i] - window`` with a sliding window) below
    ``kv_len``, and its program reads only those. Returns (slots, groups, rows, hn) in the query's
    dtype."""
    slots, groups, rows, head_dim = query.shape
    if cache.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("decode_attention needs the last dim of the query and the cache contiguous")
    out = torch.empty_like(query)
    _decode_attention_kernel[(slots, groups)](
        query,
        query,
        query,
        cache,
        positions,
        out,
        scale,
        kv_len,
        -1 if window is None else window,
        *query.stride()[:3],
        0,
        *cache.stride()[:3],
        positions.stride(0),
        *out.stride()[:3],
        NEW_ENTRY=False,
        num_warps=num_warps,
        num_stages=num_stages,
        **_grid_arguments(rows, head_dim, query.dtype, block_positions),
    )
    return out


def rotate_store_attend(
    mixed: torch.Tensor,
    heads_per_group: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    positions: torch.Tensor,
    kv_len: int,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """A decode step's attention from the fused QKV projection's output in one kernel: per KV
    group, the rotary embedding of its query heads and key (megatron's non-interleaved formula in
    float32, rounded once), the key and value stored into the cache at the slot's position, and
    ``decode_attention`` over the cached keys before it plus this step's key. Row i is cache slot
    i (a decode step's rows). mixed (1, slots, groups * (heads_per_group + 2) * hn) in megatron's
    layout (``split_qkv``); cos/sin (1, slots, 1, hn). Returns (1, slots, heads * hn)."""
    _, slots, width = mixed.shape
    groups, head_dim = cache.shape[1], cache.shape[-1] // 2
    if width != groups * (heads_per_group + 2) * head_dim or mixed.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError(
            f"rotate_store_attend: QKV output of width {width} does not match {groups} groups of "
            f"{heads_per_group} query heads of {head_dim} dims, or a last dim is not contiguous"
        )
    out = torch.empty(slots, groups, heads_per_group, head_dim, dtype=mixed.dtype, device=mixed.device)
    _decode_attention_kernel[(slots, groups)](
        mixed,
        cos,
        sin,
        cache,
        positions,
        out,
        scale,
        kv_len,
        -1 if window is None else window,
        mixed.stride(1),
        (heads_per_group + 2) * head_dim,
        head_dim,
        cos.stride(1),
        *cache.stride()[:3],
        positions.stride(0),
        *out.stride()[:3],
        NEW_ENTRY=True,
        num_warps=NUM_WARPS,
        num_stages=2,
        **_grid_arguments(heads_per_group, head_dim, mixed.dtype, BLOCK_POSITIONS),
    )
    return out.view(1, slots, groups * heads_per_group * head_dim)


if triton is not None:

    @triton.jit
    def _rotated(
        at: tl.tensor, partner_at: tl.tensor, mask: tl.tensor, cos: tl.tensor, sin: tl.tensor, sign: tl.tensor
    ) -> tl.tensor:
        """megatron's rotary t * cos + rotate_half(t) * sin in float32 (rotate_half: (-second, first))."""
        t = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        partner = tl.load(partner_at, mask=mask, other=0.0).to(tl.float32)
        return t * cos + sign * partner * sin

    @triton.jit
    def _decode_attention_kernel(
        query: tl.tensor,
        cos: tl.tensor,
        sin: tl.tensor,
        cache: tl.tensor,
        positions: tl.tensor,
        out: tl.tensor,
        scale: tl.tensor,
        kv_len: tl.tensor,
        window: tl.tensor,
        q_slot: tl.tensor,
        q_group: tl.tensor,
        q_row: tl.tensor,
        r_slot: tl.tensor,
        c_slot: tl.tensor,
        c_group: tl.tensor,
        c_pos: tl.tensor,
        p_slot: tl.tensor,
        o_slot: tl.tensor,
        o_group: tl.tensor,
        o_row: tl.tensor,
        ROWS: tl.constexpr,
        ROWS_PADDED: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DIMS_PADDED: tl.constexpr,
        BLOCK: tl.constexpr,
        EXACT: tl.constexpr,
        NEW_ENTRY: tl.constexpr,
    ) -> None:
        """One program per (slot, group). NEW_ENTRY: ``query`` is the QKV output (rows, then the
        key and the value, ``q_row`` apart), rotated with ``cos``/``sin`` (``r_slot`` per slot),
        and the new key and value go to the cache; else ``query`` holds rotated queries and the
        cache this step's entry already (cos and sin unused)."""
        slot, group = tl.program_id(0), tl.program_id(1)
        rows = tl.arange(0, ROWS_PADDED)
        dims = tl.arange(0, DIMS_PADDED)  # tl.arange and tl.dot want powers of two, at least 16
        real_dims = dims < HEAD_DIM
        real = (rows[:, None] < ROWS) & real_dims[None, :]
        precision: tl.constexpr = "ieee" if EXACT else "tf32"  # "tf32" is ignored for half inputs
        dtype = out.dtype.element_ty
        position = tl.load(positions + slot * p_slot)
        slot_cache = cache + slot * c_slot + group * c_group
        group_at = query + slot * q_slot + group * q_group
        if NEW_ENTRY:
            half: tl.constexpr = HEAD_DIM // 2
            partner = tl.where(dims < half, dims + half, dims - half)
            sign = tl.where(dims < half, -1.0, 1.0)
            angle_cos = tl.load(cos + slot * r_slot + dims, mask=real_dims, other=0.0).to(tl.float32)
            angle_sin = tl.load(sin + slot * r_slot + dims, mask=real_dims, other=0.0).to(tl.float32)
            row_at = group_at + rows[:, None] * q_row
            q = _rotated(
                row_at + dims[None, :],
                row_at + partner[None, :],
                real,
                angle_cos[None, :],
                angle_sin[None, :],
                sign[None, :],
            ).to(dtype)
            key_at = group_at + ROWS * q_row
            new_key = _rotated(key_at + dims, key_at + partner, real_dims, angle_cos, angle_sin, sign).to(dtype)
            new_value = tl.load(key_at + q_row + dims, mask=real_dims, other=0.0)
            end = tl.minimum(position, kv_len)  # the cached keys before this step's (stored after the loop)
        else:
            q = tl.load(group_at + rows[:, None] * q_row + dims[None, :], mask=real, other=0.0)
            end = tl.minimum(position + 1, kv_len)
        first = tl.where(window >= 0, tl.maximum(position - window, 0), 0)  # keys [first, end) are attended
        running_max = tl.full((ROWS_PADDED,), float("-inf"), tl.float32)
        running_sum = tl.zeros((ROWS_PADDED,), tl.float32)
        acc = tl.zeros((ROWS_PADDED, DIMS_PADDED), tl.float32)
        for block in range(first // BLOCK, tl.cdiv(end, BLOCK)):
            keys_at = block * BLOCK + tl.arange(0, BLOCK)
            attended = (keys_at >= first) & (keys_at < end)
            rows_at = slot_cache + keys_at[:, None] * c_pos + dims[None, :]
            keys = tl.load(rows_at, mask=attended[:, None] & real_dims[None, :], other=0.0)
            values = tl.load(rows_at + HEAD_DIM, mask=attended[:, None] & real_dims[None, :], other=0.0)
            scores = tl.dot(q, tl.trans(keys), input_precision=precision) * scale
            scores = tl.where(attended[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            # No attended key yet (only an idle slot whose stale position lies beyond kv_len + window):
            # shift by 0 there, so that exp gives 0 rather than exp(-inf + inf) = NaN.
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            weights = tl.exp(scores - shift[:, None])
            rescale = tl.exp(running_max - shift)
            running_sum = running_sum * rescale + tl.sum(weights, axis=1)
            acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype), values, input_precision=precision)
            running_max = new_max
        if NEW_ENTRY:  # this step's key and value, from registers: one more column of the softmax
            # Stored only now: a store before the loop would hold back the loop's loads from the
            # same cache, which the compiler must assume it may overwrite.
            tl.store(slot_cache + position * c_pos + dims, new_key, mask=real_dims)
            tl.store(slot_cache + position * c_pos + HEAD_DIM + dims, new_value, mask=real_dims)
            score = tl.sum(q.to(tl.float32) * new_key.to(tl.float32)[None, :], axis=1) * scale
            new_max = tl.maximum(running_max, score)
            weight = tl.exp(score - new_max)
            rescale = tl.exp(running_max - new_max)
            running_sum = running_sum * rescale + weight
            acc = acc * rescale[:, None] + weight.to(dtype).to(tl.float32)[:, None] * new_value.to(tl.float32)[None, :]
        result = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        tl.store(
            out + slot * o_slot + group * o_group + rows[:, None] * o_row + dims[None, :], result.to(dtype), mask=real
        )
