"""GPU tier: our stand-ins for megatron's apex/TE training fusions (models/torch_fusions.py) and
the SwiGLU kernel (models/swiglu.py) against float64, with megatron's own bf16 paths as the
yardstick for what bf16 rounding costs; and the decode step's SwiGLU against megatron's, its fused
QKV split against the unfused kernels."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from megatron_rlhf.models.attention import rotate_into_cache, split_qkv, split_rotate_into_cache, swiglu
from megatron_rlhf.models.swiglu import swiglu_impl
from megatron_rlhf.models.torch_fusions import _wgrad_gemm_accum_fp32, rotary_bshd


@pytest.mark.gpu
def test_wgrad_accumulates_into_float32_main_grad_like_float64() -> None:
    g = torch.Generator().manual_seed(0)
    tokens, fan_in, fan_out = 4096, 512, 768
    x = torch.randn(tokens, fan_in, generator=g).to("cuda", torch.bfloat16)
    grad_out = torch.randn(tokens, fan_out, generator=g).to("cuda", torch.bfloat16)
    main_grad = torch.randn(fan_out, fan_in, generator=g).cuda()
    reference = main_grad.double() + grad_out.double().t() @ x.double()
    unfused = main_grad + grad_out.t() @ x  # megatron without the fusion: a bf16 GEMM, then an add
    _wgrad_gemm_accum_fp32(x, grad_out, main_grad)  # in place
    fused_error = (main_grad.double() - reference).abs().max().item()
    unfused_error = (unfused.double() - reference).abs().max().item()
    print(f"wgrad accumulation max error: fused {fused_error:.2e}, bf16 GEMM + add {unfused_error:.2e}")
    assert fused_error < 1e-3 * reference.abs().max().item()
    assert fused_error <= unfused_error  # float32 accumulation, one rounding


@pytest.mark.gpu
def test_compiled_rotary_matches_float64_forward_and_backward() -> None:
    g = torch.Generator().manual_seed(1)
    s, b, heads, hn = 64, 3, 4, 128
    t = torch.randn(s, b, heads, hn, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    freqs = 50 * torch.rand(s, b, 1, hn, generator=g).cuda()  # per-token table, as packed rows use
    upstream = torch.randn(s, b, heads, hn, generator=g).to("cuda", torch.bfloat16)
    errors = {}
    for name, fn, inputs in (
        ("compiled", rotary_bshd, (t, freqs)),
        ("eager", rope_utils._apply_rotary_pos_emb_bshd, (t, freqs)),
        ("float64", rope_utils._apply_rotary_pos_emb_bshd, (t.double(), freqs.double())),
    ):
        t.grad = None
        out = fn(*inputs)
        (out * upstream.to(out.dtype)).sum().backward()
        errors[name] = (out.detach().double(), t.grad.double())
    for i, what in enumerate(("forward", "gradient")):
        reference = errors["float64"][i]
        compiled = (errors["compiled"][i] - reference).abs().max().item()
        eager = (errors["eager"][i] - reference).abs().max().item()
        print(f"rotary {what} max error: compiled {compiled:.2e}, eager {eager:.2e}")
        assert compiled <= eager + 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2048, 2 * 8960), (3, 5, 2 * 700)], ids=["tokens", "s-b-odd-width"])
def test_swiglu_kernel_matches_float64_forward_and_backward(shape: tuple[int, ...]) -> None:
    """Forward and backward against float64; at most megatron's compiled kernel's error (both
    round once), which the backward exceeds at no element by more than one bf16 rounding."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    g = torch.Generator().manual_seed(4)
    y = (3 * torch.randn(*shape, generator=g)).to("cuda", torch.bfloat16)
    upstream = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to("cuda", torch.bfloat16)
    results = {}
    for name, fn, dtype in (
        ("kernel", swiglu_impl, torch.bfloat16),
        ("megatron", bias_swiglu_impl, torch.bfloat16),
        ("float64", bias_swiglu_impl, torch.float64),
    ):
        leaf = y.detach().to(dtype, copy=True).requires_grad_()
        out = fn(leaf, None)
        assert out.shape == upstream.shape
        (out * upstream.to(dtype)).sum().backward()
        results[name] = (out.detach().double(), leaf.grad.double())
    for i, what in enumerate(("forward", "gradient")):
        reference = results["float64"][i]
        kernel = (results["kernel"][i] - reference).abs()
        megatron = (results["megatron"][i] - reference).abs()
        print(f"swiglu {what} max error: kernel {kernel.max().item():.3e}, megatron {megatron.max().item():.3e}")
        assert kernel.max().item() <= megatron.max().item() * 1.01 + 1e-6
        assert (kernel <= 2**-8 * reference.abs() + 1e-6).all()  # one bf16 rounding of the exact value


@pytest.mark.gpu
def test_decode_swiglu_and_fused_qkv_split_match_the_unfused_kernels() -> None:
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    g = torch.Generator().manual_seed(2)
    up = torch.randn(1, 16, 2 * 96, generator=g).to("cuda", torch.bfloat16)
    assert torch.equal(swiglu(up), bias_swiglu_impl(up, None))  # the MLP's GPU path, bit for bit

    groups, per_group, hn, slots = 2, 3, 64, 5
    mixed = torch.randn(1, slots, groups * (per_group + 2) * hn, generator=g).to("cuda", torch.bfloat16)
    query, key, value = split_qkv(mixed, groups, per_group)  # the layout: tests/unit/test_attention.py

    angles = 10 * torch.rand(1, slots, 1, hn, generator=g).cuda()
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    positions = torch.arange(slots, device="cuda")[:, None]
    cache_split, cache_apart = (
        torch.zeros(slots, groups, 8, 2 * hn, device="cuda", dtype=torch.bfloat16) for _ in range(2)
    )
    slot_ids = torch.arange(slots, device="cuda")
    fused_q, _ = split_rotate_into_cache(mixed, per_group, cos, sin, cache_split, slot_ids, positions)
    apart_q, _ = rotate_into_cache(query, key, value, cos, sin, cache_apart, slot_ids, positions)
    assert torch.equal(fused_q, apart_q) and torch.equal(cache_split, cache_apart)
