"""Shape and memory-layout primitives."""

from __future__ import annotations

import torch

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import OpTags
from fulmen.core.unbacked import known_equal
from fulmen.core.utils import canonicalize_dim, check, prod
from fulmen.prims.base import PrimIDs, check_valid_shape, make_prim

_SHAPE = (OpTags.SHAPE_OP,)
#: shape prims whose torch implementation returns a view of the input where the strides allow (a reshape copies
#: where they do not)
_VIEW = (OpTags.SHAPE_OP, OpTags.VIEW)


def _broadcast_in_dim_meta(a, shape, broadcast_dimensions):
    check(isinstance(a, TensorProxy), lambda: f"broadcast_in_dim expects a tensor, got {type(a).__name__}", TypeError)
    check_valid_shape(shape, "prims.broadcast_in_dim")
    check(len(broadcast_dimensions) == a.ndim,
          lambda: f"broadcast_in_dim: {a.ndim} dims but broadcast_dimensions {tuple(broadcast_dimensions)}")
    last = -1
    for src, d in enumerate(broadcast_dimensions):
        check(last < d < len(shape), lambda: f"broadcast_in_dim: broadcast_dimensions {tuple(broadcast_dimensions)} "
              f"must be increasing and less than {len(shape)}")
        last = d
        check(known_equal(a.shape[src], 1) or a.shape[src] == shape[d],
              lambda: f"The size of tensor a ({a.shape[src]}) must match the size of tensor b ({shape[d]}) at "
              f"non-singleton dimension {d}")
    return TensorProxy(like=a, shape=tuple(shape))


def _torch_broadcast_in_dim(a, shape, broadcast_dimensions):
    view = [1] * len(shape)
    for src, d in enumerate(broadcast_dimensions):
        view[d] = a.shape[src]
    return a.reshape(view).expand(tuple(shape))


broadcast_in_dim = make_prim(PrimIDs.BROADCAST_IN_DIM, "broadcast_in_dim", meta=_broadcast_in_dim_meta,
                             torch_impl=_torch_broadcast_in_dim, tags=_VIEW,
                             doc="Broadcast a to shape; dim i of a becomes dim broadcast_dimensions[i].")


def _reshape_meta(a, shape):
    check_valid_shape(shape, "prims.reshape")
    check(prod(shape) == a.numel(), lambda: f"shape '{list(shape)}' is invalid for input of size {a.numel()}")
    return TensorProxy(like=a, shape=tuple(shape))


reshape = make_prim(PrimIDs.RESHAPE, "reshape", meta=_reshape_meta, torch_impl=lambda a, shape: a.reshape(shape),
                    tags=_VIEW, doc="Same elements in row-major order, new shape.")


def _transpose_meta(a, permutation):
    check(sorted(permutation) == list(range(a.ndim)),
          lambda: f"transpose: {tuple(permutation)} is not a permutation of the {a.ndim} dims")
    return TensorProxy(like=a, shape=tuple(a.shape[p] for p in permutation))


transpose = make_prim(PrimIDs.TRANSPOSE, "transpose", meta=_transpose_meta,
                      torch_impl=lambda a, permutation: a.permute(tuple(permutation)), tags=_VIEW,
                      doc="Permute dims: output dim i is input dim permutation[i].")


def _squeeze_meta(a, dims):
    for d in dims:
        check(0 <= d < a.ndim and a.shape[d] == 1, lambda: f"squeeze: dim {d} of shape {tuple(a.shape)} is not 1")
    return TensorProxy(like=a, shape=tuple(s for i, s in enumerate(a.shape) if i not in dims))


def _torch_squeeze(a, dims):
    return a.squeeze(tuple(dims)) if dims else a


squeeze = make_prim(PrimIDs.SQUEEZE, "squeeze", meta=_squeeze_meta, torch_impl=_torch_squeeze, tags=_VIEW,
                    doc="Remove the given length-1 dims.")


def _slice_meta(a, start_indices, end_indices, strides=None):
    strides = strides if strides is not None else [1] * a.ndim
    check(len(start_indices) == len(end_indices) == len(strides) == a.ndim,
          lambda: f"slice expects {a.ndim} starts, ends and strides")
    shape = []
    for s, e, st, length in zip(start_indices, end_indices, strides, a.shape):
        check(0 <= s <= e <= length and st >= 1,
              lambda: f"slice: invalid [{s}:{e}:{st}] for a dim of length {length}", IndexError)
        shape.append((e - s + st - 1) // st)
    return TensorProxy(like=a, shape=tuple(shape))


def _torch_slice(a, start_indices, end_indices, strides=None):
    strides = strides if strides is not None else [1] * a.ndim
    return a[tuple(slice(s, e, st) for s, e, st in zip(start_indices, end_indices, strides))]


slice_prim = make_prim(PrimIDs.SLICE, "slice_prim", meta=_slice_meta, torch_impl=_torch_slice, tags=_VIEW,
                       doc="a[start:end:stride] in every dim.")


def _pad_meta(a, padding_value, padding_config):
    check(len(padding_config) == a.ndim, lambda: f"pad expects {a.ndim} (lo, hi, interior) triples")
    shape = []
    for length, (lo, hi, interior) in zip(a.shape, padding_config):
        check(interior >= 0, lambda: "pad: interior padding must be non-negative")
        n = length + lo + hi + max(length - 1, 0) * interior
        check(n >= 0, lambda: f"pad: padding {(lo, hi)} makes a dim of length {length} negative", RuntimeError)
        shape.append(n)
    return TensorProxy(like=a, shape=tuple(shape))


def _torch_pad(a, padding_value, padding_config):
    if all(interior == 0 for _, _, interior in padding_config):
        flat = []
        for lo, hi, _ in reversed(padding_config):
            flat += [lo, hi]
        return torch.nn.functional.pad(a, flat, value=padding_value)
    shape = [length + max(length - 1, 0) * interior for length, (_, _, interior) in zip(a.shape, padding_config)]
    out = torch.full(shape, padding_value, dtype=a.dtype, device=a.device)
    out[tuple(slice(None, None, interior + 1) for _, _, interior in padding_config)] = a
    return _torch_pad(out, padding_value, [(lo, hi, 0) for lo, hi, _ in padding_config])


pad = make_prim(PrimIDs.PAD, "pad", meta=_pad_meta, torch_impl=_torch_pad, tags=_SHAPE,
                doc="Pad each dim with (low, high, interior) elements of padding_value; negative lo/hi crop.")


def _cat_meta(tensors, dim):
    check(len(tensors) > 0, lambda: "torch.cat(): expected a non-empty list of Tensors", RuntimeError)
    ref = tensors[0]
    dim = canonicalize_dim(ref.ndim, dim)
    total = 0
    for number, t in enumerate(tensors):
        check(t.ndim == ref.ndim, lambda: f"Tensors must have same number of dimensions: got {ref.ndim} and {t.ndim}")
        check(t.dtype == ref.dtype, lambda: f"prims.cat expects one dtype, got {ref.dtype} and {t.dtype}", TypeError)
        check(t.device == ref.device, lambda: f"prims.cat expects one device, got {ref.device} and {t.device}")
        for i, (x, y) in enumerate(zip(t.shape, ref.shape)):
            check(i == dim or x == y, lambda: f"Sizes of tensors must match except in dimension {dim}. Expected size "
                  f"{y} but got size {x} for tensor number {number} in the list.")
        total += t.shape[dim]
    shape = list(ref.shape)
    shape[dim] = total
    return TensorProxy(like=ref, shape=tuple(shape), requires_grad=any(t.requires_grad for t in tensors))


cat = make_prim(PrimIDs.CAT, "cat", meta=_cat_meta, torch_impl=lambda tensors, dim: torch.cat(tensors, dim),
                tags=_SHAPE, doc="Concatenate tensors of one dtype along dim.")


def _flip_meta(a, dims):
    for d in dims:
        check(0 <= d < max(a.ndim, 1), lambda: f"flip: dim {d} out of range for {a.ndim} dims", IndexError)
    return TensorProxy(like=a)


flip = make_prim(PrimIDs.FLIP, "flip", meta=_flip_meta, torch_impl=lambda a, dims: torch.flip(a, tuple(dims)),
                 tags=_SHAPE, doc="Reverse the order of elements along dims.")


def _unfold_meta(a, dim, size, step):
    dim = canonicalize_dim(a.ndim, dim)
    max_size = 1 if a.ndim == 0 else a.shape[dim]
    check(size <= max_size, lambda: f"Maximum size for tensor at dimension {dim} is {max_size} but size is {size}")
    check(size >= 0, lambda: f"Size is {size} but must be >= 0")
    check(step > 0, lambda: f"Step is {step} but must be > 0")
    shape = list(a.shape)
    shape.append(size)
    if a.ndim:
        shape[dim] = (shape[dim] - size) // step + 1
    return TensorProxy(like=a, shape=tuple(shape))


unfold = make_prim(PrimIDs.UNFOLD, "unfold", meta=_unfold_meta,
                   torch_impl=lambda a, dim, size, step: a.unfold(dim, size, step), tags=_SHAPE,
                   doc="Sliding windows of length size every step along dim, as a new last dim.")


def _stride_order_meta(a, order):
    check(sorted(order) == list(range(a.ndim)), lambda: f"stride_order: {tuple(order)} is not a permutation")
    return TensorProxy(like=a)


def _torch_stride_order(a, order):
    # order[i] is the rank of dim i's stride, 0 the smallest: (1, 0) for a row-major matrix.
    if list(order) == list(range(a.ndim - 1, -1, -1)):
        return a.contiguous()
    perm = sorted(range(a.ndim), key=lambda i: -order[i])
    inverse = [perm.index(i) for i in range(a.ndim)]
    return a.permute(perm).contiguous().permute(inverse)


stride_order = make_prim(PrimIDs.STRIDE_ORDER, "stride_order", meta=_stride_order_meta,
                         torch_impl=_torch_stride_order, tags=_SHAPE,
                         doc="Same values laid out densely in the given stride order (contiguous() is (n-1, ..., 0)).")
