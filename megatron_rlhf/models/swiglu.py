"""The training step's SwiGLU activation, forward and backward, as a Triton kernel that reads
its inputs once and writes once.

Why: megatron's compiled backward builds its output with a ``cat`` (``cat(d_gate, d_up)``), so
each output element gathers its own inputs, and the backward runs far below the memory rate
(``docs/benchmarks.md``, "Kernels"). Here one lane computes both halves of the gradient of one
(token, column) pair.

Arithmetic is float32, rounded once when stored, as megatron's compiled kernels do. On a CPU
(tests, CI) the autograd function runs the same formulas in torch, so that the CPU suite runs this
code path; the kernel itself is checked on a GPU against float64 (``tests/gpu``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl as megatron_bias_swiglu

try:
    import triton
    import triton.language as tl
except ImportError:  # torch without its Triton: the torch formulas
    triton = None

SWIGLU_BLOCK = 1024
"""Elements of the output (tokens x half-width, flattened) per SwiGLU program."""


def _on_gpu(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


def swiglu_reference(y: torch.Tensor) -> torch.Tensor:
    """silu(y1) * y2 for y = [y1, y2] along the last dimension (megatron's ``swiglu``)."""
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_backward_reference(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d/dy of ``swiglu_reference`` times ``grad``: [grad * y2 * silu'(y1), grad * silu(y1)].

    Each half is written in place into one output by torch's fused silu backward and one multiply:
    spelled out in elementwise ops with a ``cat`` (a temporary tensor per op), it took about as long
    on a CPU as one of the MLP's matmuls."""
    gate, up = y.chunk(2, dim=-1)
    dy = torch.empty_like(y)
    d_gate, d_up = dy.chunk(2, dim=-1)
    torch.ops.aten.silu_backward(grad * up, gate, grad_input=d_gate)
    torch.mul(grad, gate, out=d_up).mul_(torch.sigmoid(gate))
    return dy


class SwiGLU(torch.autograd.Function):
    """SwiGLU of y (tokens, 2f) -> (tokens, f), saving y for the backward (as megatron does)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y)
        if not _on_gpu(y):
            return swiglu_reference(y)
        y = y.contiguous()
        tokens, width = y.shape
        out = torch.empty(tokens, width // 2, dtype=y.dtype, device=y.device)
        _swiglu_kernel[(triton.cdiv(out.numel(), SWIGLU_BLOCK),)](
            y, out, None, out.numel(), HALF=width // 2, BACKWARD=False, BLOCK=SWIGLU_BLOCK
        )
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        if not _on_gpu(y):
            return swiglu_backward_reference(grad, y)
        y, grad = y.contiguous(), grad.contiguous()
        dy = torch.empty_like(y)
        _swiglu_kernel[(triton.cdiv(grad.numel(), SWIGLU_BLOCK),)](
            y, dy, grad, grad.numel(), HALF=y.shape[1] // 2, BACKWARD=True, BLOCK=SWIGLU_BLOCK
        )
        return dy


def swiglu_impl(
    input: torch.Tensor, bias: torch.Tensor | None, fp8_input_store: bool = False, cpu_offload_input: bool = False
) -> torch.Tensor:
    """megatron's ``bias_swiglu_impl`` (its signature and shapes: (s, b, 2f) or (t, 2f)); the cases
    this module does not cover (a bias, an FP8-stored input, offloaded activations) go to megatron's."""
    if bias is not None or fp8_input_store or cpu_offload_input:
        return megatron_bias_swiglu(input, bias, fp8_input_store, cpu_offload_input)
    out = SwiGLU.apply(input.reshape(-1, input.shape[-1]))
    return out.view(*input.shape[:-1], -1)


if triton is not None:

    @triton.jit
    def _swiglu_kernel(
        y_ptr: tl.tensor,
        out_ptr: tl.tensor,
        grad_ptr: tl.tensor,
        n: tl.tensor,
        HALF: tl.constexpr,
        BACKWARD: tl.constexpr,
        BLOCK: tl.constexpr,
    ) -> None:
        # One element of the (tokens, HALF) output per lane; HALF is a constant, so the division is cheap.
        index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = index < n
        row = index // HALF
        column = index - row * HALF
        gate_at = y_ptr + row * (2 * HALF) + column
        gate = tl.load(gate_at, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(gate_at + HALF, mask=inside, other=0.0).to(tl.float32)
        sigmoid = 1.0 / (1.0 + tl.exp(-gate))
        if BACKWARD:
            grad = tl.load(grad_ptr + index, mask=inside, other=0.0).to(tl.float32)
            d_gate = grad * up * sigmoid * (1.0 + gate * (1.0 - sigmoid))
            d_up = grad * gate * sigmoid
            out_at = out_ptr + row * (2 * HALF) + column
            tl.store(out_at, d_gate.to(out_ptr.dtype.element_ty), mask=inside)
            tl.store(out_at + HALF, d_up.to(out_ptr.dtype.element_ty), mask=inside)
        else:
            tl.store(out_ptr + index, (gate * sigmoid * up).to(out_ptr.dtype.element_ty), mask=inside)
