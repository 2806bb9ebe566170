"""Torch language: creating tensors (``zeros``, ``arange``, ``rand`` ...) and filling them in place.

**Which calls reach fulmen.** Factory functions have no tensor argument, so inside a function compiled with
``fulmen.jit`` a plain ``torch.zeros(3)`` does not go through ``__torch_function__``: PyTorch runs it while
the program is traced, and the real tensor it makes becomes a constant input of the trace (captured once,
passed on every call). For deterministic factories that is correct; a plain ``torch.rand(3)`` however is
then drawn once, while tracing, and every call sees the same numbers (``torch.rand_like(x)`` or
``ltorch.rand(3)`` draw anew on each call). The ``*_like`` and ``Tensor.new_*`` forms take a tensor and do
reach these symbols, and ``ltorch.zeros(...)`` etc. can be called directly (by the torch language, by
executors, in traces).

**Randomness.** ``rand``/``randn``/``randint``/``bernoulli``/``normal`` and their ``*_like`` forms draw from
PyTorch's default generator when the compiled program *runs*, in program order, with the same generator
calls eager PyTorch makes (``torch.rand`` is ``empty(...).uniform_(0, 1)``, ``torch.randn`` is
``normal_(0, 1)``, ``torch.randint`` is ``random_(low, high)``). So after ``torch.manual_seed(s)`` a compiled
program and the eager one produce the same numbers bit for bit on the torch executor, and later eager draws
continue the same stream. A ``generator=`` argument is not supported.

**empty.** ``empty``/``empty_like``/``new_empty`` decompose to ``prims.empty``: the contents are unspecified,
as in PyTorch (they are not zero-filled).
"""

from __future__ import annotations

import math
from numbers import Number

import torch

from fulmen import clang, prims
from fulmen.clang import TypePromotion, maybe_convert_to_dtype
from fulmen.core import dtypes
from fulmen.core.devices import to_device
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import OpTags
from fulmen.core.symbolic import INT_TYPES, SYMBOLIC_NUMBERS
from fulmen.core.utils import check
from fulmen.torch.indexing import index_constant
from fulmen.torch.inplace import mutate
from fulmen.torch.registry import register_function, tensor_methods, torchsymbol
from fulmen.torch.shape import clone, sizes_arg
from fulmen.torch.views import memory_order, set_strides

__all__ = [
    "zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like", "empty_like", "rand_like",
    "randn_like", "randint_like", "arange", "linspace", "logspace", "eye", "rand", "randn", "randint", "normal",
    "bernoulli", "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor", "tensor", "as_tensor", "fill",
    "fill_", "zero_",
]

_CREATION = (OpTags.CREATION,)
_RANDOM = (OpTags.CREATION, OpTags.RANDOM_OP)


# ---------------------------------------------------------------------------------------------------------
# shared argument handling


def _device(device, like: TensorProxy | None = None) -> torch.device:
    if device is None:
        if like is not None:
            return like.device
        default = torch.get_default_device() if hasattr(torch, "get_default_device") else "cpu"
        return to_device(default)
    if isinstance(device, int) and not isinstance(device, bool):
        return to_device(torch.device("cuda", device))
    return to_device(device)


def _check_options(op: str, layout=None, out=None, generator=None, pin_memory=False) -> None:
    check(layout in (None, torch.strided), lambda: f"{op}: only the strided layout is supported, got {layout}",
          NotImplementedError)
    check(out is None, lambda: f"{op}: out= is not supported inside fulmen.jit; use the returned tensor",
          NotImplementedError)
    check(generator is None, lambda: f"{op}: generator= is not supported by fulmen.jit; seed the default generator "
          "with torch.manual_seed instead", NotImplementedError)


def _has_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def _check_layout_options(op: str, *, pin_memory: bool = False, memory_format=None) -> None:
    """Factory keywords fulmen does not honour raise rather than being dropped: a pinned or channels-last result would
    otherwise silently come back as a plain tensor. ``contiguous_format`` and ``preserve_format`` are honoured: the
    program's outputs get the strides eager gives them. (``names=`` is refused by the signatures, as by this torch's
    own factories, which have no named tensors.)"""
    if pin_memory:
        # without an accelerator eager refuses pin_memory=True itself: the same error, so a program that catches it
        # behaves alike; with one, a pinned result is not something a compiled program returns
        check(_has_accelerator(), lambda: f"{op}: pin_memory=True requires a CUDA or other accelerator backend; no "
              "pinned memory allocator is available on this system.", RuntimeError)
        raise NotImplementedError(f"{op}: pin_memory=True is not supported inside fulmen.jit; pin the tensor outside "
                                  "the compiled function (tensor.pin_memory())")
    check(memory_format in (None, torch.contiguous_format, torch.preserve_format),
          lambda: f"{op}: memory_format={memory_format} is not supported inside fulmen.jit (its tensors are "
          "contiguous); call .contiguous(memory_format=...) outside the compiled function", NotImplementedError)


def _finish(out: TensorProxy, requires_grad: bool) -> TensorProxy:
    if requires_grad:
        check(dtypes.is_inexact_dtype(out.dtype), lambda: "Only Tensors of floating point and complex dtype can "
              "require gradients", RuntimeError)
        out.requires_grad = True
    return out


def _fill_dtype(value) -> torch.dtype:
    """The dtype ``torch.full`` infers from its fill value."""
    check(isinstance(value, Number), lambda: f"full(): argument 'fill_value' must be Number, not "
          f"{type(value).__name__}", TypeError)
    return dtypes.python_type_dtype(value)


def _filled(shape, value, *, dtype, device, requires_grad=False) -> TensorProxy:
    check(isinstance(value, Number), lambda: f"full(): argument 'fill_value' must be Number, not "
          f"{type(value).__name__}", TypeError)
    for s in shape:
        check(s >= 0, lambda: f"Trying to create tensor with negative dimension {s}: {list(shape)}", RuntimeError)
    return _finish(clang.full(shape, maybe_convert_to_dtype(value, dtype), device=device, dtype=dtype), requires_grad)


# ---------------------------------------------------------------------------------------------------------
# zeros, ones, full, empty


@torchsymbol(torch.zeros, tags=_CREATION)
def zeros(*size_args, size=None, out=None, dtype=None, layout=None, device=None, pin_memory=False,
          requires_grad=False):
    """``torch.zeros``: ``size`` as varargs, a sequence or ``torch.Size``; ``dtype`` defaults to the default dtype."""
    _check_layout_options("zeros", pin_memory=pin_memory)
    _check_options("zeros", layout, out)
    shape = sizes_arg("zeros", size_args, size)
    return _filled(shape, 0, dtype=dtype or torch.get_default_dtype(), device=_device(device),
                   requires_grad=requires_grad)


@torchsymbol(torch.ones, tags=_CREATION)
def ones(*size_args, size=None, out=None, dtype=None, layout=None, device=None, pin_memory=False,
         requires_grad=False):
    _check_layout_options("ones", pin_memory=pin_memory)
    _check_options("ones", layout, out)
    shape = sizes_arg("ones", size_args, size)
    return _filled(shape, 1, dtype=dtype or torch.get_default_dtype(), device=_device(device),
                   requires_grad=requires_grad)


@torchsymbol(torch.full, tags=_CREATION)
def full(size, fill_value, *, out=None, dtype=None, layout=None, device=None, pin_memory=False, requires_grad=False):
    """``torch.full``: the dtype follows the fill value (bool, int64, the default float or complex dtype)."""
    _check_layout_options("full", pin_memory=pin_memory)
    _check_options("full", layout, out)
    shape = sizes_arg("full", (size,))
    return _filled(shape, fill_value, dtype=dtype or _fill_dtype(fill_value), device=_device(device),
                   requires_grad=requires_grad)


@torchsymbol(torch.empty, tags=_CREATION)
def empty(*size_args, size=None, out=None, dtype=None, layout=None, device=None, pin_memory=False,
          requires_grad=False, memory_format=None):
    """``torch.empty``: unspecified contents (``prims.empty``)."""
    _check_layout_options("empty", pin_memory=pin_memory, memory_format=memory_format)
    _check_options("empty", layout, out)
    shape = sizes_arg("empty", size_args, size)
    for s in shape:
        check(s >= 0, lambda: f"Trying to create tensor with negative dimension {s}: {list(shape)}", RuntimeError)
    out_ = prims.empty(shape, device=_device(device), dtype=dtype or torch.get_default_dtype())
    return _finish(out_, requires_grad)


# ---------------------------------------------------------------------------------------------------------
# *_like and Tensor.new_*


def _laid_out_like(a: TensorProxy, make) -> TensorProxy:
    """``make(shape)`` laid out as eager's ``*_like(a)`` is (``preserve_format``): as ``a`` when ``a`` is dense but
    not contiguous (transposed, channels_last), made in that memory order so that random draws fill it in eager's
    order; contiguous otherwise."""
    order = memory_order(a)
    if order is None:
        return make(tuple(a.shape))
    out = clang.permute(make(tuple(a.shape[d] for d in order)), [order.index(d) for d in range(a.ndim)])
    strides, step = [0] * a.ndim, 1
    for d in reversed(order):
        strides[d], step = step, step * a.shape[d]
    set_strides(out, strides)  # what later views, in-place writes and out= see
    return out


def _like(a, value, dtype, device, layout, requires_grad):
    _check_options("like", layout)
    dtype, device = dtype or a.dtype, _device(device, a)
    return _laid_out_like(a, lambda shape: _filled(shape, value, dtype=dtype, device=device,
                                                   requires_grad=requires_grad))


@torchsymbol(torch.zeros_like, tags=_CREATION)
def zeros_like(a, *, dtype=None, layout=None, device=None, pin_memory=False, requires_grad=False,
               memory_format=torch.preserve_format):
    _check_layout_options("zeros_like", pin_memory=pin_memory, memory_format=memory_format)
    return _like(a, 0, dtype, device, layout, requires_grad)


@torchsymbol(torch.ones_like, tags=_CREATION)
def ones_like(a, *, dtype=None, layout=None, device=None, pin_memory=False, requires_grad=False,
              memory_format=torch.preserve_format):
    _check_layout_options("ones_like", pin_memory=pin_memory, memory_format=memory_format)
    return _like(a, 1, dtype, device, layout, requires_grad)


@torchsymbol(torch.full_like, tags=_CREATION)
def full_like(a, fill_value, *, dtype=None, layout=None, device=None, pin_memory=False, requires_grad=False,
              memory_format=torch.preserve_format):
    """``torch.full_like``: ``a``'s shape, dtype and device unless given (the fill value does not set the dtype)."""
    _check_layout_options("full_like", pin_memory=pin_memory, memory_format=memory_format)
    return _like(a, fill_value, dtype, device, layout, requires_grad)


@torchsymbol(torch.empty_like, tags=_CREATION)
def empty_like(a, *, dtype=None, layout=None, device=None, pin_memory=False, requires_grad=False,
               memory_format=torch.preserve_format):
    _check_layout_options("empty_like", pin_memory=pin_memory, memory_format=memory_format)
    _check_options("empty_like", layout)
    device, dtype = _device(device, a), dtype or a.dtype
    return _finish(_laid_out_like(a, lambda shape: prims.empty(shape, device=device, dtype=dtype)), requires_grad)


@torchsymbol(torch.Tensor.new_zeros, method_name="new_zeros", tags=_CREATION)
def new_zeros(a, *size_args, size=None, dtype=None, layout=None, device=None, pin_memory=False,
              requires_grad=False):
    _check_layout_options("new_zeros", pin_memory=pin_memory)
    shape = sizes_arg("new_zeros", size_args, size)
    return _filled(shape, 0, dtype=dtype or a.dtype, device=_device(device, a), requires_grad=requires_grad)


@torchsymbol(torch.Tensor.new_ones, method_name="new_ones", tags=_CREATION)
def new_ones(a, *size_args, size=None, dtype=None, layout=None, device=None, pin_memory=False,
             requires_grad=False):
    _check_layout_options("new_ones", pin_memory=pin_memory)
    shape = sizes_arg("new_ones", size_args, size)
    return _filled(shape, 1, dtype=dtype or a.dtype, device=_device(device, a), requires_grad=requires_grad)


@torchsymbol(torch.Tensor.new_full, method_name="new_full", tags=_CREATION)
def new_full(a, size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=False, requires_grad=False):
    _check_layout_options("new_full", pin_memory=pin_memory)
    return _filled(sizes_arg("new_full", (size,)), fill_value, dtype=dtype or a.dtype, device=_device(device, a),
                   requires_grad=requires_grad)


@torchsymbol(torch.Tensor.new_empty, method_name="new_empty", tags=_CREATION)
def new_empty(a, *size_args, size=None, dtype=None, layout=None, device=None, pin_memory=False,
              requires_grad=False):
    _check_layout_options("new_empty", pin_memory=pin_memory)
    shape = sizes_arg("new_empty", size_args, size)
    return _finish(prims.empty(shape, device=_device(device, a), dtype=dtype or a.dtype), requires_grad)


@torchsymbol(torch.Tensor.new_tensor, method_name="new_tensor", tags=_CREATION)
def new_tensor(a, data, *, dtype=None, device=None, requires_grad=False, layout=None, pin_memory=False):
    """``Tensor.new_tensor``: Python data (or a copy of a tensor) with ``a``'s dtype and device by default."""
    _check_layout_options("new_tensor", pin_memory=pin_memory)
    if isinstance(data, TensorProxy):
        from fulmen.torch.conversion import to

        return _finish(clone(to(data, device=_device(device, a), dtype=dtype or a.dtype)), requires_grad)
    return _finish(index_constant(data, dtype=dtype or a.dtype, device=_device(device, a), op="new_tensor"),
                   requires_grad)


# ---------------------------------------------------------------------------------------------------------
# torch.tensor, as_tensor


def _data_dtype(data) -> torch.dtype:
    values = data if isinstance(data, (list, tuple)) else [data]
    flat: list = []
    stack = list(values)
    while stack:
        v = stack.pop()
        if isinstance(v, (list, tuple)):
            stack.extend(v)
        else:
            flat.append(v)
    if any(isinstance(v, complex) for v in flat):
        return dtypes.corresponding_complex_dtype(torch.get_default_dtype())
    if any(isinstance(v, float) for v in flat):
        return torch.get_default_dtype()
    if flat and all(isinstance(v, bool) for v in flat):
        return torch.bool
    return torch.int64 if flat else torch.get_default_dtype()


@torchsymbol(torch.tensor, tags=_CREATION)
def tensor(data, *, dtype=None, device=None, requires_grad=False, pin_memory=False):
    """``torch.tensor`` of Python data: a constant built from prims (see ``indexing.index_constant``). Of a tensor
    (a NumPy array's, a global's): a detached copy, as eager makes (which warns, recommending t.clone().detach())."""
    _check_layout_options("tensor", pin_memory=pin_memory)
    if isinstance(data, TensorProxy):
        from fulmen.torch.conversion import to
        from fulmen.torch.shape import detach

        copy = clone(to(detach(data), device=device, dtype=dtype))
        return _finish(copy, requires_grad)
    return _finish(index_constant(data, dtype=dtype or _data_dtype(data), device=_device(device), op="tensor"),
                   requires_grad)


@torchsymbol(torch.as_tensor, tags=_CREATION)
def as_tensor(data, dtype=None, device=None):
    """``torch.as_tensor``: a tensor is returned as is (converted if asked), Python data becomes a constant."""
    if isinstance(data, TensorProxy):
        from fulmen.torch.conversion import to

        return to(data, device=device, dtype=dtype)
    return index_constant(data, dtype=dtype or _data_dtype(data), device=_device(device), op="as_tensor")


# ---------------------------------------------------------------------------------------------------------
# ranges


def _check_real(op: str, *values) -> None:
    for v in values:
        check(isinstance(v, (Number, *SYMBOLIC_NUMBERS)) and not isinstance(v, complex),
              lambda: f"{op}(): expected real numbers, got {type(v).__name__} ({v!r}); tensor arguments are not "
              "supported", TypeError)


@torchsymbol(torch.arange, tags=_CREATION)
def arange(start, end=None, step=1, *, out=None, dtype=None, layout=None, device=None, pin_memory=False,
           requires_grad=False):
    """``torch.arange``: int64 when start, end and step are ints, else the default float dtype."""
    _check_layout_options("arange", pin_memory=pin_memory)
    _check_options("arange", layout, out)
    if end is None:
        start, end = 0, start
    _check_real("arange", start, end, step)
    if dtype is None:
        ints = all(isinstance(v, INT_TYPES) for v in (start, end, step))
        dtype = torch.int64 if ints else torch.get_default_dtype()
    check(step != 0, lambda: "step must be nonzero", RuntimeError)
    check((end - start) * step >= 0 or end == start, lambda: "upper bound and lower bound inconsistent with step "
          "sign", RuntimeError)
    if all(isinstance(v, INT_TYPES) for v in (start, end, step)):
        length = max(-((start - end) // step), 0)  # integer ceil division: exact for symbolic sizes too
    else:
        length = max(math.ceil((end - start) / step), 0)
    out_ = prims.iota(length, start=start, step=step, device=_device(device), dtype=dtype)
    return _finish(out_, requires_grad)


def _spaced(start, end, steps: int, dtype, device, op: str) -> TensorProxy:
    """``start + i * step`` for the first half and ``end - (steps - 1 - i) * step`` for the second, as torch.

    ``start`` and ``end`` may be 0-d real tensors (eager reads their values, in the result's precision): the same
    formula then runs on them, as tensor operations, on every call."""
    endpoints = []
    for name, v in (("start", start), ("end", end)):
        if isinstance(v, TensorProxy):
            check(v.ndim == 0, lambda: f"{op} only supports 0-dimensional start and end tensors, but got {name} with "
                  f"{v.ndim} dimension(s).", RuntimeError)
            check(not dtypes.is_complex_dtype(v.dtype), lambda: f"{op}(): complex {name} is not supported by fulmen",
                  NotImplementedError)
        else:
            _check_real(op, v)
        endpoints.append(v)
    check(isinstance(steps, int) and steps >= 0, lambda: "number of steps must be non-negative", RuntimeError)
    compute = dtype if dtypes.is_inexact_dtype(dtype) else torch.float64
    if isinstance(start, TensorProxy) or isinstance(end, TensorProxy):
        start, end = (clang.maybe_convert_to_dtype(v, compute) if isinstance(v, TensorProxy) else
                      clang.full((), v, device=device, dtype=compute) for v in endpoints)
        if steps <= 1:
            return clang.where(clang.full((steps,), True, device=device, dtype=torch.bool), start, start)
        step = clang.elementwise_binary(clang.sub(end, start), steps - 1, prims.div)
    elif steps <= 1:
        return clang.full((steps,), maybe_convert_to_dtype(start, compute), device=device, dtype=compute)
    else:
        # torch computes the step in the result's own precision
        step = ((torch.tensor(end, dtype=compute) - torch.tensor(start, dtype=compute)) / (steps - 1)).item()
    index = prims.iota(steps, start=0, step=1, device=device, dtype=torch.int64)
    findex = clang.maybe_convert_to_dtype(index, compute)
    low = clang.add(clang.mul(findex, step), start)
    high = clang.elementwise_binary(end, clang.mul(clang.elementwise_binary(steps - 1, findex, prims.sub), step),
                                    prims.sub)
    first_half = clang.elementwise_binary(index, steps // 2, prims.lt, TypePromotion.ALWAYS_BOOL)
    return clang.where(first_half, low, high)


@torchsymbol(torch.linspace, tags=_CREATION)
def linspace(start, end, steps, *, out=None, dtype=None, layout=None, device=None, pin_memory=False,
             requires_grad=False):
    """``torch.linspace``: ``steps`` evenly spaced values from ``start`` to ``end`` inclusive."""
    _check_layout_options("linspace", pin_memory=pin_memory)
    _check_options("linspace", layout, out)
    dtype = dtype or torch.get_default_dtype()
    out_ = clang.maybe_convert_to_dtype(_spaced(start, end, steps, dtype, _device(device), "linspace"), dtype)
    return _finish(out_, requires_grad)


@torchsymbol(torch.logspace, tags=_CREATION)
def logspace(start, end, steps, base=10.0, *, out=None, dtype=None, layout=None, device=None, pin_memory=False,
             requires_grad=False):
    """``torch.logspace``: ``base ** linspace(start, end, steps)``."""
    _check_layout_options("logspace", pin_memory=pin_memory)
    _check_options("logspace", layout, out)
    dtype = dtype or torch.get_default_dtype()
    exponents = _spaced(start, end, steps, dtype, _device(device), "logspace")
    out_ = clang.elementwise_binary(float(base), exponents, prims.pow)
    return _finish(clang.maybe_convert_to_dtype(out_, dtype), requires_grad)


@torchsymbol(torch.eye, tags=_CREATION)
def eye(n, m=None, *, out=None, dtype=None, layout=None, device=None, pin_memory=False, requires_grad=False):
    """``torch.eye``: ones on the diagonal of an ``n`` x ``m`` matrix."""
    _check_layout_options("eye", pin_memory=pin_memory)
    _check_options("eye", layout, out)
    m = n if m is None else m
    check(n >= 0, lambda: f"n must be greater or equal to 0, got {n}", RuntimeError)
    check(m >= 0, lambda: f"m must be greater or equal to 0, got {m}", RuntimeError)
    dev = _device(device)
    rows = clang.reshape(prims.iota(n, start=0, step=1, device=dev, dtype=torch.int64), (n, 1))
    cols = clang.reshape(prims.iota(m, start=0, step=1, device=dev, dtype=torch.int64), (1, m))
    on = clang.elementwise_binary(rows, cols, prims.eq, TypePromotion.ALWAYS_BOOL)
    return _finish(clang.maybe_convert_to_dtype(on, dtype or torch.get_default_dtype()), requires_grad)


# ---------------------------------------------------------------------------------------------------------
# random


def _float_dtype(dtype, op: str) -> torch.dtype:
    dtype = dtype or torch.get_default_dtype()
    check(dtypes.is_float_dtype(dtype), lambda: f"{op}: expected a floating point dtype, got {dtype}", RuntimeError)
    return dtype


@torchsymbol(torch.rand, tags=_RANDOM)
def rand(*size_args, size=None, generator=None, out=None, dtype=None, layout=None, device=None, pin_memory=False,
         requires_grad=False):
    """``torch.rand``: uniform in [0, 1) from the default generator (``empty(...).uniform_(0, 1)``)."""
    _check_layout_options("rand", pin_memory=pin_memory)
    _check_options("rand", layout, out, generator)
    shape = sizes_arg("rand", size_args, size)
    out_ = prims.uniform(shape, 0.0, 1.0, device=_device(device), dtype=_float_dtype(dtype, "rand"))
    return _finish(out_, requires_grad)


@torchsymbol(torch.randn, tags=_RANDOM)
def randn(*size_args, size=None, generator=None, out=None, dtype=None, layout=None, device=None, pin_memory=False,
          requires_grad=False):
    """``torch.randn``: standard normal samples from the default generator (``normal_(0, 1)``)."""
    _check_layout_options("randn", pin_memory=pin_memory)
    _check_options("randn", layout, out, generator)
    shape = sizes_arg("randn", size_args, size)
    out_ = prims.normal(shape, 0.0, 1.0, device=_device(device), dtype=_float_dtype(dtype, "randn"))
    return _finish(out_, requires_grad)


def _randint_bounds(args, op: str) -> tuple[int, int, tuple]:
    if len(args) == 2:
        (high, size), low = args, 0
    elif len(args) == 3:
        low, high, size = args
    else:
        raise TypeError(f"{op}() expects (high, size) or (low, high, size), got {len(args)} positional arguments")
    check(low < high, lambda: f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}",
          RuntimeError)
    return low, high, size


@torchsymbol(torch.randint, tags=_RANDOM)
def randint(*args, low=None, high=None, size=None, generator=None, out=None, dtype=None, layout=None, device=None,
            pin_memory=False, requires_grad=False):
    """``torch.randint(high, size)`` / ``(low, high, size)``: int64 uniform in [low, high) by default."""
    _check_layout_options("randint", pin_memory=pin_memory)
    _check_options("randint", layout, out, generator)
    args = (() if low is None else (low,)) + args + tuple(v for v in (high, size) if v is not None)
    low, high, size = _randint_bounds(args, "randint")
    shape = sizes_arg("randint", (size,))
    return prims.randint(shape, low, high, device=_device(device), dtype=dtype or torch.int64)


@torchsymbol(torch.rand_like, tags=_RANDOM)
def rand_like(a, *, dtype=None, layout=None, device=None, pin_memory=False, requires_grad=False,
              memory_format=torch.preserve_format, generator=None):
    _check_layout_options("rand_like", pin_memory=pin_memory, memory_format=memory_format)
    _check_options("rand_like", layout, None, generator)
    device, dtype = _device(device, a), _float_dtype(dtype or a.dtype, "rand_like")
    return _finish(_laid_out_like(a, lambda shape: prims.uniform(shape, 0.0, 1.0, device=device, dtype=dtype)),
                   requires_grad)


@torchsymbol(torch.randn_like, tags=_RANDOM)
def randn_like(a, *, dtype=None, layout=None, device=None, pin_memory=False, requires_grad=False,
               memory_format=torch.preserve_format, generator=None):
    _check_layout_options("randn_like", pin_memory=pin_memory, memory_format=memory_format)
    _check_options("randn_like", layout, None, generator)
    device, dtype = _device(device, a), _float_dtype(dtype or a.dtype, "randn_like")
    return _finish(_laid_out_like(a, lambda shape: prims.normal(shape, 0.0, 1.0, device=device, dtype=dtype)),
                   requires_grad)


@torchsymbol(torch.randint_like, tags=_RANDOM)
def randint_like(a, low_or_high, high=None, *, dtype=None, layout=None, device=None, pin_memory=False,
                 requires_grad=False, memory_format=torch.preserve_format, generator=None):
    """``torch.randint_like(a, high)`` / ``(a, low, high)``."""
    _check_layout_options("randint_like", pin_memory=pin_memory, memory_format=memory_format)
    _check_options("randint_like", layout, None, generator)
    low, high = (0, low_or_high) if high is None else (low_or_high, high)
    check(low < high, lambda: f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}",
          RuntimeError)
    return prims.randint(a.shape, low, high, device=_device(device, a), dtype=dtype or a.dtype)


@torchsymbol(torch.normal, tags=_RANDOM)
def normal(mean, std=1.0, size=None, *, generator=None, out=None, dtype=None, layout=None, device=None,
           pin_memory=False, requires_grad=False):
    """``torch.normal``: numbers and a ``size``, or tensors of means / standard deviations (as eager computes)."""
    _check_layout_options("normal", pin_memory=pin_memory)
    _check_options("normal", layout, out, generator)
    if not isinstance(mean, TensorProxy) and not isinstance(std, TensorProxy):
        check(size is not None, lambda: "normal() with float mean and std needs a size", TypeError)
        check(std >= 0, lambda: f"normal expects std >= 0.0, but found std {std}", RuntimeError)
        shape = sizes_arg("normal", (size,))
        out_ = prims.normal(shape, float(mean), float(std), device=_device(device), dtype=_float_dtype(dtype,
                                                                                                       "normal"))
        return _finish(out_, requires_grad)
    ref = mean if isinstance(mean, TensorProxy) else std
    shape = clang.broadcast_shapes(*(t.shape for t in (mean, std) if isinstance(t, TensorProxy)))
    if isinstance(std, TensorProxy):  # eager: normal_(0, 1) * std + mean
        draw = prims.normal(shape, 0.0, 1.0, device=ref.device, dtype=ref.dtype)
        return clang.add(clang.mul(draw, std), mean)
    check(std >= 0, lambda: f"normal expects std >= 0.0, but found std {std}", RuntimeError)
    draw = prims.normal(shape, 0.0, float(std), device=ref.device, dtype=ref.dtype)  # eager: normal_(0, std) + mean
    return clang.add(draw, mean)


@torchsymbol(torch.bernoulli, torch.Tensor.bernoulli, method_name="bernoulli", tags=_RANDOM)
def bernoulli(a, p=None, *, generator=None):
    """``torch.bernoulli``: 1 with probability ``a`` (elementwise), or ``p`` when given."""
    _check_options("bernoulli", generator=generator)
    check(dtypes.is_float_dtype(a.dtype), lambda: f"bernoulli expects a floating point input, got {a.dtype}",
          RuntimeError)
    return prims.bernoulli(a.shape, a if p is None else float(p), device=a.device, dtype=a.dtype)


# ---------------------------------------------------------------------------------------------------------
# filling in place


@torchsymbol(torch.fill, tags=_CREATION)
def fill(a, value):
    """``torch.fill``: a tensor like ``a`` filled with ``value`` (a number or a 0-d tensor)."""
    if isinstance(value, TensorProxy):
        check(value.ndim == 0, lambda: f"fill_ only supports 0-dimension value tensor but got tensor with "
              f"{value.ndim} dimensions.", RuntimeError)
        value = clang.maybe_convert_to_dtype(value, a.dtype)
        if value.device != a.device:
            value = prims.device_put(value, a.device)
        return clang.expand_to(value, a.shape) if a.ndim else clone(value)
    return _filled(a.shape, value, dtype=a.dtype, device=a.device)


def fill_(a, value):
    """``Tensor.fill_``: every element of ``a`` (and of what ``a`` views) set to ``value``."""
    return mutate(a, fill(a, value), overwrites=True, refuse_overlap=False)


def zero_(a):
    """``Tensor.zero_``: every element of ``a`` set to 0."""
    return mutate(a, 0, refuse_overlap=False)


register_function(tensor_methods("fill_") + (torch.fill_,), fill_, method_names=["fill_"])
register_function(tensor_methods("zero_") + (torch.zero_,), zero_, method_names=["zero_"])
