"""Kernel fusion on GPU with ``torch.compile``, eager everywhere else.

Elementwise chains (rotary, softmax with its mask, the vocabulary passes of the log-prob) are
written as plain torch code. On GPU each decorated function is compiled into fused Triton kernels
(usually one), which read their inputs once instead of once per op, so that a CUDA-graphed decode
step runs a few kernels per layer instead of dozens. On CPU (tests, CI) the same code runs
eagerly: the CPU tests check the function itself; the GPU tier checks the compiled one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def gpu_fused[F: Callable](fn: F) -> F:
    """``fn`` eagerly unless its first argument is a CUDA tensor; then ``torch.compile(fn)``,
    compiled on first use. Shapes follow torch's automatic dynamic: the first call compiles for
    its shapes, a later call recompiles once with the dimensions that changed made symbolic.
    Dimensions that never change (hidden size, head dim, vocabulary) stay constants, so the
    kernel's index arithmetic divides by constants: with every dimension symbolic, a pointwise
    kernel over (tokens, vocabulary) pays a 64-bit integer division per element."""
    compiled: list[Callable] = []

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not (args and isinstance(args[0], torch.Tensor) and args[0].is_cuda):
            return fn(*args, **kwargs)
        if not compiled:
            compiled.append(torch.compile(fn))
        return compiled[0](*args, **kwargs)

    return run  # type: ignore[return-value]
