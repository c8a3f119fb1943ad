"""GPU tier: the generation engine's decode attention (Triton kernels, bf16 and float32: attention
over the cache, and rotary + cache store + attention from the QKV output) and compiled rotary
kernels against float64 references, with torch's own SDPA / eager rotary in the same dtype, or the
unfused path, as the yardstick for what rounding costs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_rlhf.models import decode_attention
from megatron_rlhf.models.attention import (
    cached_decode_attention,
    decode_score_bias,
    matmul_decode_attention,
    rotary_tables,
    rotate,
    rotate_into_cache,
    rotate_store_attend,
    split_qkv,
    split_rotate_into_cache,
)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hn", [128, 80])  # 80: padded to 128 inside the kernel
def test_decode_attention_matches_float64(window: int | None, dtype: torch.dtype, hn: int) -> None:
    g = torch.Generator().manual_seed(0)
    slots, groups, heads, max_len, kv_len = 8, 2, 12, 200, 150  # kv_len: two full blocks and a part
    cache_k = torch.randn(slots, groups, max_len, hn, generator=g).to("cuda", dtype)
    cache_v = torch.randn(slots, groups, max_len, hn, generator=g).to("cuda", dtype)
    query = torch.randn(1, slots, heads, hn, generator=g).to("cuda", dtype)
    positions = torch.randint(0, kv_len, (slots, 1), generator=g).cuda()
    scale = hn**-0.5
    cache = torch.cat([cache_k, cache_v], dim=-1)
    out = cached_decode_attention(query, cache, positions, kv_len, window, scale)

    worst_ours = worst_sdpa = 0.0
    for slot in range(slots):
        pos = int(positions[slot, 0])
        start = 0 if window is None else max(pos - window, 0)
        k = cache_k[slot, :, start : pos + 1][None]  # (1, groups, n, hn)
        v = cache_v[slot, :, start : pos + 1][None]
        q = query[0, slot][None, :, None]  # (1, heads, 1, hn)
        reference = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale, enable_gqa=True)
        sdpa = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        ours = out[0, slot].view(heads, hn)
        worst_ours = max(worst_ours, (ours.double() - reference[0, :, 0]).abs().max().item())
        worst_sdpa = max(worst_sdpa, (sdpa.double() - reference).abs().max().item())
    print(f"decode attention {dtype} max error: ours {worst_ours:.2e}, torch SDPA {worst_sdpa:.2e}")
    assert worst_ours <= 2 * worst_sdpa + (1e-3 if dtype == torch.bfloat16 else 1e-5)

    # Each slot reads its own attended keys only: NaN everywhere else changes nothing.
    poisoned = torch.full_like(cache, float("nan"))
    for slot in range(slots):
        pos = int(positions[slot, 0])
        start = 0 if window is None else max(pos - window, 0)
        poisoned[slot, :, start : pos + 1] = cache[slot, :, start : pos + 1]
    assert torch.equal(cached_decode_attention(query, poisoned, positions, kv_len, window, scale), out)
    # A finished slot's stale position may lie beyond kv_len (+ the window): finite, not NaN.
    stale = cached_decode_attention(query, cache, torch.full_like(positions, max_len - 1), kv_len, window, scale)
    assert torch.isfinite(stale).all()


@pytest.mark.gpu
def test_fused_rotary_bf16_matches_float64() -> None:
    g = torch.Generator().manual_seed(1)
    query = torch.randn(1, 16, 12, 128, generator=g).to("cuda", torch.bfloat16)
    key = torch.randn(1, 16, 2, 128, generator=g).to("cuda", torch.bfloat16)
    angles = 100 * torch.rand(1, 16, 1, 128, generator=g).cuda()
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    value = torch.randn(1, 16, 2, 128, generator=g).to("cuda", torch.bfloat16)
    cache = torch.zeros(16, 2, 8, 256, device="cuda", dtype=torch.bfloat16)  # (slots, groups, max_len, 2 hn)
    slots, positions = torch.arange(15, -1, -1, device="cuda"), torch.arange(16, device="cuda")[:, None] % 8
    fused_q, entry = rotate_into_cache(query, key, value, cos, sin, cache, slots, positions)
    fused_k = entry[..., :128]
    assert torch.equal(entry[..., 128:], value)
    assert torch.equal(cache[slots, :, positions[:, 0]], entry[0])  # stored at each row's slot and position
    for fused, t in ((fused_q, query), (fused_k, key)):
        reference = rotate(t.double(), cos.double(), sin.double())
        eager_error = (rotate(t, cos, sin).double() - reference).abs().max().item()
        fused_error = (fused.double() - reference).abs().max().item()
        print(f"rotary bf16 max error: fused {fused_error:.2e}, eager {eager_error:.2e}")
        assert fused_error <= eager_error + 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hn", [128, 80])
def test_rotate_store_attend_matches_float64(window: int | None, dtype: torch.dtype, hn: int) -> None:
    # The one-kernel decode step (rotary, cache store, attention) against the same computed in
    # float64 from the same inputs; the unfused GPU path (compiled rotary + store, then the
    # attention kernel) is the yardstick for rounding. The cache entries must match it too.
    g = torch.Generator().manual_seed(2)
    slots, groups, heads_per_group, max_len, kv_len = 8, 2, 6, 200, 150
    assert decode_attention.available(torch.zeros(1, device="cuda", dtype=dtype))
    cache = torch.randn(slots, groups, max_len, 2 * hn, generator=g).to("cuda", dtype)
    mixed = torch.randn(1, slots, groups * (heads_per_group + 2) * hn, generator=g).to("cuda", dtype)
    positions = torch.randint(0, kv_len, (slots, 1), generator=g).cuda()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hn, 2, device="cuda").float() / hn))
    cos, sin = rotary_tables(positions, inv_freq, dtype)
    scale = hn**-0.5
    slot_ids = torch.arange(slots, device="cuda")

    fused_cache, unfused_cache = cache.clone(), cache.clone()
    fused = rotate_store_attend(
        mixed, heads_per_group, cos, sin, fused_cache, slot_ids, positions, kv_len, window, scale
    )
    query, _ = split_rotate_into_cache(mixed, heads_per_group, cos, sin, unfused_cache, slot_ids, positions)
    unfused = cached_decode_attention(query, unfused_cache, positions, kv_len, window, scale)

    reference_cache = cache.double()
    q, k, v = split_qkv(mixed.double(), groups, heads_per_group)
    q, k = rotate(q, cos.double(), sin.double()), rotate(k, cos.double(), sin.double())
    reference_cache[slot_ids, :, positions[:, 0]] = torch.cat([k, v], dim=-1)[0]
    window_cache = reference_cache[:, :, :kv_len]
    reference = matmul_decode_attention(
        q[0].view(slots, groups, heads_per_group, hn),
        window_cache[..., :hn],
        window_cache[..., hn:],
        decode_score_bias(positions, kv_len, window).double(),
        scale,
    )
    reference = reference.reshape(1, slots, -1)
    fused_error = (fused.double() - reference).abs().max().item()
    unfused_error = (unfused.double() - reference).abs().max().item()
    cache_error = (fused_cache.double() - reference_cache).abs().max().item()
    unfused_cache_error = (unfused_cache.double() - reference_cache).abs().max().item()
    print(
        f"rotate_store_attend {dtype} hn {hn} max error: fused {fused_error:.2e}, unfused {unfused_error:.2e}; "
        f"cache {cache_error:.2e}, unfused {unfused_cache_error:.2e}"
    )
    tolerance = 1e-3 if dtype == torch.bfloat16 else 1e-5
    assert fused_error <= 2 * unfused_error + tolerance
    assert cache_error <= unfused_cache_error + tolerance
