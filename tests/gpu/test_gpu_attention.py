"""GPU tier: the decode attention and rotary kernels of the generation engine in bf16 (float32
accumulating matmuls, compiled softmax and rotary) against float64 references, with torch's own
bf16 SDPA / eager rotary as the yardstick for what bf16 rounding costs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_rlhf.models.attention import cached_decode_attention, decode_score_bias, rotate, rotate_into_cache


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 5])
def test_decode_attention_bf16_matches_float64(window: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    slots, groups, heads, hn, max_len, kv_len = 8, 2, 12, 128, 64, 48
    cache_k = torch.randn(slots, groups, max_len, hn, generator=g).to("cuda", torch.bfloat16)
    cache_v = torch.randn(slots, groups, max_len, hn, generator=g).to("cuda", torch.bfloat16)
    query = torch.randn(1, slots, heads, hn, generator=g).to("cuda", torch.bfloat16)
    positions = torch.randint(0, kv_len, (slots, 1), generator=g).cuda()
    scale = hn**-0.5
    cache = torch.cat([cache_k, cache_v], dim=-1)
    out = cached_decode_attention(query, cache, decode_score_bias(positions, kv_len, groups, window), scale)

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
    print(f"decode attention bf16 max error: ours {worst_ours:.2e}, torch SDPA {worst_sdpa:.2e}")
    assert worst_ours <= 2 * worst_sdpa + 1e-3


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
