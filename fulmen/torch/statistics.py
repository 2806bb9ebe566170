"""Torch language: ``torch.cov`` and ``torch.corrcoef``, as ATen computes them (``Correlation.cpp``).

Eager's ``cov`` reads the degrees of freedom with ``.item()`` (to warn when they are not positive), which made the
opaque op data-dependent. Unweighted, they are the known ``observations - correction``, so the decomposition
traces. With ``fweights``/``aweights`` eager also checks the weights' values (non-negative, non-zero sum): that
stays eager's op, run opaque.
"""

from __future__ import annotations

import warnings

import torch

from fulmen.core import dtypes
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import OpTags
from fulmen.core.utils import check
from fulmen.torch.elementwise import clamp, sqrt, sub, true_divide
from fulmen.torch.linalg import mm
from fulmen.torch.reductions import sum
from fulmen.torch.registry import torchsymbol
from fulmen.torch.shape import diagonal, reshape, squeeze, transpose, unsqueeze

__all__ = ["cov", "corrcoef"]


def _fallback(fn):
    from fulmen.core import langctx

    return langctx.fallback[0](fn)


def _check_input(input, op: str) -> None:
    check(isinstance(input, TensorProxy), lambda: f"{op}(): expected a tensor, got {type(input).__name__}", TypeError)
    check(input.ndim <= 2, lambda: f"{op}(): expected input to have two or fewer dimensions but got an input with "
          f"{input.ndim} dimensions", RuntimeError)
    check(input.dtype is not torch.bool, lambda: f"{op}(): bool dtype is not supported for input", RuntimeError)


@torchsymbol(torch.cov, torch.Tensor.cov, method_name="cov", tags=(OpTags.REDUCTION,))
def cov(input, *, correction: int = 1, fweights=None, aweights=None):
    """Covariance of the rows (variables) of ``input`` over its columns (observations)."""
    _check_input(input, "cov")
    if fweights is not None or aweights is not None or dtypes.is_complex_dtype(input.dtype):
        return _fallback(torch.cov)(input, correction=correction, fweights=fweights, aweights=aweights)
    x = input if input.ndim == 2 else reshape(input, (1, -1))
    observations = x.shape[1]
    avg = true_divide(sum(x, 1), observations)
    norm_factor = observations - correction
    if norm_factor <= 0:
        warnings.warn("cov(): degrees of freedom is <= 0. Correction should be strictly less than the number of "
                      "observations.", stacklevel=2)
        norm_factor = 0
    x = sub(x, unsqueeze(avg, 1))
    return squeeze(true_divide(mm(x, transpose(x, 0, 1)), norm_factor))


@torchsymbol(torch.corrcoef, torch.Tensor.corrcoef, method_name="corrcoef", tags=(OpTags.REDUCTION,))
def corrcoef(input):
    """Pearson correlation coefficients of the rows of ``input``, clipped to [-1, 1]."""
    _check_input(input, "corrcoef")
    if dtypes.is_complex_dtype(input.dtype):
        return _fallback(torch.corrcoef)(input)
    c = cov(input)
    if c.ndim == 0:  # one variable: nan for a covariance of nan, inf or 0, else 1
        return true_divide(c, c)
    stddev = sqrt(diagonal(c))
    c = true_divide(c, reshape(stddev, (-1, 1)))
    c = true_divide(c, reshape(stddev, (1, -1)))
    return clamp(c, -1, 1)
