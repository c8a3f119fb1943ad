"""Masked statistics shared by every algorithm in this package.

Shape legend: B = batch (sequences), T = response tokens.
``mask`` is (B, T), bool or 0/1; True marks a valid response token.

Masking uses ``torch.where`` rather than multiplication so that NaN/inf
values living on padded positions (e.g. -inf log-probs) never leak into a
statistic. Empty masks give 0, never NaN. All functions are local to the
tensors given: no collectives, no ``.item()``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "as_bool_mask",
    "explained_variance",
    "last_valid",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]


def as_bool_mask(mask: Tensor, like: Tensor | None = None) -> Tensor:
    """Return ``mask`` as bool, checking its shape against ``like`` when given."""
    if like is not None and mask.shape != like.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != tensor shape {tuple(like.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def last_valid(mask: Tensor) -> Tensor:
    """(B, T) bool: True at each row's last valid position, where an outcome reward goes (a
    multi-turn response's last policy token, whatever environment tokens follow it); none in an
    all-masked row."""
    m = as_bool_mask(mask)
    return m & (m.flip(-1).cumsum(-1).flip(-1) == 1)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over valid positions (all dims, or ``dim``)."""
    m = as_bool_mask(mask, x)
    zeros = torch.zeros((), dtype=x.dtype, device=x.device)
    picked = torch.where(m, x, zeros)
    return picked.sum() if dim is None else picked.sum(dim=dim)


def _count(mask: Tensor, dim: int | None, dtype: torch.dtype) -> Tensor:
    return (mask.sum() if dim is None else mask.sum(dim=dim)).to(dtype)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over valid positions; 0 where nothing is valid."""
    m = as_bool_mask(mask, x)
    n = _count(m, dim, x.dtype)
    return masked_sum(x, m, dim) / n.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Scalar variance over all valid positions (Bessel-corrected by default).

    Fewer than two valid elements give 0 rather than NaN.
    """
    m = as_bool_mask(mask, x)
    mean = masked_mean(x, m)
    n = _count(m, None, x.dtype)
    ss = masked_sum((x - mean) ** 2, m)
    denom = (n - 1) if unbiased else n
    return ss / denom.clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise ``x`` to unit variance (and zero mean) over valid positions.

    Statistics are global over the whole (B, T) tensor, as in PPO/REINFORCE++
    advantage whitening. Masked positions are returned as exactly 0.
    """
    m = as_bool_mask(mask, x)
    mean = masked_mean(x, m)
    var = masked_var(x, m)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device))


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var[returns - values] / Var[returns] over valid tokens (scalar).

    A critic diagnostic: 1 is perfect, 0 is no better than a constant, <0 is
    worse. Returns 0 when the returns have no variance (undefined ratio).
    """
    m = as_bool_mask(mask, values)
    var_r = masked_var(returns, m)
    var_err = masked_var(returns - values, m)
    safe = torch.where(var_r > 0, var_r, torch.ones_like(var_r))
    return torch.where(var_r > 0, 1.0 - var_err / safe, torch.zeros_like(var_r))
