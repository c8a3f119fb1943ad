"""The builder turns on megatron's rotary, SwiGLU and weight-gradient-accumulation fusions, with the
kernels of ``models/torch_fusions.py`` where apex/TE are absent. Reference: the same model and
batch through megatron's unfused paths (each linear's ``gradient_accumulation_fusion`` and the
config's ``apply_rope_fusion`` and ``bias_activation_fusion`` switched off): the gradient buffers
the optimizer reads must match,
with tied and untied embeddings (a tied weight gets the output layer's fused gradient and the
embedding lookup's unfused one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from tests.helpers import PAD_ID, make_tiny_hf_model


def _main_grads(hf_dir: Path, env, fused: bool) -> dict[str, torch.Tensor]:
    from megatron_rlhf.checkpoint.sources import ModelConfig, build_role
    from megatron_rlhf.models.architecture import load_architecture
    from megatron_rlhf.training.objectives import sft_loss
    from megatron_rlhf.training.optim import OptimConfig, make_train_state
    from megatron_rlhf.training.train import _forward_backward

    role = build_role(
        "actor",
        ModelConfig(path=str(hf_dir)),
        load_architecture(hf_dir),
        world_size=1,
        dtype=torch.float32,
        device=env.device,
    )
    config = role.model.config
    assert config.gradient_accumulation_fusion and config.apply_rope_fusion and config.bias_activation_fusion
    if not fused:
        config.apply_rope_fusion = config.bias_activation_fusion = False
        for module in role.model.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.gradient_accumulation_fusion = False
    state = make_train_state(role, OptimConfig())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, PAD_ID, (4, 12), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    _forward_backward(state, batch, sft_loss(role), 64, 1, True)  # train_step's forward and backward
    return {name: p.main_grad.clone() for name, p in state.ddp_model.module.named_parameters()}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fused_gradient_buffers_equal_megatrons_unfused_ones(world_of_one, tmp_path: Path, tied: bool) -> None:
    make_tiny_hf_model("llama", False, tmp_path, tie_word_embeddings=tied)
    fused, unfused = _main_grads(tmp_path, world_of_one, True), _main_grads(tmp_path, world_of_one, False)
    assert set(fused) == set(unfused)
    assert ("output_layer.weight" in fused) != tied
    for name in unfused:
        assert unfused[name].abs().sum() > 0, name
        torch.testing.assert_close(fused[name], unfused[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "interleaved,rot_dim", [(False, 16), (True, 16), (False, 8)], ids=["half", "interleaved", "partial"]
)
def test_rotary_with_tables_equals_megatrons_formula(dtype: torch.dtype, interleaved: bool, rot_dim: int) -> None:
    """``rotary_bshd`` (cos and sin taken once per angle table) against megatron's unfused formula,
    which takes them in every call: equal bit for bit, forward and backward, for the query and the
    key of one table (the tables are reused) and again for another table of the same shape (they
    are not)."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rlhf.models.torch_fusions import rotary_bshd

    g = torch.Generator().manual_seed(0)
    s, b, hn = 7, 3, 16
    for _ in range(2):  # a second forward pass: a new table, same shape
        freqs = 40 * torch.rand(s, b, 1, rot_dim, generator=g)
        for heads in (4, 2):  # query, then key
            t = torch.randn(s, b, heads, hn, generator=g).to(dtype)
            upstream = torch.randn(s, b, heads, hn, generator=g).to(dtype)
            outputs = []
            for fn in (
                lambda x, freqs=freqs: rotary_bshd(x, freqs, interleaved=interleaved),
                lambda x, freqs=freqs: rope_utils._apply_rotary_pos_emb_bshd(x, freqs, rotary_interleaved=interleaved),
            ):
                leaf = t.clone().requires_grad_()
                out = fn(leaf)
                (out * upstream).sum().backward()
                outputs.append((out.detach(), leaf.grad))
            (ours, our_grad), (megatron, megatron_grad) = outputs
            assert torch.equal(ours, megatron) and torch.equal(our_grad, megatron_grad)
            assert not torch.equal(ours, t)  # it rotated something


def test_optimizer_multi_tensor_kernels_match_float64() -> None:
    """The foreach stand-ins for apex's multi-tensor kernels that megatron's optimizer calls: the
    gradient norm over all tensors against float64, the scale in place and the scaled (casting)
    copy against the per-tensor loop."""
    from megatron_rlhf.models.torch_fusions import _foreach_l2_norm, _foreach_scale

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g) * (i + 1) for i, n in enumerate((7, 300, 1, 64))]
    norm, _ = _foreach_l2_norm(0, torch.zeros(1), [grads], False)
    expected = torch.cat([t.double() for t in grads]).norm()
    assert norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm.double(), expected.reshape(1), rtol=1e-6, atol=0)

    scaled = [t.clone() for t in grads]
    _foreach_scale(0, torch.zeros(1), [scaled, scaled], 0.25)
    assert all(torch.equal(s, t * 0.25) for s, t in zip(scaled, grads, strict=True))
    for scale in (1.0, 0.5):
        targets = [torch.zeros(t.shape, dtype=torch.bfloat16) for t in grads]
        _foreach_scale(0, torch.zeros(1), [grads, targets], scale)
        assert all(torch.equal(out, (t * scale).bfloat16()) for out, t in zip(targets, grads, strict=True))


def test_megatron_grad_norm_uses_the_foreach_norm(world_of_one) -> None:
    """megatron's ``get_grad_norm_fp32`` (what the optimizer's clip reads) through the installed
    norm equals the float64 norm of the gradients."""
    from megatron.core.optimizer import clip_grads

    from megatron_rlhf.models import torch_fusions

    torch_fusions.install()
    assert clip_grads.l2_norm_impl is torch_fusions._foreach_l2_norm
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(n, generator=g) for n in (10, 33)]
    norm = clip_grads.get_grad_norm_fp32(grads, grad_stats_parallel_group=torch.distributed.group.WORLD)
    assert norm == pytest.approx(torch.cat([t.double() for t in grads]).norm().item(), rel=1e-6)
