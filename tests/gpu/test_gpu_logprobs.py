"""GPU tier: the fused (torch.compile) log-prob / entropy kernels against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.training.logprobs import token_logprobs_and_entropy


def _reference(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float):
    z = logits.double()[..., :vocab_size] / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_kernels_match_float64(dtype: torch.dtype, temperature: float) -> None:
    g = torch.Generator().manual_seed(0)
    vocab_size, padded = 1000, 1024
    logits = (3 * torch.randn(3, 17, padded, generator=g)).to("cuda", dtype).requires_grad_()
    targets = torch.randint(0, vocab_size, (3, 17), generator=g).cuda()
    w1, w2 = torch.randn(3, 17, generator=g).cuda(), torch.randn(3, 17, generator=g).cuda()

    logp, entropy = token_logprobs_and_entropy(
        logits, targets, tp_group=None, vocab_size=vocab_size, temperature=temperature
    )
    ((w1 * logp).sum() + (w2 * entropy).sum()).backward()

    leaf = logits.detach().double().requires_grad_()
    ref_logp, ref_entropy = _reference(leaf, targets, vocab_size, temperature)
    ((w1.double() * ref_logp).sum() + (w2.double() * ref_entropy).sum()).backward()

    assert (logp.double() - ref_logp).abs().max().item() < 2e-5
    assert (entropy.double() - ref_entropy).abs().max().item() < 2e-5
    grad_scale = leaf.grad.abs().max().item()
    # The gradient is returned in the logits' dtype: bf16 rounding (2^-8 relative) bounds its error.
    rtol = 1e-5 if dtype == torch.float32 else 8e-3
    assert (logits.grad.double() - leaf.grad).abs().max().item() <= rtol * grad_scale
    assert logits.grad[..., vocab_size:].abs().max().item() == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_pass_kernels_at_a_full_vocabulary_on_a_sliced_view(dtype: torch.dtype) -> None:
    """The Triton passes (``training/logprobs_kernel.py``) at Qwen2.5's vocabulary (151,665 real of
    151,936 columns: several loop blocks per row and a partial last one), on ``logits[:, :-1]`` as
    ``next_token_logprobs`` passes it (rows not evenly strided), with a target on a padding column
    (log-prob -inf, as documented): values and gradient against float64."""
    from megatron_rlhf.training import logprobs_kernel

    g = torch.Generator().manual_seed(1)
    vocab_size, padded = 151_665, 151_936
    full = (4 * torch.randn(2, 6, padded, generator=g)).to("cuda", dtype).requires_grad_()
    logits = full[:, :-1]
    assert logprobs_kernel.available(logits) and not logits.is_contiguous()
    targets = torch.randint(0, vocab_size, (2, 5), generator=g).cuda()
    targets[1, 2] = vocab_size + 7
    w1, w2 = torch.randn(2, 5, generator=g).cuda(), torch.randn(2, 5, generator=g).cuda()
    w1[1, 2] = 0.0

    logp, entropy = token_logprobs_and_entropy(logits, targets, tp_group=None, vocab_size=vocab_size, temperature=0.8)
    assert logp[1, 2].item() == float("-inf")
    finite = torch.where(torch.isfinite(logp), logp, 0.0)
    ((w1 * finite).sum() + (w2 * entropy).sum()).backward()

    leaf = full.detach().double().requires_grad_()
    safe_targets = targets.clamp_max(vocab_size - 1)
    ref_logp, ref_entropy = _reference(leaf[:, :-1], safe_targets, vocab_size, 0.8)
    ((w1.double() * ref_logp).sum() + (w2.double() * ref_entropy).sum()).backward()

    real = torch.ones_like(targets, dtype=torch.bool)
    real[1, 2] = False
    assert (logp.double() - ref_logp)[real].abs().max().item() < 5e-5
    assert (entropy.double() - ref_entropy).abs().max().item() < 5e-5
    rtol = 1e-5 if dtype == torch.float32 else 8e-3
    assert (full.grad.double() - leaf.grad).abs().max().item() <= rtol * leaf.grad.abs().max().item()
    assert full.grad[..., vocab_size:].abs().max().item() == 0.0
    assert full.grad[:, -1].abs().max().item() == 0.0  # the position no target reads


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gradient_written_over_the_logits_equals_one_of_its_own(dtype: torch.dtype) -> None:
    """``overwrite_logits``, as the trainer's loss passes it for the LM head's logits: the hidden
    states and the head's weight get the same gradients, bit for bit, as when the logits' gradient
    is a tensor of its own; that gradient is the logits' memory; a backward that saved the logits
    too is refused, not fed gradients; a leaf's logits are left alone."""
    g = torch.Generator().manual_seed(2)
    vocab_size, padded, hidden_size, positions = 151_665, 151_936, 64, 24
    hidden0 = torch.randn(positions, hidden_size, generator=g).to("cuda", dtype)
    weight0 = (torch.randn(padded, hidden_size, generator=g) / 8).to("cuda", dtype)
    targets = torch.randint(0, vocab_size, (1, positions), generator=g).cuda()
    w1, w2 = torch.randn(1, positions, generator=g).cuda(), torch.randn(1, positions, generator=g).cuda()

    def gradients(overwrite: bool) -> tuple[torch.Tensor, torch.Tensor, bool]:
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        logits = (hidden @ weight.t())[:, None].transpose(0, 1)  # (1, k, Vp), as schedule._logits_at gives it
        seen: list[torch.Tensor] = []
        logits.register_hook(seen.append)
        logp, entropy = token_logprobs_and_entropy(
            logits, targets, tp_group=None, vocab_size=vocab_size, overwrite_logits=overwrite
        )
        ((w1 * logp).sum() + (w2 * entropy).sum()).backward()
        return hidden.grad, weight.grad, seen[0].data_ptr() == logits.data_ptr()

    hidden_grad, weight_grad, shared = gradients(overwrite=False)
    assert not shared
    hidden_over, weight_over, shared = gradients(overwrite=True)
    assert shared
    assert torch.equal(hidden_over, hidden_grad) and torch.equal(weight_over, weight_grad)

    hidden = hidden0.clone().requires_grad_()
    logits = (hidden @ weight0.t())[None]
    squares = logits.square().float().sum()  # saves the logits; its node runs after the log-probs' one
    logp, _ = token_logprobs_and_entropy(logits, targets, tp_group=None, vocab_size=vocab_size, overwrite_logits=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (logp.sum() + squares).backward()

    leaf = (hidden0 @ weight0.t())[None].requires_grad_()
    before = leaf.detach().clone()
    logp, _ = token_logprobs_and_entropy(leaf, targets, tp_group=None, vocab_size=vocab_size, overwrite_logits=True)
    logp.sum().backward()
    assert torch.equal(leaf.detach(), before) and leaf.grad.data_ptr() != leaf.data_ptr()
