"""Torch language: reductions, scans, sorting, softmax and vector norms.

Reduction prims take canonical sorted dims and remove them; ``keepdim`` is put back here with
``prims.broadcast_in_dim``. Prims do not upcast, so float16/bfloat16 inputs are converted to float32,
reduced, and converted back, the way PyTorch's CPU kernels accumulate. Integer and bool sums, products
and scans accumulate in int64 (wrap-around in a narrower result dtype is the same modulo arithmetic).

Ops with several torch forms (``torch.max(a)``, ``torch.max(a, dim)``, ``torch.max(a, b)``) are one
symbol taking every form, so the torch executor can replay the recorded call exactly. Forms that return
``(values, indices)`` return the same ``torch.return_types`` tuple torch does, so ``.values`` works.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from numbers import Number

import torch

from fulmen import clang, prims
from fulmen.clang import maybe_convert_to_dtype
from fulmen.core import dtypes, langctx
from fulmen.core.dtypes import scalar_type_name
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import OpTags
from fulmen.core.utils import canonicalize_dim, check
from fulmen.torch.elementwise import (
    eq,
    ge,
    isnan,
    le,
    logical_and,
    logical_xor,
    maximum,
    minimum,
    mul,
    sub,
    true_divide,
    where,
)
from fulmen.torch.registry import register_function, torchsymbol
from fulmen.torch.shape import cat, clone

__all__ = [
    "sum", "nansum", "mean", "prod", "amax", "amin", "aminmax", "max", "min", "var", "std", "var_mean", "std_mean",
    "logsumexp", "softmax", "log_softmax", "cumsum", "cumprod", "diff", "argmax", "argmin", "topk", "sort",
    "argsort", "all", "any", "count_nonzero", "histc", "vector_norm", "norm",
]

_RED = (OpTags.REDUCTION,)

#: The names torch's error messages use for dtypes ("Got: Long").
# ---- helpers shared by the reductions ----

def _check_tensor(a, op: str) -> None:
    check(isinstance(a, TensorProxy), lambda: f"{op}(): expected a tensor as input, but got {type(a).__name__}",
          TypeError)


def _check_int_dim(d, op: str) -> None:
    check(isinstance(d, int) and not isinstance(d, bool),
          lambda: f"{op}(): argument 'dim' must be int or a tuple of ints, but got {type(d).__name__} ({d!r})",
          TypeError)


def _reduction_dims(a: TensorProxy, dim, op: str, *, empty_means_all: bool = True) -> tuple[int, ...]:
    """Canonical, sorted dims to reduce. ``None`` (and, for most ops, ``()``) means every dim.

    A 0-d tensor accepts dim 0 / -1 as torch does; reducing it reduces nothing, so the result is ``()``.
    """
    if dim is None or (empty_means_all and isinstance(dim, (tuple, list)) and len(dim) == 0):
        return tuple(range(a.ndim))
    given = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
    seen: set[int] = set()
    for d in given:
        _check_int_dim(d, op)
        c = canonicalize_dim(a.ndim, d)
        check(c not in seen, lambda: f"dim {c} appears multiple times in the list of dims", RuntimeError)
        seen.add(c)
    return () if a.ndim == 0 else tuple(sorted(seen))


def _keep_dims(out: TensorProxy, shape: Sequence[int], dims: Sequence[int]) -> TensorProxy:
    """Put the reduced dims back as length-1 dims (``keepdim=True``)."""
    if not dims:
        return out
    kept = [1 if i in dims else s for i, s in enumerate(shape)]
    return prims.broadcast_in_dim(out, kept, [i for i in range(len(shape)) if i not in dims])


def _reduce(prim, a: TensorProxy, dims: tuple[int, ...], keepdim: bool) -> TensorProxy:
    out = prim(a, dims)
    return _keep_dims(out, a.shape, dims) if keepdim else out


def _expand_back(reduced: TensorProxy, a: TensorProxy, dims: tuple[int, ...]) -> TensorProxy:
    """A reduced value broadcast back to ``a``'s shape, to combine elementwise with ``a``."""
    if not dims:
        return reduced
    return prims.broadcast_in_dim(reduced, list(a.shape), [i for i in range(a.ndim) if i not in dims])


def _accumulation_dtype(d: torch.dtype) -> torch.dtype:
    """What a sum, product or scan computes in: float32 for half types, int64 for integers and bools."""
    if dtypes.is_low_precision_dtype(d):
        return torch.float32
    if dtypes.is_exact_dtype(d):
        return torch.int64
    return d


def _numel(shape: Sequence[int], dims: Sequence[int]) -> int:
    n = 1
    for d in dims:
        n *= shape[d]
    return n


def _reduced_shape(shape: Sequence[int], dims: Sequence[int], keepdim: bool) -> tuple[int, ...]:
    if keepdim:
        return tuple(1 if i in dims else s for i, s in enumerate(shape))
    return tuple(s for i, s in enumerate(shape) if i not in dims)


def _check_nonempty(op: str, a: TensorProxy, dim, dims: tuple[int, ...], *, sep: str = "()") -> None:
    """torch's errors for max-like reductions (no identity) over empty dims."""
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        check(a.numel() > 0, lambda: f"{op}(): Expected reduction dim to be specified for input.numel() == 0. "
              "Specify the reduction dim with the 'dim' argument.", RuntimeError)
        return
    for d in dims:
        check(a.shape[d] > 0, lambda: f"{op}{sep}: Expected reduction dim {d} to have non-zero size.", IndexError)


def _check_no_out(out, op: str) -> None:
    check(out is None, lambda: f"{op}(): out= is not supported inside fulmen.jit; assign the result instead",
          NotImplementedError)


def _return_type(name: str, values, indices):
    """``torch.return_types.<name>`` around proxies, so ``.values`` / ``.indices`` work while tracing."""
    return getattr(torch.return_types, name)((values, indices))


# ---- sum, mean, prod ----

@torchsymbol(torch.sum, torch.Tensor.sum, method_name="sum", tags=_RED)
def sum(input, dim=None, keepdim: bool = False, *, dtype: torch.dtype | None = None):
    """torch.sum: bool and integer inputs sum to int64 unless ``dtype`` says otherwise."""
    _check_tensor(input, "sum")
    dims = _reduction_dims(input, dim, "sum")
    if dtype is None:
        dtype = torch.int64 if dtypes.is_exact_dtype(input.dtype) else input.dtype
    else:
        input = maybe_convert_to_dtype(input, dtype)  # torch casts the input first, then reduces
    a = maybe_convert_to_dtype(input, _accumulation_dtype(dtype))
    return maybe_convert_to_dtype(_reduce(prims.sum, a, dims, keepdim), dtype)


@torchsymbol(torch.nansum, torch.Tensor.nansum, method_name="nansum", tags=_RED)
def nansum(input, dim=None, keepdim: bool = False, *, dtype: torch.dtype | None = None):
    """torch.nansum: ``sum`` with NaN taken as zero (``dim=()`` reduces every dim, as ``sum``'s; the fake kernel
    torch would otherwise lend the opaque op reduces none)."""
    _check_tensor(input, "nansum")
    check(not dtypes.is_complex_dtype(input.dtype), lambda: "nansum does not support complex inputs", RuntimeError)
    if dtypes.is_inexact_dtype(input.dtype):
        input = where(isnan(input), 0, input)
    return sum(input, dim, keepdim, dtype=dtype)


@torchsymbol(torch.mean, torch.Tensor.mean, method_name="mean", tags=_RED)
def mean(input, dim=None, keepdim: bool = False, *, dtype: torch.dtype | None = None):
    """torch.mean: floating point (or complex) only; an empty reduction gives NaN."""
    _check_tensor(input, "mean")
    if dtype is None:
        check(dtypes.is_inexact_dtype(input.dtype), lambda: "mean(): could not infer output dtype. Input dtype must "
              f"be either a floating point or complex dtype. Got: {scalar_type_name(input.dtype)}", RuntimeError)
        dtype = input.dtype
    else:
        check(dtypes.is_inexact_dtype(dtype), lambda: "mean(): could not infer output dtype. Optional dtype must be "
              f"either a floating point or complex dtype. Got: {scalar_type_name(dtype)}", RuntimeError)
    dims = _reduction_dims(input, dim, "mean")
    # As torch's CPU kernel: sum in the accumulation dtype, divide there, then cast to the result dtype.
    a = maybe_convert_to_dtype(input, _accumulation_dtype(dtype))
    out = clang.true_divide(prims.sum(a, dims), _numel(input.shape, dims))
    if keepdim:
        out = _keep_dims(out, input.shape, dims)
    return maybe_convert_to_dtype(out, dtype)


@torchsymbol(torch.prod, torch.Tensor.prod, method_name="prod", tags=_RED)
def prod(input, dim=None, keepdim: bool = False, *, dtype: torch.dtype | None = None):
    """torch.prod over one dim (or all); bool and integer inputs multiply to int64."""
    _check_tensor(input, "prod")
    if dim is not None:
        _check_int_dim(dim, "prod")
    dims = _reduction_dims(input, dim, "prod")
    if dtype is None:
        dtype = torch.int64 if dtypes.is_exact_dtype(input.dtype) else input.dtype
    else:
        input = maybe_convert_to_dtype(input, dtype)
    a = maybe_convert_to_dtype(input, _accumulation_dtype(dtype))
    return maybe_convert_to_dtype(_reduce(prims.prod, a, dims, keepdim), dtype)


# ---- max, min and friends ----

def _amax_amin(op: str, prim, input, dim, keepdim):
    _check_tensor(input, op)
    dims = _reduction_dims(input, dim, op)
    _check_nonempty(op, input, dim, dims)
    return _reduce(prim, input, dims, keepdim)


@torchsymbol(torch.amax, torch.Tensor.amax, method_name="amax", tags=_RED)
def amax(input, dim=(), keepdim: bool = False):
    """Maximum over dims (all when ``dim`` is empty), propagating NaN."""
    return _amax_amin("amax", prims.amax, input, dim, keepdim)


@torchsymbol(torch.amin, torch.Tensor.amin, method_name="amin", tags=_RED)
def amin(input, dim=(), keepdim: bool = False):
    """Minimum over dims (all when ``dim`` is empty), propagating NaN."""
    return _amax_amin("amin", prims.amin, input, dim, keepdim)


@torchsymbol(torch.aminmax, torch.Tensor.aminmax, method_name="aminmax", tags=_RED)
def aminmax(input, *, dim: int | None = None, keepdim: bool = False):
    """``(min, max)`` over one dim or all of them, as ``torch.return_types.aminmax``."""
    _check_tensor(input, "aminmax")
    if dim is None:
        check(input.numel() > 0, lambda: "aminmax(): cannot compute aminmax over an empty dimension as the "
              "operation has no identity.", RuntimeError)
    else:
        _check_int_dim(dim, "aminmax")
    dims = _reduction_dims(input, dim, "aminmax")
    if dim is not None:
        _check_nonempty("aminmax", input, dim, dims, sep="")
    lo, hi = _reduce(prims.amin, input, dims, keepdim), _reduce(prims.amax, input, dims, keepdim)
    return torch.return_types.aminmax((lo, hi))


def _max_min(op: str, input, dim, keepdim, other):
    _check_tensor(input, op)
    if other is None and isinstance(dim, TensorProxy):
        other, dim = dim, None
    if other is not None:
        check(isinstance(other, TensorProxy), lambda: f"{op}(): expected other to be a tensor, but got "
              f"{type(other).__name__}", TypeError)
        return (maximum if op == "max" else minimum)(input, other)
    reduce_prim = prims.amax if op == "max" else prims.amin
    if dim is None:
        check(not keepdim, lambda: f"{op}(): keepdim=True needs a dim (use amax/amin over all dims instead)",
              TypeError)
        dims = tuple(range(input.ndim))
        _check_nonempty(op, input, None, dims)
        return reduce_prim(input, dims)
    _check_int_dim(dim, op)
    dims = _reduction_dims(input, dim, op)
    _check_nonempty(op, input, dim, dims)
    # argmax/argmin pick the first extreme (a NaN counts as the maximum), as torch.max(dim) does on CPU.
    arg_input = input if input.dtype is not torch.bool else prims.convert_element_type(input, torch.uint8)
    cdim = canonicalize_dim(input.ndim, dim)
    indices = _keep_dims((prims.argmax if op == "max" else prims.argmin)(arg_input, cdim), input.shape, dims)
    # the values are gathered at the indices, so the gradient goes to the returned index alone, as eager's
    # (an amax's gradient would split among ties, and be NaN for a NaN maximum)
    values = prims.take_along_axis(input, indices, cdim)
    if not keepdim:
        indices, values = clang.squeeze(indices, dims), clang.squeeze(values, dims)
    return _return_type(op, values, indices)


@torchsymbol(torch.max, torch.Tensor.max, method_name="max", tags=_RED)
def max(input, dim=None, keepdim: bool = False, *, other=None):
    """torch.max in its three forms: ``max(a)`` (0-d), ``max(a, dim, keepdim)`` ((values, indices)), ``max(a, b)``."""
    return _max_min("max", input, dim, keepdim, other)


@torchsymbol(torch.min, torch.Tensor.min, method_name="min", tags=_RED)
def min(input, dim=None, keepdim: bool = False, *, other=None):
    """torch.min in its three forms, as ``max``."""
    return _max_min("min", input, dim, keepdim, other)


def _arg_reduction(op: str, prim, input, dim, keepdim):
    _check_tensor(input, op)
    check(input.dtype is not torch.bool, lambda: f"{op}(): does not support bool input", RuntimeError)
    if dim is None:
        check(input.numel() > 0, lambda: f"{op}(): Expected reduction dim to be specified for input.numel() == 0.",
              IndexError)
        out = prim(input, None)
        return clang.reshape(out, (1,) * input.ndim) if keepdim else out
    _check_int_dim(dim, op)
    d = canonicalize_dim(input.ndim, dim)
    out = prim(input, d)
    return _keep_dims(out, input.shape, (d,) if input.ndim else ()) if keepdim else out


@torchsymbol(torch.argmax, torch.Tensor.argmax, method_name="argmax", tags=_RED)
def argmax(input, dim: int | None = None, keepdim: bool = False):
    """Index of the first maximum along ``dim`` (of the flattened input when ``dim`` is None)."""
    return _arg_reduction("argmax", prims.argmax, input, dim, keepdim)


@torchsymbol(torch.argmin, torch.Tensor.argmin, method_name="argmin", tags=_RED)
def argmin(input, dim: int | None = None, keepdim: bool = False):
    """Index of the first minimum along ``dim`` (of the flattened input when ``dim`` is None)."""
    return _arg_reduction("argmin", prims.argmin, input, dim, keepdim)


# ---- variance and standard deviation ----

def _var_args(op: str, input, dim, unbiased, correction):
    """Resolve torch's two signatures: ``(dim, unbiased, keepdim)`` and ``(dim, *, correction, keepdim)``."""
    _check_tensor(input, op)
    if isinstance(dim, bool) and unbiased is None:  # var(a, True): the legacy (input, unbiased) form
        dim, unbiased = None, dim
    check(unbiased is None or correction is None, lambda: f"{op}() received an invalid combination of arguments: "
          "pass either unbiased= or correction=, not both", TypeError)
    if correction is None:
        correction = 1 if unbiased is None or unbiased else 0
    check(isinstance(correction, Number) and not isinstance(correction, bool),
          lambda: f"{op}(): correction must be a number, but got {correction!r}", TypeError)
    check(dtypes.is_inexact_dtype(input.dtype), lambda: "std and var only support floating point and complex dtypes",
          RuntimeError)
    return _reduction_dims(input, dim, op), correction


def _var_mean(op: str, input, dim, unbiased, keepdim, correction, *, with_mean: bool, take_sqrt: bool):
    dims, correction = _var_args(op, input, dim, unbiased, correction)
    a = maybe_convert_to_dtype(input, torch.float32 if dtypes.is_low_precision_dtype(input.dtype) else input.dtype)
    if with_mean:
        v, m = prims.var_mean(a, dims, correction=correction)
    else:
        v, m = prims.var(a, dims, correction=correction), None
    if take_sqrt:
        v = prims.sqrt(v)
    if keepdim:
        v = _keep_dims(v, a.shape, dims)
        m = _keep_dims(m, a.shape, dims) if m is not None else None
    v = maybe_convert_to_dtype(v, dtypes.corresponding_real_dtype(input.dtype))
    return v if m is None else (v, maybe_convert_to_dtype(m, input.dtype))


@torchsymbol(torch.var, torch.Tensor.var, method_name="var", tags=_RED)
def var(input, dim=None, unbiased: bool | None = None, keepdim: bool = False, *, correction: Number | None = None):
    """Variance with ``correction`` (default 1; the legacy ``unbiased`` flag means 1 or 0)."""
    return _var_mean("var", input, dim, unbiased, keepdim, correction, with_mean=False, take_sqrt=False)


@torchsymbol(torch.std, torch.Tensor.std, method_name="std", tags=_RED)
def std(input, dim=None, unbiased: bool | None = None, keepdim: bool = False, *, correction: Number | None = None):
    """Standard deviation: the square root of ``var`` (computed in float32 for half types)."""
    return _var_mean("std", input, dim, unbiased, keepdim, correction, with_mean=False, take_sqrt=True)


@torchsymbol(torch.var_mean, tags=_RED)
def var_mean(input, dim=None, unbiased: bool | None = None, keepdim: bool = False, *,
             correction: Number | None = None):
    """``(var, mean)`` in one pass."""
    return _var_mean("var_mean", input, dim, unbiased, keepdim, correction, with_mean=True, take_sqrt=False)


@torchsymbol(torch.std_mean, tags=_RED)
def std_mean(input, dim=None, unbiased: bool | None = None, keepdim: bool = False, *,
             correction: Number | None = None):
    """``(std, mean)`` in one pass."""
    return _var_mean("std_mean", input, dim, unbiased, keepdim, correction, with_mean=True, take_sqrt=True)


# ---- logsumexp and softmax ----

@torchsymbol(torch.logsumexp, torch.Tensor.logsumexp, torch.special.logsumexp, method_name="logsumexp", tags=_RED)
def logsumexp(input, dim, keepdim: bool = False):
    """log(sum(exp(x))) computed stably: the row maximum is subtracted first (an infinite maximum is not)."""
    _check_tensor(input, "logsumexp")
    dims = _reduction_dims(input, dim, "logsumexp")
    result = torch.get_default_dtype() if dtypes.is_exact_dtype(input.dtype) else input.dtype
    a = maybe_convert_to_dtype(input, torch.float32 if dtypes.is_low_precision_dtype(result) else result)
    if a.numel() == 0:
        out = prims.log(prims.sum(prims.exp(a), dims))
    else:
        m = prims.amax(a, dims)
        # An infinite maximum would give inf - inf = NaN; use 0 instead, as torch does (all -inf rows give -inf).
        m = clang.where(prims.isinf(m), 0.0, m)
        shifted = prims.exp(prims.sub(a, _expand_back(m, a, dims)))
        out = prims.add(prims.log(prims.sum(shifted, dims)), m)
    if keepdim:
        out = _keep_dims(out, a.shape, dims)
    return maybe_convert_to_dtype(out, result)


def _softmax_input(op: str, input, dim, dtype):
    _check_tensor(input, op)
    if dtype is not None:
        input = maybe_convert_to_dtype(input, dtype)
    check(dtypes.is_inexact_dtype(input.dtype), lambda: f"{op}: not implemented for "
          f"'{scalar_type_name(input.dtype)}'; pass dtype= a floating point dtype", NotImplementedError)
    _check_int_dim(dim, op)
    d = canonicalize_dim(input.ndim, dim)
    return input, (d,) if input.ndim else ()


def _softmax(op: str, input, dim, dtype, *, log: bool):
    input, dims = _softmax_input(op, input, dim, dtype)
    if input.numel() == 0:
        return clang.full(input.shape, 0.0, device=input.device, dtype=input.dtype)
    a = maybe_convert_to_dtype(input, torch.float32 if dtypes.is_low_precision_dtype(input.dtype) else input.dtype)
    # exp(x - max) cannot overflow; a row of -inf gives NaN, as in torch.
    shifted = prims.sub(a, _expand_back(prims.amax(a, dims), a, dims))
    e = prims.exp(shifted)
    total = prims.sum(e, dims)
    if log:
        out = prims.sub(shifted, _expand_back(prims.log(total), a, dims))
    else:
        out = prims.div(e, _expand_back(total, a, dims))
    return maybe_convert_to_dtype(out, input.dtype)


@torchsymbol(torch.softmax, torch.Tensor.softmax, torch.special.softmax, method_name="softmax", tags=_RED)
def softmax(input, dim: int, dtype: torch.dtype | None = None):
    """exp(x - max) / sum(exp(x - max)) along ``dim``; ``dtype`` converts the input first."""
    return _softmax("softmax", input, dim, dtype, log=False)


@torchsymbol(torch.log_softmax, torch.Tensor.log_softmax, torch.special.log_softmax, method_name="log_softmax",
             tags=_RED)
def log_softmax(input, dim: int, dtype: torch.dtype | None = None):
    """(x - max) - log(sum(exp(x - max))) along ``dim``; ``dtype`` converts the input first."""
    return _softmax("log_softmax", input, dim, dtype, log=True)


def _implicit_softmax_dim(name: str, ndim: int) -> int:
    warnings.warn(f"Implicit dimension choice for {name} has been deprecated. Change the call to include dim=X as "
                  "an argument.", stacklevel=4)
    return 0 if ndim in (0, 1, 3) else 1


def _functional_softmax(sym, name: str):
    """``F.softmax(input, dim=None, _stacklevel=3, dtype=None)`` in terms of the ``torch.softmax`` symbol."""

    def functional(input, dim=None, _stacklevel: int = 3, dtype=None):
        if dim is None:
            dim = _implicit_softmax_dim(name, input.ndim)
        return sym(input, dim) if dtype is None else sym(input, dim, dtype=dtype)

    functional.__name__ = name
    register_function((getattr(torch.nn.functional, name),), functional)


_functional_softmax(softmax, "softmax")
_functional_softmax(log_softmax, "log_softmax")


# ---- scans ----

def _scan(op: str, prim, input, dim, dtype):
    _check_tensor(input, op)
    _check_int_dim(dim, op)
    d = canonicalize_dim(input.ndim, dim)
    if dtype is None:
        dtype = torch.int64 if dtypes.is_exact_dtype(input.dtype) else input.dtype
    else:
        check(dtype is not torch.bool, lambda: f"{op}: not implemented for 'Bool' results", NotImplementedError)
        input = maybe_convert_to_dtype(input, dtype)
    a = maybe_convert_to_dtype(input, _accumulation_dtype(dtype))
    return maybe_convert_to_dtype(prim(a, d), dtype)


@torchsymbol(torch.cumsum, torch.Tensor.cumsum, method_name="cumsum", tags=_RED)
def cumsum(input, dim: int, *, dtype: torch.dtype | None = None):
    """Running sum along ``dim``; bool and integer inputs give int64."""
    return _scan("cumsum", prims.cumsum, input, dim, dtype)


@torchsymbol(torch.cumprod, torch.Tensor.cumprod, method_name="cumprod", tags=_RED)
def cumprod(input, dim: int, *, dtype: torch.dtype | None = None):
    """Running product along ``dim``; bool and integer inputs give int64."""
    return _scan("cumprod", prims.cumprod, input, dim, dtype)


@torchsymbol(torch.diff, torch.Tensor.diff, method_name="diff", tags=_RED)
def diff(input, n: int = 1, dim: int = -1, prepend=None, append=None):
    """``torch.diff``: the ``n``-th forward difference along ``dim`` (``logical_xor`` of neighbours for bool), after
    joining ``prepend`` and ``append`` to ``input`` along ``dim``; the inverse of ``cumsum``."""
    _check_tensor(input, "diff")
    check(input.ndim >= 1, lambda: "diff expects input to be at least one-dimensional", RuntimeError)
    check(isinstance(n, int) and not isinstance(n, bool), lambda: f"diff(): argument 'n' must be int, not "
          f"{type(n).__name__}", TypeError)
    check(n >= 0, lambda: f"order must be non-negative but got {n}", RuntimeError)
    _check_int_dim(dim, "diff")
    d = canonicalize_dim(input.ndim, dim)
    for name, t in (("prepend", prepend), ("append", append)):
        if t is None:
            continue
        check(isinstance(t, TensorProxy), lambda: f"diff(): argument '{name}' must be Tensor, not {type(t).__name__}",
              TypeError)
        check(t.ndim == input.ndim, lambda: "diff expects prepend or append to be the same dimension as input",
              RuntimeError)
        for i in range(input.ndim):
            check(i == d or t.shape[i] == input.shape[i], lambda: "diff expects the shape of tensor to prepend or "
                  "append to match that of input except along the differencing dimension; input.size("
                  f"{i}) = {input.shape[i]}, but got tensor.size({i}) = {t.shape[i]}", RuntimeError)
    if n == 0:  # torch returns a copy of the input, without prepend or append
        return clone(input)
    x = input
    if prepend is not None or append is not None:
        x = cat([t for t in (prepend, input, append) if t is not None], d)
    for _ in range(n if n < x.shape[d] else x.shape[d]):  # (this module's min is torch.min)
        length = x.shape[d] - 1
        later, earlier = clang.slice_in_dim(x, 1, length + 1, 1, d), clang.slice_in_dim(x, 0, length, 1, d)
        x = logical_xor(later, earlier) if x.dtype is torch.bool else sub(later, earlier)
    return x


# ---- top-k and sorting ----

@torchsymbol(torch.topk, torch.Tensor.topk, method_name="topk", tags=_RED)
def topk(input, k: int, dim: int | None = -1, largest: bool = True, sorted: bool = True):
    """The ``k`` largest (or smallest) entries along ``dim`` and their indices."""
    _check_tensor(input, "topk")
    check(isinstance(k, int) and not isinstance(k, bool), lambda: f"topk(): argument 'k' must be int, not "
          f"{type(k).__name__}", TypeError)
    dim = -1 if dim is None else dim
    _check_int_dim(dim, "topk")
    values, indices = prims.topk(input, k, canonicalize_dim(input.ndim, dim), bool(largest), bool(sorted))
    return _return_type("topk", values, indices)


@torchsymbol(torch.sort, torch.Tensor.sort, method_name="sort", tags=_RED)
def sort(input, dim: int = -1, descending: bool = False, stable: bool | None = False):
    """Values sorted along ``dim`` and the permutation that sorts them."""
    _check_tensor(input, "sort")
    _check_int_dim(dim, "sort")
    values, indices = prims.sort(input, canonicalize_dim(input.ndim, dim), bool(descending), bool(stable))
    return _return_type("sort", values, indices)


@torchsymbol(torch.argsort, torch.Tensor.argsort, method_name="argsort", tags=_RED)
def argsort(input, dim: int = -1, descending: bool = False, *, stable: bool = False):
    """The permutation that sorts ``input`` along ``dim``."""
    _check_tensor(input, "argsort")
    _check_int_dim(dim, "argsort")
    return prims.sort(input, canonicalize_dim(input.ndim, dim), bool(descending), bool(stable))[1]


# ---- logical reductions and counting ----

def _nonzero(a: TensorProxy) -> TensorProxy:
    return a if a.dtype is torch.bool else prims.ne(a, maybe_convert_to_dtype(0, a.dtype))


def _all_any(op: str, input, dim, keepdim):
    _check_tensor(input, op)
    # all/any read dim=() as "reduce nothing", unlike sum.
    dims = _reduction_dims(input, dim, op, empty_means_all=False)
    result = torch.uint8 if input.dtype is torch.uint8 else torch.bool
    if _numel(input.shape, dims) == 0:  # every output reduces an empty set: the identity
        out = clang.full(_reduced_shape(input.shape, dims, keepdim), op == "all", device=input.device,
                         dtype=torch.bool)
    else:
        out = _reduce(prims.amin if op == "all" else prims.amax, _nonzero(input), dims, keepdim)
    return maybe_convert_to_dtype(out, result)


@torchsymbol(torch.all, torch.Tensor.all, method_name="all", tags=_RED)
def all(input, dim=None, keepdim: bool = False):
    """True where every element along ``dim`` is nonzero (uint8 inputs give uint8, as in torch)."""
    return _all_any("all", input, dim, keepdim)


@torchsymbol(torch.any, torch.Tensor.any, method_name="any", tags=_RED)
def any(input, dim=None, keepdim: bool = False):
    """True where some element along ``dim`` is nonzero (uint8 inputs give uint8, as in torch)."""
    return _all_any("any", input, dim, keepdim)


@torchsymbol(torch.count_nonzero, torch.Tensor.count_nonzero, method_name="count_nonzero", tags=_RED)
def count_nonzero(input, dim=None):
    """Number of nonzero elements along ``dim`` (all dims when None), as int64."""
    _check_tensor(input, "count_nonzero")
    dims = _reduction_dims(input, dim, "count_nonzero")
    return prims.sum(prims.convert_element_type(_nonzero(input), torch.int64), dims)


@torchsymbol(torch.histc, torch.Tensor.histc, method_name="histc", tags=_RED)
def histc(input, bins: int = 100, min: Number = 0, max: Number = 0):
    """``torch.histc``: counts of the elements in ``bins`` equal-width bins over ``[min, max]`` (the last bin
    includes ``max``; elements outside, and NaNs, are not counted), in the input's dtype.

    A float32/float64 input that needs no gradient, with ``min < max`` given, is decomposed as torch's CPU kernel
    computes it: bin ``int((x - min) * bins / (max - min))``, in the input's dtype. Every other call (the range
    taken from the data when ``min == max``, integer inputs, which only CUDA accepts, an input that requires grad,
    for which torch raises at backward) is recorded as the opaque torch call, so it behaves exactly as eager.
    """
    _check_tensor(input, "histc")
    decomposable = (input.dtype in (torch.float32, torch.float64) and not input.requires_grad
                    and isinstance(bins, int) and not isinstance(bins, bool) and bins > 0
                    and isinstance(min, int | float) and isinstance(max, int | float)
                    and math.isfinite(min) and math.isfinite(max) and min < max)
    if not decomposable:
        return langctx.fallback[0](torch.histc)(input, bins=bins, min=min, max=max)
    dtype = input.dtype
    # the bin edges are min and max rounded to the input's dtype, and their difference is taken in that dtype
    low, high = torch.tensor(min, dtype=dtype), torch.tensor(max, dtype=dtype)
    width, low = float(high - low), float(low)
    check(width > 0, lambda: f"histc(): max must be larger than min, got min={min} and max={max} in {dtype}",
          RuntimeError)
    flat = clang.reshape(input, (input.numel(),))
    inside = logical_and(ge(flat, low), le(flat, float(high)))  # false for NaN
    # truncated toward zero, as the kernel's cast to int64
    position = maybe_convert_to_dtype(true_divide(mul(sub(flat, low), bins), width), torch.int64)
    position = where(eq(position, bins), bins - 1, position)  # the last bin includes max
    # elements outside the range (and NaNs) are counted in an extra bin past the end, which is dropped
    position = where(inside, position, bins)
    counts = prims.index_add(clang.full((bins + 1,), 0, device=input.device, dtype=dtype), 0, position,
                             clang.full((input.numel(),), 1, device=input.device, dtype=dtype))
    return clang.slice_in_dim(counts, 0, bins, 1, 0)


# ---- norms ----

@torchsymbol(torch.linalg.vector_norm, tags=_RED)
def vector_norm(x, ord: Number = 2, dim=None, keepdim: bool = False, *, dtype: torch.dtype | None = None):
    """The ``ord``-norm of ``x`` over ``dim`` (all dims when None): 2, 1, inf, -inf, 0 or any real p."""
    op = "linalg.vector_norm"
    _check_tensor(x, op)
    check(isinstance(ord, Number) and not isinstance(ord, bool), lambda: f"linalg_vector_norm(): argument 'ord' must "
          f"be Number, not {type(ord).__name__}", TypeError)
    check(dtypes.is_inexact_dtype(x.dtype), lambda: f"{op}: Expected a floating point or complex tensor as input. "
          f"Got {scalar_type_name(x.dtype)}", RuntimeError)
    if dtype is not None:
        check(dtypes.is_inexact_dtype(dtype) and torch.promote_types(x.dtype, dtype) == dtype,
              lambda: f"{op}: the dtype of the input ({scalar_type_name(x.dtype)}) should be convertible without "
              f"narrowing to the specified dtype ({scalar_type_name(dtype)})", RuntimeError)
        x = maybe_convert_to_dtype(x, dtype)
    dims = _reduction_dims(x, dim, op)
    check(_numel(x.shape, dims) > 0 or (ord >= 0 and ord != math.inf),
          lambda: f"{op} cannot compute the {ord} norm on an empty tensor because the operation does not have an "
          "identity", RuntimeError)
    result = dtypes.corresponding_real_dtype(x.dtype)
    a = maybe_convert_to_dtype(x, torch.float32 if dtypes.is_low_precision_dtype(x.dtype) else x.dtype)
    mag = prims.abs(a)
    if ord == math.inf:
        out = prims.amax(mag, dims)
    elif ord == -math.inf:
        out = prims.amin(mag, dims)
    elif ord == 0:
        out = prims.sum(prims.convert_element_type(prims.ne(mag, 0.0), mag.dtype), dims)
    elif ord == 1:
        out = prims.sum(mag, dims)
    elif ord == 2:
        out = prims.sqrt(prims.sum(prims.mul(mag, mag), dims))
    else:
        out = prims.pow(prims.sum(prims.pow(mag, float(ord)), dims), 1.0 / ord)
    if keepdim:
        out = _keep_dims(out, a.shape, dims)
    return maybe_convert_to_dtype(out, result)


@torchsymbol(torch.norm, torch.Tensor.norm, method_name="norm", tags=_RED)
def norm(input, p="fro", dim=None, keepdim: bool = False, out=None, dtype: torch.dtype | None = None):
    """torch.norm for vector norms ("fro" over at most two dims is the 2-norm); other matrix norms ("nuc", "fro"
    over more dims) run as eager's torch.norm, an opaque op with PyTorch's gradient."""
    _check_tensor(input, "norm")
    _check_no_out(out, "norm")
    if isinstance(p, str):
        n_dims = 0 if dim is None or isinstance(dim, int) else len(dim)
        if not (p == "fro" and (dim is None or n_dims <= 2)):
            from fulmen.core import langctx

            return langctx.fallback[0](torch.norm)(input, p, dim, keepdim, dtype=dtype)
        p = 2
    elif p is None:
        p = 2
    if isinstance(dim, int):
        dim = (dim,)
    return vector_norm(input, p, dim, keepdim, dtype=dtype)


