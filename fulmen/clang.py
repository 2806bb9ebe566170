"""The core language: broadcasting and type promotion made explicit as prims.

Elementwise prims take tensors of one shape and dtype; the functions here compute torch's result dtype,
broadcast with ``prims.broadcast_in_dim`` and convert with ``prims.convert_element_type``, so both show in
traces. The torch language builds on these.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum, auto

import torch

from fulmen import prims
from fulmen.core import dtypes
from fulmen.core.devices import to_device
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbolic import INT_TYPES, NUMBER_TYPES, SYMBOLIC_NUMBERS
from fulmen.core.unbacked import known_equal, same_shape
from fulmen.core.utils import canonicalize_dim, check, prod


class TypePromotion(Enum):
    DEFAULT = auto()  # compute in the promoted dtype (float32 for float16/bfloat16), return the promoted dtype
    NO_OPMATH = auto()  # compute and return the promoted dtype
    INT_TO_FLOAT = auto()  # integers and bools become the default float dtype (sin, true division)
    ALWAYS_BOOL = auto()  # comparisons
    COMPLEX_TO_FLOAT = auto()  # abs
    BOOL_TO_LONG = auto()  # sum of bools


def _category(d: torch.dtype) -> int:
    if d is torch.bool:
        return 0
    if dtypes.is_integer_dtype(d):
        return 1
    if dtypes.is_float_dtype(d):
        return 2
    return 3


def _combine(higher: torch.dtype | None, lower: torch.dtype | None) -> torch.dtype | None:
    """torch's ``combine_categories``: a lower-priority group only matters when it is of a higher category."""
    if higher is None:
        return lower
    if lower is None:
        return higher
    if _category(higher) == 3:
        return higher
    if _category(lower) == 3:
        return dtypes.corresponding_complex_dtype(higher) if _category(higher) == 2 else lower
    if _category(higher) == 2:
        return higher
    if higher is torch.bool or _category(lower) == 2:
        return torch.promote_types(higher, lower)
    return higher


def result_dtype(*args) -> torch.dtype:
    """The dtype torch gives ``op(*args)``: dimensioned tensors > 0-d tensors > Python scalars, by category."""
    dim = zero = wrapped = None
    for a in args:
        if isinstance(a, TensorProxy):
            if a.ndim > 0:
                dim = a.dtype if dim is None else torch.promote_types(dim, a.dtype)
            else:
                zero = a.dtype if zero is None else torch.promote_types(zero, a.dtype)
        elif isinstance(a, NUMBER_TYPES):
            d = dtypes.python_type_dtype(a)
            wrapped = d if wrapped is None else torch.promote_types(wrapped, d)
        elif a is not None:
            raise TypeError(f"Expected a tensor or a number, but got {type(a).__name__} ({a!r})")
    out = _combine(dim, _combine(zero, wrapped))
    check(out is not None, lambda: "type promotion needs at least one tensor or number", TypeError)
    return out


def elementwise_type_promotion(*args, kind: TypePromotion = TypePromotion.DEFAULT):
    """(computation dtype, result dtype) for an elementwise op, as torch computes them."""
    dtype = result_dtype(*args)
    if kind is TypePromotion.ALWAYS_BOOL:
        return dtype, torch.bool
    if kind is TypePromotion.INT_TO_FLOAT and dtypes.is_exact_dtype(dtype):
        dtype = torch.get_default_dtype()
    if kind is TypePromotion.BOOL_TO_LONG and dtype is torch.bool:
        return torch.int64, torch.int64
    result = dtype
    if kind is TypePromotion.COMPLEX_TO_FLOAT:
        result = dtypes.corresponding_real_dtype(dtype)
    computation = torch.float32 if kind is not TypePromotion.NO_OPMATH and dtype in (torch.float16,
                                                                                       torch.bfloat16) else dtype
    return computation, result


def maybe_convert_to_dtype(a, dtype: torch.dtype):
    """Convert a tensor with a prim (no-op when it already has ``dtype``); Python numbers become that kind."""
    if isinstance(a, TensorProxy):
        return a if a.dtype == dtype else prims.convert_element_type(a, dtype)
    if isinstance(a, SYMBOLIC_NUMBERS):  # int() or float() would specialize a symbolic size to its value
        if dtypes.is_float_dtype(dtype):
            return torch.sym_float(a)
        if dtypes.is_integer_dtype(dtype) and isinstance(a, torch.SymInt):
            return a
    if isinstance(a, NUMBER_TYPES):
        if dtype is torch.bool:
            return bool(a)
        if dtypes.is_integer_dtype(dtype):
            return int(a) if not isinstance(a, bool) else int(a)
        if dtypes.is_float_dtype(dtype):
            return float(a) if not isinstance(a, complex) else a
        return complex(a)
    return a


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...]:
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for s in shapes:
        for i, length in enumerate(s):
            j = ndim - len(s) + i
            if known_equal(out[j], 1):  # a data-dependent size is taken as not 1, as PyTorch's broadcasting does
                out[j] = length
            else:
                check(known_equal(length, 1) or length == out[j],
                      lambda: f"The size of tensor a ({out[j]}) must match the size of tensor b ({length}) at "
                      f"non-singleton dimension {j}")
    return tuple(out)


def expand_to(a: TensorProxy, shape: Sequence[int]) -> TensorProxy:
    if len(a.shape) == len(shape) and same_shape(a.shape, shape):  # rank first: no guard on sizes
        return a
    offset = len(shape) - a.ndim
    return prims.broadcast_in_dim(a, list(shape), tuple(range(offset, len(shape))))


def maybe_broadcast(*args):
    """Broadcast the tensors among ``args`` to one shape; numbers and None pass through."""
    shapes = [a.shape for a in args if isinstance(a, TensorProxy)]
    if not shapes:
        return args
    shape = broadcast_shapes(*shapes)
    return tuple(expand_to(a, shape) if isinstance(a, TensorProxy) else a for a in args)


def _as_tensor_device(args):
    for a in args:
        if isinstance(a, TensorProxy) and a.ndim > 0:
            return a.device
    for a in args:
        if isinstance(a, TensorProxy):
            return a.device
    return None


def _cpu_scalars_to_device(args):
    """A 0-d CPU tensor may meet tensors on another device (torch allows it); move it there."""
    device = _as_tensor_device(args)
    return tuple(prims.device_put(a, device) if isinstance(a, TensorProxy) and a.ndim == 0 and a.device != device
                 and a.device.type == "cpu" else a for a in args)


def elementwise_unary(a, prim, kind: TypePromotion = TypePromotion.DEFAULT):
    check(isinstance(a, TensorProxy), lambda: f"{prim.name} expects a tensor, but got {type(a).__name__}", TypeError)
    computation, result = elementwise_type_promotion(a, kind=kind)
    out = prim(maybe_convert_to_dtype(a, computation))
    return maybe_convert_to_dtype(out, result)


def elementwise_binary(a, b, prim, kind: TypePromotion = TypePromotion.DEFAULT):
    if not isinstance(a, TensorProxy) and not isinstance(b, TensorProxy):
        raise TypeError(f"{prim.name} expects at least one tensor, but got {type(a).__name__} and "
                        f"{type(b).__name__}")
    computation, result = elementwise_type_promotion(a, b, kind=kind)
    a, b = _cpu_scalars_to_device((a, b))
    a, b = maybe_broadcast(a, b)
    a, b = maybe_convert_to_dtype(a, computation), maybe_convert_to_dtype(b, computation)
    out = prim(a, b)
    return maybe_convert_to_dtype(out, result)


# ---- elementwise ----

def add(a, b):
    return elementwise_binary(a, b, prims.add)


def sub(a, b):
    return elementwise_binary(a, b, prims.sub)


def mul(a, b):
    return elementwise_binary(a, b, prims.mul)


def true_divide(a, b):
    return elementwise_binary(a, b, prims.div, TypePromotion.INT_TO_FLOAT)


def eq(a, b):
    return elementwise_binary(a, b, prims.eq, TypePromotion.ALWAYS_BOOL)


def where(pred, a, b):
    """Select with torch's promotion of ``a`` and ``b``; the condition is broadcast with them."""
    check(isinstance(pred, TensorProxy), lambda: f"where expects a tensor condition, got {type(pred).__name__}",
          TypeError)
    if pred.dtype is not torch.bool:
        pred = prims.ne(pred, maybe_convert_to_dtype(0, pred.dtype))
    _, result = elementwise_type_promotion(a, b, kind=TypePromotion.NO_OPMATH)
    pred, a, b = _cpu_scalars_to_device((pred, a, b))
    pred, a, b = maybe_broadcast(pred, a, b)
    a, b = maybe_convert_to_dtype(a, result), maybe_convert_to_dtype(b, result)
    if not isinstance(a, TensorProxy) and not isinstance(b, TensorProxy):
        a = full(pred.shape, a, device=pred.device, dtype=result)
    return prims.where(pred, a, b)


# ---- creation ----

def full(shape, fill_value, *, device, dtype):
    return prims.full(tuple(shape), fill_value, device=to_device(device), dtype=dtype)


def full_like(a: TensorProxy, fill_value, *, device=None, dtype=None):
    return full(a.shape, fill_value, device=device or a.device, dtype=dtype or a.dtype)


def zeros_like(a: TensorProxy):
    return full(a.shape, 0, device=a.device, dtype=a.dtype)


# ---- shape ----

def reshape(a: TensorProxy, shape: Sequence[int]) -> TensorProxy:
    shape = tuple(shape)
    if same_shape(a.shape, shape):
        return a
    return prims.reshape(a, shape)


def infer_shape(shape: Sequence[int], numel: int) -> tuple[int, ...]:
    """Resolve one ``-1`` entry as ``view``/``reshape`` do, with torch's error for invalid shapes."""
    shape = list(shape)
    neg = [i for i, s in enumerate(shape) if s == -1]
    check(len(neg) <= 1, lambda: "only one dimension can be inferred", RuntimeError)
    for s in shape:
        check(isinstance(s, INT_TYPES) and s >= -1, lambda: f"invalid shape dimension {s}", RuntimeError)
    if neg:
        known = prod(s for s in shape if s != -1)
        check(known != 0 and numel % known == 0, lambda: f"shape '{shape}' is invalid for input of size {numel}")
        shape[neg[0]] = numel // known
    check(prod(shape) == numel, lambda: f"shape '{shape}' is invalid for input of size {numel}")
    return tuple(shape)


def permute(a: TensorProxy, dims: Sequence[int]) -> TensorProxy:
    dims = tuple(canonicalize_dim(a.ndim, d) for d in dims)
    check(len(dims) == a.ndim, lambda: f"permute(sparse_coo): number of dimensions in the tensor input does not "
          f"match the length of the desired ordering of dimensions i.e. input.dim() = {a.ndim} is not equal to "
          f"len(dims) = {len(dims)}")
    check(len(set(dims)) == len(dims), lambda: "permute(): duplicate dims are not allowed.")
    if dims == tuple(range(a.ndim)):
        return a
    return prims.transpose(a, dims)


def transpose(a: TensorProxy, dim0: int, dim1: int) -> TensorProxy:
    if a.ndim == 0:
        canonicalize_dim(0, dim0)
        canonicalize_dim(0, dim1)
        return a
    d0, d1 = canonicalize_dim(a.ndim, dim0), canonicalize_dim(a.ndim, dim1)
    perm = list(range(a.ndim))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return permute(a, perm)


def unsqueeze(a: TensorProxy, dim: int) -> TensorProxy:
    dim = canonicalize_dim(a.ndim + 1, dim)
    shape = list(a.shape)
    shape.insert(dim, 1)
    dims = [i for i in range(a.ndim + 1) if i != dim]
    return prims.broadcast_in_dim(a, shape, tuple(dims))


def squeeze(a: TensorProxy, dims: Sequence[int] | None = None) -> TensorProxy:
    if dims is None:
        dims = tuple(i for i, s in enumerate(a.shape) if s == 1)
    else:
        dims = tuple(d for d in (canonicalize_dim(a.ndim, d) for d in dims) if a.ndim and a.shape[d] == 1)
    return prims.squeeze(a, tuple(sorted(set(dims)))) if dims else a


def slice_in_dim(a: TensorProxy, start: int, stop: int, step: int = 1, dim: int = 0) -> TensorProxy:
    dim = canonicalize_dim(a.ndim, dim)
    starts, stops, steps = [0] * a.ndim, list(a.shape), [1] * a.ndim
    starts[dim], stops[dim], steps[dim] = start, stop, step
    if start == 0 and known_equal(stop, a.shape[dim]) and step == 1:
        return a
    return prims.slice_prim(a, starts, stops, steps)


def cat(tensors: Sequence[TensorProxy], dim: int) -> TensorProxy:
    check(len(tensors) > 0, lambda: "torch.cat(): expected a non-empty list of Tensors", RuntimeError)
    # torch.cat skips 1-D empty tensors (legacy behavior) and promotes dtypes
    nonempty = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)] or [tensors[0]]
    dtype = result_dtype(*nonempty)
    nonempty = [maybe_convert_to_dtype(t, dtype) for t in nonempty]
    if len(nonempty) == 1:
        return nonempty[0]
    return prims.cat(list(nonempty), dim)


def stack(tensors: Sequence[TensorProxy], dim: int) -> TensorProxy:
    check(len(tensors) > 0, lambda: "stack expects a non-empty TensorList", RuntimeError)
    for i, t in enumerate(tensors):
        check(t.shape == tensors[0].shape, lambda: f"stack expects each tensor to be equal size, but got "
              f"{list(tensors[0].shape)} at entry 0 and {list(t.shape)} at entry {i}")
    dim = canonicalize_dim(tensors[0].ndim + 1, dim)
    return cat([unsqueeze(t, dim) for t in tensors], dim)


def matrix_transpose(a: TensorProxy) -> TensorProxy:
    check(a.ndim >= 2,
          lambda: f"tensor.mT is only supported on matrices or batches of matrices. Got {a.ndim}-D tensor.")
    return transpose(a, -2, -1)
