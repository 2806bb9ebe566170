"""Reduction, scan, sort and top-k primitives. ``dims`` are canonical and sorted; reduced dims are removed."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fulmen.core import dtypes
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import OpTags
from fulmen.core.utils import canonicalize_dim, check
from fulmen.prims.base import PrimIDs, make_prim

_REDUCTION = (OpTags.REDUCTION,)


def _reduced_shape(a: TensorProxy, dims: Sequence[int]) -> tuple[int, ...]:
    for d in dims:
        check(0 <= d < max(a.ndim, 1), lambda: f"reduction dim {d} out of range for {a.ndim} dims", IndexError)
    return tuple(s for i, s in enumerate(a.shape) if i not in dims)


def _reduction_meta(op, *, output_dtype=None):
    def meta(a, dims, *, output_dtype=output_dtype):
        check(isinstance(a, TensorProxy), lambda: f"prims.{op} expects a tensor", TypeError)
        return TensorProxy(like=a, shape=_reduced_shape(a, dims), dtype=output_dtype or a.dtype)

    return meta


def _torch_reduce(fn, keeps_dtype: bool = False):
    def impl(a, dims, **kwargs):
        if not dims:  # torch reads an empty dim list as "all dims"; the prim reads it as "none"
            return a.clone()
        if keeps_dtype:  # torch.sum widens integers to int64; the prim keeps the input dtype
            kwargs["dtype"] = a.dtype
        return fn(a, dim=tuple(dims), **kwargs)

    return impl


def _torch_prod(a, dims):
    out = a
    for d in sorted(dims, reverse=True):
        out = torch.prod(out, d, dtype=a.dtype)
    return out if dims else a.clone()


sum = make_prim(PrimIDs.SUM, "sum", meta=_reduction_meta("sum"), torch_impl=_torch_reduce(torch.sum, True),
                tags=_REDUCTION, doc="Sum over dims (in the input's dtype; clang upcasts first).")
prod = make_prim(PrimIDs.PROD, "prod", meta=_reduction_meta("prod"), torch_impl=_torch_prod, tags=_REDUCTION,
                 doc="Product over dims.")
amax = make_prim(PrimIDs.AMAX, "amax", meta=_reduction_meta("amax"), torch_impl=_torch_reduce(torch.amax),
                 tags=_REDUCTION, doc="Maximum over dims, propagating NaN.")
amin = make_prim(PrimIDs.AMIN, "amin", meta=_reduction_meta("amin"), torch_impl=_torch_reduce(torch.amin),
                 tags=_REDUCTION, doc="Minimum over dims, propagating NaN.")


def _var_meta(a, dims, *, correction):
    check(dtypes.is_inexact_dtype(a.dtype), lambda: f"var expects a floating point tensor, got {a.dtype}", TypeError)
    return TensorProxy(like=a, shape=_reduced_shape(a, dims), dtype=dtypes.corresponding_real_dtype(a.dtype))


def _torch_var(a, dims, *, correction):
    return torch.var(a, dim=tuple(dims) if dims else None, correction=correction)


var = make_prim(PrimIDs.VAR, "var", meta=_var_meta, torch_impl=_torch_var, tags=_REDUCTION,
                doc="Variance over dims with Bessel-style correction (N - correction in the denominator).")


def _var_mean_meta(a, dims, *, correction):
    v = _var_meta(a, dims, correction=correction)
    return v, TensorProxy(like=v, dtype=a.dtype)


def _torch_var_mean(a, dims, *, correction):
    return torch.var_mean(a, dim=tuple(dims) if dims else None, correction=correction)


var_mean = make_prim(PrimIDs.VAR_MEAN, "var_mean", meta=_var_mean_meta, torch_impl=_torch_var_mean,
                     tags=_REDUCTION, doc="Variance and mean over dims in one pass.")


def _arg_reduction_meta(op):
    def meta(a, dim):
        if dim is None:
            return TensorProxy(like=a, shape=(), dtype=torch.int64, requires_grad=False)
        dim = canonicalize_dim(a.ndim, dim)
        if a.ndim:
            check(a.shape[dim] > 0, lambda: f"{op}(): Expected reduction dim {dim} to have non-zero size.",
                  IndexError)
        return TensorProxy(like=a, shape=_reduced_shape(a, (dim,) if a.ndim else ()), dtype=torch.int64,
                           requires_grad=False)

    return meta


argmax = make_prim(PrimIDs.ARGMAX, "argmax", meta=_arg_reduction_meta("argmax"),
                   torch_impl=lambda a, dim: torch.argmax(a, dim), tags=_REDUCTION,
                   doc="Index of the first maximum along dim (of the flattened input when dim is None).")
argmin = make_prim(PrimIDs.ARGMIN, "argmin", meta=_arg_reduction_meta("argmin"),
                   torch_impl=lambda a, dim: torch.argmin(a, dim), tags=_REDUCTION,
                   doc="Index of the first minimum along dim.")


def _scan_meta(a, dim):
    canonicalize_dim(a.ndim, dim)
    return TensorProxy(like=a)


cumsum = make_prim(PrimIDs.CUMSUM, "cumsum", meta=_scan_meta,
                   torch_impl=lambda a, dim: torch.cumsum(a, dim, dtype=a.dtype),
                   tags=(OpTags.REDUCTION,), doc="Running sum along dim.")
cumprod = make_prim(PrimIDs.CUMPROD, "cumprod", meta=_scan_meta,
                    torch_impl=lambda a, dim: torch.cumprod(a, dim, dtype=a.dtype),
                    tags=(OpTags.REDUCTION,), doc="Running product along dim.")


def _topk_meta(a, k, dim, largest, sorted):
    dim = canonicalize_dim(a.ndim, dim)
    length = a.shape[dim] if a.ndim else 1
    check(0 <= k <= length, lambda: "selected index k out of range", RuntimeError)
    shape = list(a.shape)
    if a.ndim:
        shape[dim] = k
    return TensorProxy(like=a, shape=tuple(shape)), TensorProxy(like=a, shape=tuple(shape), dtype=torch.int64,
                                                                 requires_grad=False)


def _torch_topk(a, k, dim, largest, sorted):
    values, indices = torch.topk(a, k, dim, largest, sorted)
    return values, indices


topk = make_prim(PrimIDs.TOPK, "topk", meta=_topk_meta, torch_impl=_torch_topk, tags=_REDUCTION,
                 doc="The k largest (or smallest) values along dim and their indices.")


def _sort_meta(a, dim, descending, stable):
    canonicalize_dim(a.ndim, dim)
    return TensorProxy(like=a), TensorProxy(like=a, dtype=torch.int64, requires_grad=False)


def _torch_sort(a, dim, descending, stable):
    values, indices = torch.sort(a, dim=dim, descending=descending, stable=stable)
    return values, indices


sort = make_prim(PrimIDs.SORT, "sort", meta=_sort_meta, torch_impl=_torch_sort, tags=_REDUCTION,
                 doc="Values sorted along dim and the permutation that sorts them.")
