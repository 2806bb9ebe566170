"""Gather and scatter primitives (indices are int64/int32 tensors)."""

from __future__ import annotations

import torch

from fulmen.core import dtypes
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import OpTags
from fulmen.core.utils import canonicalize_dim, check
from fulmen.prims.base import PrimIDs, make_prim

#: Every prim here raises for an index out of bounds, which depends on the index's values: an unused result still
#: decides whether the program raises (eager raises ``IndexError`` for ``x[i]`` even when nothing reads it).
_CHECKS = (OpTags.CHECKS_VALUES,)


def _check_index(index, op):
    check(isinstance(index, TensorProxy) and dtypes.is_integer_dtype(index.dtype) and index.dtype is not torch.bool,
          lambda: f"{op}(): Expected dtype int32/int64 for index, but got {getattr(index, 'dtype', type(index))}",
          RuntimeError)


def _take_meta(a, index, dim):
    _check_index(index, "index_select")
    check(index.ndim <= 1, lambda: "index_select(): Index is supposed to be a vector", IndexError)
    dim = canonicalize_dim(a.ndim, dim)
    shape = list(a.shape)
    if a.ndim:
        shape[dim] = index.numel()
    return TensorProxy(like=a, shape=tuple(shape))


take = make_prim(PrimIDs.TAKE, "take", tags=_CHECKS, meta=_take_meta,
                 torch_impl=lambda a, index, dim: torch.index_select(a, dim, index),
                 doc="Select entries of a along dim by a 1-D index (torch.index_select).")


def _take_along_axis_meta(a, index, dim):
    _check_index(index, "gather")
    dim = canonicalize_dim(a.ndim, dim)
    check(index.ndim == a.ndim or (a.ndim == 0 and index.ndim <= 1),
          lambda: "Index tensor must have the same number of dimensions as input tensor", RuntimeError)
    for d in range(index.ndim):
        check(d == dim or index.shape[d] <= a.shape[d], lambda: f"Size does not match at dimension {d} expected "
              f"index {tuple(index.shape)} to be smaller than self {tuple(a.shape)} apart from dimension {dim}")
    return TensorProxy(like=a, shape=index.shape)


take_along_axis = make_prim(PrimIDs.TAKE_ALONG_AXIS, "take_along_axis", tags=_CHECKS, meta=_take_along_axis_meta,
                            torch_impl=lambda a, index, dim: torch.gather(a, dim, index),
                            doc="out[i][j] = a[index[i][j]][j] for dim 0 (torch.gather).")


def _scatter_like_meta(op):
    def meta(a, dim, index, src):
        _check_index(index, op)
        dim = canonicalize_dim(a.ndim, dim)
        check(index.ndim == a.ndim or a.ndim == 0,
              lambda: "Index tensor must have the same number of dimensions as self tensor", RuntimeError)
        if isinstance(src, TensorProxy):
            check(src.dtype == a.dtype, lambda: f"{op}(): Expected self.dtype to be equal to src.dtype", RuntimeError)
        return TensorProxy(like=a, requires_grad=a.requires_grad or getattr(src, "requires_grad", False))

    return meta


def _torch_scatter(a, dim, index, src):
    return torch.scatter(a, dim, index, src)


scatter = make_prim(PrimIDs.SCATTER, "scatter", tags=_CHECKS, meta=_scatter_like_meta("scatter"),
                    torch_impl=_torch_scatter,
                    doc="Copy of a with a[index[i][j]][j] = src[i][j] for dim 0.")
scatter_add = make_prim(PrimIDs.SCATTER_ADD, "scatter_add", tags=_CHECKS, meta=_scatter_like_meta("scatter_add"),
                        torch_impl=lambda a, dim, index, src: torch.scatter_add(a, dim, index, src),
                        doc="Copy of a with src[i][j] added at a[index[i][j]][j] for dim 0.")


def _index_add_meta(a, dim, index, source):
    _check_index(index, "index_add")
    dim = canonicalize_dim(a.ndim, dim)
    check(source.dtype == a.dtype, lambda: f"index_add_(): self ({a.dtype}) and source ({source.dtype}) must have "
          "the same scalar type", RuntimeError)
    return TensorProxy(like=a, requires_grad=a.requires_grad or source.requires_grad)


index_add = make_prim(PrimIDs.INDEX_ADD, "index_add", tags=_CHECKS, meta=_index_add_meta,
                      torch_impl=lambda a, dim, index, source: torch.index_add(a, dim, index, source),
                      doc="Copy of a with the rows of source added at index along dim.")


def _index_put_meta(a, indices, values, accumulate):
    check(isinstance(indices, (tuple, list)), lambda: "index_put expects a sequence of index tensors", TypeError)
    check(len(indices) <= a.ndim, lambda: f"too many indices for tensor of dimension {a.ndim}", IndexError)
    for i in indices:
        check(isinstance(i, TensorProxy) and (dtypes.is_integer_dtype(i.dtype)),
              lambda: "tensors used as indices must be long, int, byte or bool tensors", IndexError)
    check(values.dtype == a.dtype, lambda: f"Index put requires the source and destination dtypes match, got "
          f"{a.dtype} for the destination and {values.dtype} for the source.", RuntimeError)
    return TensorProxy(like=a, requires_grad=a.requires_grad or values.requires_grad)


index_put = make_prim(PrimIDs.INDEX_PUT, "index_put", tags=_CHECKS, meta=_index_put_meta,
                      torch_impl=lambda a, indices, values, accumulate: torch.index_put(a, tuple(indices), values,
                                                                                        accumulate),
                      doc="Copy of a with a[indices] = values (or += with accumulate).")
