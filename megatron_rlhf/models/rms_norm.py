"""The transformer layers' RMSNorm where megatron would build torch's (no apex, no TE): torch's
forward, and a backward of one Triton kernel on a GPU.

torch's RMSNorm backward runs two kernels per call, the input's gradient and the weight's (a
column reduction over every token): 43 + 58 us per call at 16,128 tokens x 1,536 on an H200, for
a read of x and dy and a write of dx that takes about 36 us (``docs/benchmarks.md``, thirteenth
session). Here one program per block of rows recomputes each row's 1 / rms from x, writes the
rows' dx and one float32 partial sum of the weight's gradient; the partials are summed after.

With y = x r w, r = (mean(x^2) + eps)^(-1/2), per row:
    dL/dx = r (w dy) - x r^3 mean(x w dy),    dL/dw = sum over rows of x r dy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

try:
    import triton
    import triton.language as tl
except ImportError:  # torch without its Triton: torch's backward
    triton = None

ROWS_PER_PROGRAM = 16


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built as megatron's ``WrappedTorchNorm`` builds it (the same constructor,
    parameters and forward), whose backward runs ``_backward_kernel`` on a GPU."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm") -> None:  # fmt: skip
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma or config.sequence_parallel:
            raise ValueError("RMSNorm stands in for torch's RMSNorm only (no zero-centred gamma, no sequence parallelism)")
        super().__init__(normalized_shape=hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton is None or not x.is_cuda or not x.is_contiguous() or not torch.is_grad_enabled():
            return super().forward(x)
        return _RMSNormFunction.apply(x, self.weight, self.eps)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return F.rms_norm(x, weight.shape, weight, eps)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        width = x.shape[-1]
        rows = x.numel() // width
        grad_out = grad_out.contiguous()
        grad_x = torch.empty_like(x)
        programs = triton.cdiv(rows, ROWS_PER_PROGRAM)
        partial = torch.empty(programs, width, dtype=torch.float32, device=x.device)
        _backward_kernel[(programs,)](x, weight, grad_out, grad_x, partial, rows, width, ctx.eps,
                                      ROWS=ROWS_PER_PROGRAM, BLOCK=triton.next_power_of_2(width), num_warps=8)  # fmt: skip
        return grad_x, partial.sum(0).to(weight.dtype), None


if triton is not None:

    @triton.jit
    def _backward_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, partial_ptr, rows, width, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        program = tl.program_id(0)
        columns = tl.arange(0, BLOCK)
        inside = columns < width
        w = tl.load(w_ptr + columns, mask=inside, other=0.0).to(tl.float32)
        grad_w = tl.zeros((BLOCK,), tl.float32)
        for i in range(ROWS):
            row = program * ROWS + i
            if row < rows:
                at = row.to(tl.int64) * width + columns
                x = tl.load(x_ptr + at, mask=inside, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + at, mask=inside, other=0.0).to(tl.float32)
                r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / width + eps)
                w_dy = w * dy
                dx = r * w_dy - x * (r * r * r) * (tl.sum(x * w_dy, 0) / width)
                tl.store(dx_ptr + at, dx.to(dx_ptr.dtype.element_ty), mask=inside)
                grad_w += x * r * dy
        tl.store(partial_ptr + program.to(tl.int64) * width + columns, grad_w, mask=inside)
