"""megatron-core's training fusions, with kernels of our own where apex and TE are absent.

megatron-core looks both kernels up once, at import, from optional packages, and a config flag
turns each on:
* ``apply_rope_fusion``: rotary embedding through ``rope_utils.fused_apply_rotary_pos_emb`` (TE's).
  The unfused formula is about a dozen elementwise kernels per query and key per layer, forward and
  backward. Here: megatron's own unfused formula compiled (``gpu_fused``), one kernel each way,
  rounded once, with the cos and sin of the angle table computed once per forward pass
  (``_AngleTables``) rather than per element of every query and key.
* ``gradient_accumulation_fusion``: the weight gradient of every parallel linear accumulated into
  its float32 ``main_grad`` inside the GEMM (apex's ``fused_weight_gradient_mlp_cuda``). Unfused,
  each linear writes a bf16 gradient, then a separate kernel adds it to ``main_grad``. Here: one
  cuBLAS GEMM with a float32 output and beta = 1 (``torch.addmm(..., out_dtype=float32)``).

And one that megatron has but compiles poorly: the MLP's SwiGLU (``bias_activation_fusion``),
whose compiled backward builds its output with a ``cat``; here a Triton kernel each way
(``models/swiglu.py``).

The optimizer's multi-tensor kernels (apex's or TE's ``multi_tensor_l2norm`` and
``multi_tensor_scale``) fall back in megatron to a loop per tensor; its gradient norm reads every
parameter's norm to the host, a device sync each (about 200 per step for a 1.5B model). Here:
torch's foreach kernels, with no sync.

``install()`` fills in each and the builder turns the flags on, in CPU mode too: there the rotary
and SwiGLU formulas run eagerly and the weight gradient is a float32 ``addmm_``, so the CPU tests
run the code path a GPU runs.
"""

from __future__ import annotations

import types

import torch
from megatron.core import utils as mcore_utils
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer import optimizer as mcore_optimizer
from megatron.core.tensor_parallel import layers
from megatron.core.transformer import mlp

from megatron_rlhf.fusion import gpu_fused
from megatron_rlhf.models.swiglu import swiglu_impl


def rotary_bshd(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """megatron's unfused rotary embedding (``_apply_rotary_pos_emb_bshd``, mscale 1) with the
    signature of TE's ``fused_apply_rotary_pos_emb`` that megatron calls: ``t * cos + rotate_half(t)
    * sin``, cos and sin rounded to ``t``'s dtype first as megatron rounds them; compiled on GPU."""
    cos, sin = _ANGLE_TABLES.of(freqs, t.dtype)
    return _rotate(t, cos, sin, interleaved)


@gpu_fused
def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    rotated, passed = t[..., : cos.shape[-1]], t[..., cos.shape[-1] :]
    return torch.cat((rotated * cos + rope_utils._rotate_half(rotated, interleaved) * sin, passed), dim=-1)


class _AngleTables:
    """cos and sin of the last angle table asked for, per dtype.

    Why: megatron hands every layer of a forward pass the same angle table (``freqs``, one tensor
    for the query and the key), and its formula takes cos and sin of it inside each call. Compiled,
    that is two float32 trigonometric functions per element of every query and key head, forward
    and again backward, where the kernel otherwise only streams its bytes. Keyed on the table's
    identity: the reference held here keeps its memory from being reused by another tensor."""

    def __init__(self) -> None:
        self.freqs: torch.Tensor | None = None
        self.tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def of(self, freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if freqs is not self.freqs:
            self.freqs, self.tables = freqs, {}
        if dtype not in self.tables:
            self.tables[dtype] = (torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype))
        return self.tables[dtype]


_ANGLE_TABLES = _AngleTables()


def _wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad (out, in) float32 += grad_output (tokens, out)^T @ total_input (tokens, in), the
    half-precision product accumulated in float32 by the GEMM itself."""
    if main_grad.is_cuda and total_input.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)
    else:  # float32 inputs, or CPU (no dtype-out GEMM there): a float32 GEMM of upcast inputs
        main_grad.addmm_(grad_output.t().float(), total_input.float())


def _wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    main_grad.addmm_(grad_output.t(), total_input)


TORCH_WGRAD_ACCUMULATION = types.SimpleNamespace(
    wgrad_gemm_accum_fp32=_wgrad_gemm_accum_fp32, wgrad_gemm_accum_fp16=_wgrad_gemm_accum_fp16
)


def _foreach_l2_norm(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], per_tensor: bool, *args: object
) -> tuple[torch.Tensor, None]:
    """``multi_tensor_l2norm`` as megatron calls it: the L2 norm of all of ``tensor_lists[0]``
    together, (1,) float32 on their device."""
    norms = torch._foreach_norm(tensor_lists[0], 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def _foreach_scale(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], scale: float
) -> None:
    """``multi_tensor_scale``: tensor_lists[1][i] = tensor_lists[0][i] * scale (in place when the
    lists are one; a copy, with the dtype cast, when scale is 1)."""
    sources, targets = tensor_lists
    if sources is targets:
        torch._foreach_mul_(targets, scale)
    else:
        torch._foreach_copy_(targets, sources if scale == 1.0 else torch._foreach_mul(sources, scale))


def install() -> None:
    """Make the fusions available to megatron, keeping apex's and TE's where installed."""
    if clip_grads.l2_norm_impl is mcore_utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _foreach_l2_norm
    for module in (clip_grads, mcore_optimizer):
        if module.multi_tensor_scale_impl is mcore_utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = _foreach_scale
    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = rotary_bshd
    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = TORCH_WGRAD_ACCUMULATION
        layers._grad_accum_fusion_available = True
    mlp.bias_swiglu_impl = swiglu_impl
