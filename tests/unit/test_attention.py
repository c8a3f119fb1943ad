"""SDPAttention vs a naive float64 attention written here (explicit GQA head repeat, explicit
end-aligned causal / sliding-window masks built with Python loops)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rlhf.models.attention import (
    SDPAttention,
    _allowed_positions,
    cached_decode_attention,
    decode_score_bias,
    packed_rows_mask,
    rotate,
)

HEADS, GROUPS, HN = 4, 2, 16


def make_config(window_size=None, attention_dropout=0.0) -> TransformerConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(
            num_layers=1,
            hidden_size=64,
            num_attention_heads=HEADS,
            num_query_groups=GROUPS,
            kv_channels=HN,
            window_size=window_size,
            attention_dropout=attention_dropout,
        )


def make_attention(window_size=None, mask_type=AttnMaskType.causal, **kwargs) -> SDPAttention:
    module = SDPAttention(make_config(window_size), 1, mask_type, "self", pg_collection=None, **kwargs)
    return module.eval()


def inputs(sq, sk, batch=2, heads=HEADS, groups=GROUPS, hn=HN, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, batch, heads, hn, generator=g, dtype=torch.float64)
    k = torch.randn(sk, batch, groups, hn, generator=g, dtype=torch.float64)
    v = torch.randn(sk, batch, groups, hn, generator=g, dtype=torch.float64)
    return q, k, v


def allowed_by_hand(sq, sk, causal=True, window=None):
    """allowed[i][j]: query i (absolute position sk - sq + i) may attend key j.
    ``window`` = w keys: j in (pos - w, pos]."""
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    for i in range(sq):
        pos = sk - sq + i
        for j in range(sk):
            ok = True
            if causal and j > pos:
                ok = False
            if window is not None and j <= pos - window:
                ok = False
            allowed[i, j] = ok
    return allowed


def naive_attention(q, k, v, allowed, scale=None):
    """q (sq, b, np, hn), k/v (sk, b, ng, hn), allowed (b or 1, sq, sk) bool -> (sq, b, np*hn)."""
    sq, b, np_, hn = q.shape
    ng = k.shape[2]
    scale = 1.0 / math.sqrt(hn) if scale is None else scale
    rep = np_ // ng
    k_full = k.repeat_interleave(rep, dim=2)  # head h uses group h // rep
    v_full = v.repeat_interleave(rep, dim=2)
    out = torch.empty(sq, b, np_, hn, dtype=torch.float64)
    for bi in range(b):
        for h in range(np_):
            assert torch.equal(k_full[:, bi, h], k[:, bi, h // rep])
            scores = q[:, bi, h] @ k_full[:, bi, h].T * scale  # (sq, sk)
            a = allowed[bi if allowed.shape[0] > 1 else 0]
            scores = scores.masked_fill(~a, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[:, bi, h] = probs @ v_full[:, bi, h]
    return out.reshape(sq, b, np_ * hn)


def run(module, q, k, v, mask=None, **kwargs):
    with torch.no_grad():
        return module(q, k, v, mask, **kwargs)


def test_allowed_by_hand_sanity():
    # decode step with a 3-key window over 7 keys: keys 4, 5, 6
    assert allowed_by_hand(1, 7, window=3).tolist() == [[False] * 4 + [True] * 3]
    assert allowed_by_hand(2, 2).tolist() == [[True, False], [True, True]]


# ------------------------------------------------------------------ causal


@pytest.mark.parametrize("s", [1, 5, 8])
def test_causal_sq_equals_sk(s):
    q, k, v = inputs(s, s)
    out = run(make_attention(), q, k, v)
    assert out.shape == (s, 2, HEADS * HN) and out.dtype == torch.float64
    ref = naive_attention(q, k, v, allowed_by_hand(s, s)[None])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("sq", [1, 3, 6])
def test_causal_kv_cache_decode(sq):
    sk = 7
    q, k, v = inputs(sq, sk, seed=sq)
    out = run(make_attention(), q, k, v)
    assert out.shape == (sq, 2, HEADS * HN)
    ref = naive_attention(q, k, v, allowed_by_hand(sq, sk)[None])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_decode_matches_full_prefill_rows():
    # Decoding the last 3 positions with a KV cache equals the last 3 rows of the full pass.
    q, k, v = inputs(7, 7, seed=3)
    module = make_attention()
    full = run(module, q, k, v)
    tail = run(module, q[-3:], k, v)
    torch.testing.assert_close(tail, full[-3:], rtol=1e-10, atol=1e-10)


def test_mask_type_passed_at_forward_overrides():
    q, k, v = inputs(5, 5, seed=4)
    module = make_attention(mask_type=AttnMaskType.no_mask)
    full = run(module, q, k, v)
    torch.testing.assert_close(
        full, naive_attention(q, k, v, torch.ones(1, 5, 5, dtype=torch.bool)), rtol=1e-10, atol=1e-10
    )
    causal = run(module, q, k, v, attn_mask_type=AttnMaskType.causal)
    torch.testing.assert_close(causal, naive_attention(q, k, v, allowed_by_hand(5, 5)[None]), rtol=1e-10, atol=1e-10)


def test_softmax_scale_default_and_explicit():
    q, k, v = inputs(4, 4, seed=5)
    assert make_attention().softmax_scale == pytest.approx(1.0 / math.sqrt(HN))
    module = make_attention(softmax_scale=0.37)
    ref = naive_attention(q, k, v, allowed_by_hand(4, 4)[None], scale=0.37)
    torch.testing.assert_close(run(module, q, k, v), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 1), (6, 3)])
def test_gqa_ratios(heads, groups):
    q, k, v = inputs(5, 5, heads=heads, groups=groups, seed=heads + groups)
    out = run(make_attention(), q, k, v)
    ref = naive_attention(q, k, v, allowed_by_hand(5, 5)[None])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------ sliding window


@pytest.mark.parametrize("w", [1, 2, 3, 5])
@pytest.mark.parametrize("sq,sk", [(8, 8), (1, 7), (3, 7), (6, 6)])
def test_sliding_window(w, sq, sk):
    q, k, v = inputs(sq, sk, seed=10 * w + sq)
    out = run(make_attention(window_size=(w - 1, 0)), q, k, v)
    ref = naive_attention(q, k, v, allowed_by_hand(sq, sk, window=w)[None])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_sliding_window_wider_than_sequence_is_plain_causal():
    q, k, v = inputs(4, 4, seed=21)
    out = run(make_attention(window_size=(10, 0)), q, k, v)
    torch.testing.assert_close(out, naive_attention(q, k, v, allowed_by_hand(4, 4)[None]), rtol=1e-10, atol=1e-10)


def test_sliding_window_actually_restricts():
    q, k, v = inputs(8, 8, seed=22)
    windowed = run(make_attention(window_size=(1, 0)), q, k, v)
    plain = run(make_attention(), q, k, v)
    assert torch.equal(windowed[:2], plain[:2]) or torch.allclose(windowed[:2], plain[:2])
    assert not torch.allclose(windowed[2:], plain[2:])


@pytest.mark.parametrize("sq,sk,window", [(3, 7, None), (7, 7, None), (1, 7, 2), (4, 9, 3), (5, 5, 0)])
def test_allowed_positions_helper(sq, sk, window):
    # window here is the left window (w - 1)
    got = _allowed_positions(sq, sk, window, torch.device("cpu"))
    want = allowed_by_hand(sq, sk, window=None if window is None else window + 1)
    assert torch.equal(got, want)


# -------------------------------------------------------------- explicit mask


def padding_causal_mask(sq, sk, pad_left):
    """megatron convention, True = masked out: causal (end-aligned) plus left padding per batch row."""
    masked = torch.zeros(len(pad_left), 1, sq, sk, dtype=torch.bool)
    for b, pad in enumerate(pad_left):
        for i in range(sq):
            pos = sk - sq + i
            for j in range(sk):
                masked[b, 0, i, j] = j > pos or (j < pad and pos >= pad)
    return masked


@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.padding])
@pytest.mark.parametrize("sq,sk", [(6, 6), (2, 6)])
def test_explicit_boolean_mask(mask_type, sq, sk):
    q, k, v = inputs(sq, sk, batch=3, seed=30 + sq)
    masked = padding_causal_mask(sq, sk, pad_left=[0, 2, 3])
    out = run(make_attention(mask_type=mask_type), q, k, v, masked)
    ref = naive_attention(q, k, v, ~masked[:, 0])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_explicit_mask_random_pattern():
    sq = sk = 5
    q, k, v = inputs(sq, sk, batch=2, seed=40)
    g = torch.Generator().manual_seed(41)
    masked = torch.rand(2, 1, sq, sk, generator=g) < 0.4
    for b in range(2):
        for i in range(sq):
            masked[b, 0, i, i] = False  # keep every row attending somewhere
    out = run(make_attention(mask_type=AttnMaskType.padding), q, k, v, masked)
    ref = naive_attention(q, k, v, ~masked[:, 0])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def packed_mask(segments: list[list[int]], s: int) -> torch.Tensor:
    """megatron convention, True = masked out: each row holds sequences of these lengths one after
    the other; a query attends keys of its own sequence at or before it (loops, by hand)."""
    masked = torch.ones(len(segments), 1, s, s, dtype=torch.bool)
    for b, lengths in enumerate(segments):
        owner = [k for k, n in enumerate(lengths) for _ in range(n)]
        owner += [owner[-1]] * (s - len(owner))  # tail padding continues the last sequence
        for i in range(s):
            for j in range(i + 1):
                masked[b, 0, i, j] = owner[i] != owner[j]
    return masked


@pytest.mark.parametrize("window", [None, 2])
def test_packed_sequences_mask_with_gqa_and_window(window):
    """Block-diagonal causal mask (packed sequences), GQA, and megatron's left window (w - 1 keys back)."""
    s = 9
    q, k, v = inputs(s, s, batch=2, seed=60)
    masked = packed_mask([[4, 3, 2], [6, 1]], s)
    out = run(make_attention(window_size=None if window is None else (window, 0)), q, k, v, masked)
    allowed = ~masked[:, 0]
    if window is not None:
        allowed &= allowed_by_hand(s, s, window=window + 1)
    torch.testing.assert_close(out, naive_attention(q, k, v, allowed), rtol=1e-10, atol=1e-10)


def packed_params(cu_seqlens: torch.Tensor, width: int, qkv_format: str = "sbhd") -> PackedSeqParams:
    return PackedSeqParams(
        qkv_format=qkv_format,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=width,
        max_seqlen_kv=width,
    )


def cu_seqlens_of(segments: list[list[int]], s: int) -> torch.Tensor:
    """Where each sequence starts in the rows' tokens read row by row (the last one of a row runs
    to the row's end), then the total: by hand."""
    starts, offset = [], 0
    for lengths in segments:
        starts += [offset + sum(lengths[:k]) for k in range(len(lengths))]
        offset += s
    return torch.tensor([*starts, offset], dtype=torch.int32)


@pytest.mark.parametrize("window", [None, 2])
def test_packed_rows_as_packed_seq_params_with_gqa_and_window(window):
    """The same rows described by their sequence starts (megatron's PackedSeqParams, 'sbhd')."""
    s, segments = 9, [[4, 3, 2], [6, 1], [9]]
    q, k, v = inputs(s, s, batch=3, seed=62)
    cu_seqlens = cu_seqlens_of(segments, s)
    assert torch.equal(packed_rows_mask(cu_seqlens, 3, s), packed_mask(segments, s))
    module = make_attention(window_size=None if window is None else (window, 0))
    out = run(module, q, k, v, None, packed_seq_params=packed_params(cu_seqlens, s))
    allowed = ~packed_mask(segments, s)[:, 0]
    if window is not None:
        allowed &= allowed_by_hand(s, s, window=window + 1)
    torch.testing.assert_close(out, naive_attention(q, k, v, allowed), rtol=1e-10, atol=1e-10)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads,groups", [(4, 2), (6, 1), (4, 4)])
def test_packed_rows_on_cuda_take_flash_varlen_and_match_float64(heads, groups, window):
    """bf16 packed rows on CUDA go through flash attention's variable-length kernel: forward and
    gradients against the float64 block-diagonal attention, as close as the masked bf16 path."""
    from megatron_rlhf.models.attention import _flash_varlen_usable

    s, hn, segments = 96, 64, [[40, 30, 26], [96], [10, 10, 10, 5], [1, 95]]
    q, k, v = inputs(s, s, batch=len(segments), heads=heads, groups=groups, hn=hn, seed=63)
    grad_out = torch.randn(
        s, len(segments), heads * hn, generator=torch.Generator().manual_seed(64), dtype=torch.float64
    )
    cu_seqlens = cu_seqlens_of(segments, s)
    allowed = ~packed_mask(segments, s)[:, 0]
    if window is not None:
        allowed &= allowed_by_hand(s, s, window=window + 1)

    def attend(module, dtype, device, **kwargs):
        leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
        out = module.to(device)(*leaves, **kwargs)
        out.backward(grad_out.to(device, dtype))
        return [t.double().cpu() for t in (out, *(leaf.grad for leaf in leaves))]

    config = make_config(None if window is None else (window, 0))
    config.num_attention_heads, config.num_query_groups, config.kv_channels = heads, groups, hn
    module = SDPAttention(config, 1, AttnMaskType.causal, "self").train()
    assert _flash_varlen_usable(q.to("cuda", torch.bfloat16), 0.0)
    cuda = torch.device("cuda")
    flash = attend(
        module, torch.bfloat16, cuda, attention_mask=None, packed_seq_params=packed_params(cu_seqlens.cuda(), s)
    )
    masked = attend(module, torch.bfloat16, cuda, attention_mask=~allowed[:, None].cuda())
    reference = attend(module, torch.float64, torch.device("cpu"), attention_mask=~allowed[:, None])
    for got, bf16_masked, want in zip(flash, masked, reference, strict=True):
        error, masked_error = (got - want).abs().max(), (bf16_masked - want).abs().max()
        assert error <= max(2 * masked_error, 1e-2), (error, masked_error)


@pytest.mark.gpu
def test_packed_sequences_mask_with_gqa_on_cuda():
    """On CUDA a mask with GQA repeats K/V heads (no enable_gqa): the same result as the CPU path."""
    s = 64
    q, k, v = (t.float() for t in inputs(s, s, batch=3, seed=61))
    masked = packed_mask([[30, 20, 14], [64], [10, 10, 10, 5]], s)
    module = make_attention()
    cpu = run(module, q, k, v, masked)
    cuda = run(module.cuda(), q.cuda(), k.cuda(), v.cuda(), masked.cuda())
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=1e-4, atol=1e-4)
    ref = naive_attention(q.double(), k.double(), v.double(), ~masked[:, 0])
    torch.testing.assert_close(cpu.double(), ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------ misc behaviour


def test_eval_ignores_dropout_and_float32_close():
    module = SDPAttention(make_config(attention_dropout=0.5), 1, AttnMaskType.causal, "self").eval()
    q, k, v = inputs(6, 6, seed=50)
    ref = naive_attention(q, k, v, allowed_by_hand(6, 6)[None])
    out32 = run(module, q.float(), k.float(), v.float())
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), ref, rtol=1e-5, atol=1e-5)


def test_output_is_head_major_within_hidden():
    # output[..., h*hn:(h+1)*hn] is head h: with v = one-hot group ids, values identify the group.
    sq = sk = 3
    q, k, _ = inputs(sq, sk, batch=1, seed=60)
    v = torch.zeros(sk, 1, GROUPS, HN, dtype=torch.float64)
    for g in range(GROUPS):
        v[:, :, g, :] = g + 1.0
    out = run(make_attention(), q, k, v).reshape(sq, 1, HEADS, HN)
    for h in range(HEADS):
        torch.testing.assert_close(
            out[:, :, h], torch.full((sq, 1, HN), h // (HEADS // GROUPS) + 1.0, dtype=torch.float64)
        )


def test_refuses_bias_and_packed_rows_it_cannot_read():
    q, k, v = inputs(2, 2)
    module = make_attention()
    cu_seqlens = torch.tensor([0, 1, 4], dtype=torch.int32)
    with pytest.raises(NotImplementedError):
        module(q, k, v, None, packed_seq_params=packed_params(cu_seqlens, 2, qkv_format="thd"))
    with pytest.raises(NotImplementedError):
        module(q, k, v, torch.zeros(2, 1, 2, 2, dtype=torch.bool), packed_seq_params=packed_params(cu_seqlens, 2))
    with pytest.raises(NotImplementedError):
        module(q, k, v, None, attention_bias=torch.zeros(1))


# ------------------------------------------- decode over a KV cache, in place


@pytest.mark.parametrize("heads,groups,window", [(4, 2, None), (6, 3, None), (4, 4, None), (4, 1, 2), (12, 2, None)])
def test_cached_decode_attention_per_slot_lengths(heads, groups, window):
    # Each slot holds its own prefix length; the reference attends slot by slot over exactly
    # keys [0, position] (and the window), with the GQA head repeat done by hand.
    slots, max_len, kv_len = 3, 10, 8
    positions = torch.tensor([[7], [0], [4]])
    g = torch.Generator().manual_seed(heads * 10 + groups)
    cache_k = torch.randn(slots, groups, max_len, HN, generator=g, dtype=torch.float64)
    cache_v = torch.randn(slots, groups, max_len, HN, generator=g, dtype=torch.float64)
    query = torch.randn(1, slots, heads, HN, generator=g, dtype=torch.float64)
    assert decode_score_bias(positions, kv_len, window).shape == (slots, kv_len)
    out = cached_decode_attention(query, torch.cat([cache_k, cache_v], dim=-1), positions, kv_len, window, 0.3)
    assert out.shape == (1, slots, heads * HN)
    for slot in range(slots):
        pos = int(positions[slot, 0])
        k = cache_k[slot].transpose(0, 1)[: pos + 1, None]  # (pos + 1, 1, groups, hn)
        v = cache_v[slot].transpose(0, 1)[: pos + 1, None]
        # window=w in megatron's (left) convention keeps keys pos - w .. pos: w + 1 keys
        allowed = allowed_by_hand(1, pos + 1, window=None if window is None else window + 1)
        ref = naive_attention(query[:, slot : slot + 1], k, v, allowed[None], scale=0.3)
        torch.testing.assert_close(out[:, slot : slot + 1], ref, rtol=1e-10, atol=1e-10)


def test_rotate_matches_megatron_unfused_rope():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    g = torch.Generator().manual_seed(7)
    t = torch.randn(5, 2, 4, HN, generator=g).to(torch.bfloat16)
    freqs = torch.randn(5, 2, 1, HN, generator=g)
    got = rotate(t, freqs.cos().to(t.dtype), freqs.sin().to(t.dtype))
    assert torch.equal(got, _apply_rotary_pos_emb_bshd(t, freqs))


def test_add_rms_norm_is_the_residual_add_then_torch_rms_norm() -> None:
    """The decode path's fused add + norm against the two modules megatron's layer runs, in float64."""
    from megatron_rlhf.models.attention import add_rms_norm

    g = torch.Generator().manual_seed(0)
    hidden, delta = (
        torch.randn(2, 5, 16, generator=g, dtype=torch.float64),
        torch.randn(2, 5, 16, generator=g, dtype=torch.float64),
    )
    norm = torch.nn.RMSNorm(16, eps=1e-6, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16, generator=g, dtype=torch.float64) + 0.5)
    summed, normed = add_rms_norm(hidden, delta, norm.weight, norm.eps)
    assert torch.equal(summed, hidden + delta)
    torch.testing.assert_close(normed, norm(hidden + delta), rtol=1e-12, atol=1e-12)


def test_rotate_into_cache_stores_each_rows_entry_at_its_slot_and_positions() -> None:
    from megatron_rlhf.models.attention import rotate, rotate_into_cache

    g = torch.Generator().manual_seed(0)
    sq, b, heads, groups, hn = 3, 2, 4, 2, 8
    query, key, value = (torch.randn(sq, b, n, hn, generator=g) for n in (heads, groups, groups))
    angles = torch.rand(sq, b, 1, hn, generator=g)
    cache = torch.zeros(4, groups, 6, 2 * hn)
    slots, positions = torch.tensor([3, 1]), torch.tensor([[0, 1, 2], [2, 3, 4]])
    rotated, _entry = rotate_into_cache(query, key, value, angles.cos(), angles.sin(), cache, slots, positions)
    assert torch.equal(rotated, rotate(query, angles.cos(), angles.sin()))
    for row in range(b):
        for t in range(sq):
            expected = torch.cat([rotate(key, angles.cos(), angles.sin())[t, row], value[t, row]], dim=-1)
            assert torch.equal(cache[slots[row], :, positions[row, t]], expected)
    assert int((cache.abs().sum(-1) > 0).sum()) == b * sq * groups  # nothing written elsewhere


def test_split_qkv_reads_megatrons_per_group_layout() -> None:
    """megatron's fused QKV output holds, per KV group, that group's query heads, its key, its value
    (``SelfAttention.get_query_key_value_tensors``); checked on a tensor of distinct values."""
    from megatron_rlhf.models.attention import split_qkv

    groups, per_group, hn, sq, b = 2, 3, 4, 2, 5
    mixed = torch.arange(sq * b * groups * (per_group + 2) * hn, dtype=torch.float32).view(sq, b, -1)
    query, key, value = split_qkv(mixed, groups, per_group)
    for group in range(groups):
        base = group * (per_group + 2) * hn
        for head in range(per_group):
            assert torch.equal(
                query[:, :, group * per_group + head], mixed[:, :, base + head * hn : base + (head + 1) * hn]
            )
        assert torch.equal(key[:, :, group], mixed[:, :, base + per_group * hn : base + (per_group + 1) * hn])
        assert torch.equal(value[:, :, group], mixed[:, :, base + (per_group + 1) * hn : base + (per_group + 2) * hn])


def _sdpa_node(out: torch.Tensor) -> str:
    """The name of the SDPA autograd node behind ``out``: which kernel ran (its backward runs the same)."""
    seen, frontier = set(), [out.grad_fn]
    while frontier:
        node = frontier.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "ScaledDotProduct" in node.name():
            return node.name()
        frontier.extend(next_node for next_node, _ in node.next_functions)
    raise AssertionError("no SDPA node behind the output")


@pytest.mark.gpu
def test_shapes_the_warm_up_did_not_plan_take_flash_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch's choice (cuDNN on Hopper: a plan per new shape) keeps the shapes the warm-up ran; once it
    has run, any other shape takes flash attention, with the result of torch's choice to bf16
    rounding. Before any warm-up, every shape takes torch's choice."""
    from megatron_rlhf.models.attention import _AttentionPlans, planning_attention

    monkeypatch.setattr(_AttentionPlans, "calls", set())  # a process no warm-up has planned in
    config = make_config()
    config.num_attention_heads, config.num_query_groups, config.kv_channels = 12, 2, 128
    module = SDPAttention(config, 1, AttnMaskType.causal, "self").train().cuda()

    def attend(s: int, batch: int) -> tuple[str, str, torch.Tensor, torch.Tensor]:
        """The kernel (autograd node) SDPAttention ran and the one torch chooses itself, and both outputs."""
        leaves = [t.to("cuda", torch.bfloat16).requires_grad_() for t in inputs(s, s, batch, 12, 2, 128, seed=s)]
        out = module(*leaves, None)
        q, k, v = (t.detach().permute(1, 2, 0, 3).requires_grad_() for t in leaves)
        choice = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return _sdpa_node(out), _sdpa_node(choice), out.detach(), choice.detach().permute(2, 0, 1, 3).reshape(out.shape)

    ran, chosen, _, _ = attend(80, 5)
    assert ran == chosen, (ran, chosen)
    with planning_attention():
        attend(96, 3)
    ran, chosen, _, _ = attend(96, 3)
    assert ran == chosen, (ran, chosen)
    ran, chosen, out, torch_choice = attend(80, 5)
    assert "Flash" in ran, (ran, chosen)
    torch.testing.assert_close(out, torch_choice, rtol=2e-2, atol=2e-2)
