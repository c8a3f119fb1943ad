"""The layers' RMSNorm (``models/rms_norm.py``) where megatron would build torch's."""

from __future__ import annotations

import torch


def _model():
    from megatron_rlhf.models.architecture import architecture_from_hf_config
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.parallel.layout import Layout, parallel_groups

    arch = architecture_from_hf_config({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "vocab_size": 97, "hidden_size": 96, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 64,
    })  # fmt: skip
    return build_model(arch, parallel_groups(Layout.for_world(1, 1, 1)), dtype=torch.float32, device=torch.device("cpu"))


def test_layers_norms_are_ours_with_torchs_forward_and_decoding_still_fuses(world_of_one) -> None:
    """Without apex the layers' norms are ``models/rms_norm.py``'s (their backward is a kernel on a
    GPU; the forward is torch's), named and shaped as before, and the engine's fused decode layer
    still takes them."""
    from megatron_rlhf.models.rms_norm import RMSNorm
    from megatron_rlhf.rollout.native import _decode_fusable

    model = _model()
    layer = model.decoder.layers[0]
    assert type(layer.input_layernorm) is RMSNorm and type(layer.pre_mlp_layernorm) is RMSNorm
    assert type(model.decoder.final_layernorm) is torch.nn.RMSNorm
    assert "decoder.layers.0.input_layernorm.weight" in model.state_dict()
    assert _decode_fusable(model.decoder)
    layer.input_layernorm.weight.data.copy_(1 + 0.3 * torch.randn(96))
    x = torch.randn(5, 2, 96)
    reference = torch.nn.RMSNorm(96, eps=layer.input_layernorm.eps)
    reference.weight.data.copy_(layer.input_layernorm.weight)
    assert torch.equal(layer.input_layernorm(x), reference(x))


def test_the_kernels_backward_formula_is_autograds() -> None:
    """The formula ``_backward_kernel`` computes (module docstring), written in float64, equals
    autograd of torch's rms_norm: dx = r (w dy) - x r^3 mean(x w dy), dw = sum of x r dy."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 33, generator=g, dtype=torch.float64, requires_grad=True)
    w = (1 + 0.3 * torch.randn(33, generator=g, dtype=torch.float64)).requires_grad_()
    dy = torch.randn(7, 33, generator=g, dtype=torch.float64)
    eps = 1e-6
    torch.nn.functional.rms_norm(x, (33,), w, eps).backward(dy)
    r = (x.detach().pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    w_dy = w.detach() * dy
    dx = r * w_dy - x.detach() * r**3 * (x.detach() * w_dy).mean(-1, keepdim=True)
    torch.testing.assert_close(dx, x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close((x.detach() * r * dy).sum(0), w.grad, rtol=1e-12, atol=1e-12)
