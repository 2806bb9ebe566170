"""Torch language: indexing (``a[key]``, ``a[key] = v``), gather/scatter and their in-place variants.

``a[key]`` follows PyTorch's rules. Ints, slices (any positive step), ``None`` and ``...`` are *basic*
indexing: the result is a view of ``a`` (an in-place update of it reaches ``a``). Integer tensors and lists
of ints are *advanced* indexing: the result is a new tensor; the indexed dims are replaced by the broadcast
shape of the indices, in place when the advanced indices are next to each other and in front otherwise
(ints are applied first, as PyTorch does, so they do not separate advanced indices). A boolean mask is the
positions of its set elements (``mask.nonzero(as_tuple=True)``), whose count is a data-dependent size
(``fulmen.core.unbacked``); ``a[mask] = value`` with a scalar (or one-element) value is an elementwise ``where``
instead, with no data-dependent size. A 0-d integer tensor index is advanced indexing here (eager treats it as an int,
so the result is a view there; values agree, only in-place updates through it differ).
"""

from __future__ import annotations

from numbers import Integral, Number

import torch

from fulmen import clang, prims
from fulmen.clang import TypePromotion, maybe_convert_to_dtype
from fulmen.core import dtypes
from fulmen.core.proxies import DataDependentError, TensorProxy, _user_location, latest
from fulmen.core.symbol import BoundSymbol, OpTags
from fulmen.core.tracer import get_tracer
from fulmen.core.unbacked import expect, known_equal, mask_positions
from fulmen.core.utils import canonicalize_dim, check, prod
from fulmen.torch.inplace import mutate
from fulmen.torch.inplace import setitem as _functional_setitem
from fulmen.torch.registry import register_function, tensor_methods, torchsymbol
from fulmen.torch.shape import _view_hook, follow_input_layout, fresh
from fulmen.torch.views import new_tensor

__all__ = [
    "getitem", "gather", "scatter", "scatter_add", "index_select", "index_add", "take_along_dim", "index_put",
    "setitem", "index_put_", "index_add_", "scatter_", "scatter_add_", "index_constant",
]


def _mask_error(mask: TensorProxy, what: str):
    raise DataDependentError(
        f"{what} with the boolean mask {mask.name} ({mask.type_string()}) gives a result whose shape depends on how "
        f"many elements are True, which fulmen.jit cannot trace.\n  at {_user_location()}\n"
        "Keep the shape fixed instead: torch.where(mask, x, other), x.masked_fill(mask, value) or x * mask; or use "
        "torch.compile(model, backend=\"fulmen\"), which runs this part eagerly."
    )


def _int_op(a, b, prim, kind=TypePromotion.DEFAULT):
    return clang.elementwise_binary(a, b, prim, kind)


# ---------------------------------------------------------------------------------------------------------
# constants from Python data (list indices, torch.tensor([...]))


def _nested_shape(data, op: str) -> tuple[int, ...]:
    if not isinstance(data, (list, tuple)):
        return ()
    if not data:
        return (0,)
    inner = [_nested_shape(x, op) for x in data]
    for i, s in enumerate(inner):
        check(s == inner[0], lambda: f"{op}: expected sequence of length {inner[0][0] if inner[0] else 0} at dim 1 "
              f"(got {s[0] if s else 0})", ValueError)
    return (len(data),) + inner[0]


def _flat_values(data) -> list:
    if isinstance(data, (list, tuple)):
        return [v for x in data for v in _flat_values(x)]
    return [data]


def _same_number(a, b) -> bool:
    """Equal as values a tensor holds: NaN is NaN, and -0.0 is not 0.0 (``repr`` round-trips floats exactly)."""
    if type(a) is not type(b):
        return False
    return repr(a) == repr(b) if isinstance(a, (float, complex)) else a == b


def index_constant(data, *, dtype: torch.dtype, device, op: str = "tensor") -> TensorProxy:
    """A tensor holding Python ``data`` (nested lists of numbers), built from prims.

    One value -> ``prims.full``; an integer progression -> ``prims.iota``; otherwise one ``full`` per value
    joined by ``prims.cat`` (meant for the short lists that indices and small constants are).
    """
    shape = _nested_shape(data, op)
    values = _flat_values(data)
    for v in values:
        check(isinstance(v, Number) and not isinstance(v, torch.Tensor), lambda: f"{op}: expected numbers in the "
              f"data, but got {type(v).__name__} ({v!r})", TypeError)
    if not values or all(_same_number(v, values[0]) for v in values):
        return clang.full(shape, values[0] if values else 0, device=device, dtype=dtype)
    ints = all(isinstance(v, Integral) and not isinstance(v, bool) for v in values)
    step = values[1] - values[0]
    if ints and all(values[i + 1] - values[i] == step for i in range(len(values) - 1)):
        flat = prims.iota(len(values), start=values[0], step=step, device=device, dtype=torch.int64)
        return clang.reshape(clang.maybe_convert_to_dtype(flat, dtype), shape)
    pieces = [clang.full((1,), v, device=device, dtype=dtype) for v in values]
    return clang.reshape(prims.cat(pieces, 0), shape)


# ---------------------------------------------------------------------------------------------------------
# a[key]


def _is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _is_mask(x) -> bool:
    return isinstance(x, TensorProxy) and x.dtype in (torch.bool, torch.uint8)


def _key_items(key) -> tuple:
    """The key as a tuple of indices; a non-tuple sequence of sequences is a tuple (PyTorch's legacy rule)."""
    if isinstance(key, tuple):
        return key
    if isinstance(key, list) and any(isinstance(x, (list, tuple, slice, TensorProxy)) or x is None or x is Ellipsis
                                     for x in key):
        return tuple(key)
    return (key,)


def _as_index(x, a: TensorProxy):
    """Lists and tuples inside a key become int64 index tensors."""
    if isinstance(x, (list, tuple)):
        values = _flat_values(x)
        check(all(_is_int(v) or isinstance(v, bool) for v in values), lambda: f"tensors used as indices must be long, "
              f"int, byte or bool tensors (got the list {x!r})", IndexError)
        if values and all(isinstance(v, bool) for v in values):
            return index_constant(x, dtype=torch.bool, device=a.device, op="index")
        return index_constant(x, dtype=torch.int64, device=a.device, op="index")
    if isinstance(x, TensorProxy):
        check(dtypes.is_integer_dtype(x.dtype), lambda: f"tensors used as indices must be long, int, byte or bool "
              f"tensors (got {x.dtype})", IndexError)
        return x
    if isinstance(x, Integral) or x is None or x is Ellipsis or isinstance(x, slice):
        return x
    raise IndexError("only integers, slices (`:`), ellipsis (`...`), None and long or byte Variables are valid "
                     f"indices (got {type(x).__name__})")


def _expand_ellipsis(items: tuple, a: TensorProxy) -> list:
    """Indices for every dim: the first ``...`` stands for the dims no index names (later ones, as in PyTorch,
    for dims past the end, so nothing may follow them)."""
    consumed = sum(x.ndim if _is_mask(x) else 1 for x in items
                   if x is not None and x is not Ellipsis and not isinstance(x, bool))
    check(consumed <= a.ndim, lambda: f"too many indices for tensor of dimension {a.ndim}", IndexError)
    fill = [slice(None)] * (a.ndim - consumed)
    dots = [i for i, x in enumerate(items) if x is Ellipsis]
    if not dots:
        return list(items) + fill
    if len(dots) > 1:
        check(not fill or all(x is Ellipsis for x in items[dots[1]:]),
              lambda: f"too many indices for tensor of dimension {a.ndim}", IndexError)
        items = tuple(x for i, x in enumerate(items) if x is not Ellipsis or i == dots[0])
    return list(items[:dots[0]]) + fill + list(items[dots[0] + 1:])


def _nonzero_tuple(mask: TensorProxy) -> tuple:
    from fulmen.core import langctx

    return langctx.fallback[0](torch.nonzero)(mask, as_tuple=True)


def _mask_indices(items: list, a: TensorProxy) -> list:
    """Each boolean (or uint8) mask replaced by the positions of its nonzero elements, one int64 index per dim it
    covers, as PyTorch does: ``a[mask]`` is ``a[mask.nonzero(as_tuple=True)]``. Their length is the number of
    elements set, an unbacked size (``fulmen.core.unbacked``)."""
    if not any(_is_mask(x) for x in items):
        return items
    out, dim = [], 0
    for x in items:
        if not _is_mask(x):
            out.append(x)
            dim += 0 if x is None or isinstance(x, bool) else 1
            continue
        if x.ndim == 0:  # eager adds a dim of size 1 or 0; kept out: it needs the mask's value as a size
            _mask_error(x, "indexing with a 0-d mask")
        for k in range(x.ndim):
            check(x.shape[k] == a.shape[dim + k], lambda: f"The shape of the mask {list(x.shape)} at index {k} does "
                  f"not match the shape of the indexed tensor {list(a.shape)} at index {dim + k}", IndexError)
        out.extend(mask_positions(x, _nonzero_tuple))
        dim += x.ndim
    return out


def is_basic_key(key) -> bool:
    """True when ``a[key]`` is a view in eager PyTorch (ints, slices, None, Ellipsis only)."""
    return all(x is None or x is Ellipsis or isinstance(x, slice) or _is_int(x) for x in _key_items(key))


def _slice_bounds(s: slice, n: int) -> tuple[int, int, int]:
    for part in (s.start, s.stop, s.step):
        check(part is None or isinstance(part, (Integral, torch.SymInt)),
              lambda: f"slice indices must be integers or None, got {type(part).__name__}",
              TypeError if not isinstance(part, TensorProxy) else NotImplementedError)
    check(s.step is None or s.step > 0, lambda: "step must be greater than zero", ValueError)
    if isinstance(n, torch.SymInt) or any(isinstance(v, torch.SymInt) for v in (s.start, s.stop, s.step)):
        start, stop, step = _symbolic_indices(s, n)
    else:
        start, stop, step = s.indices(n)
    if isinstance(start, torch.SymInt) or isinstance(stop, torch.SymInt):  # max() would ask which is larger
        return start, torch.sym_max(start, stop), step
    return start, max(start, stop), step


def _symbolic_indices(s: slice, n) -> tuple:
    """``slice.indices(n)`` for a positive step without ``int(n)`` (which would specialize a symbolic size)."""

    def bound(v, default):
        if v is None:
            return default
        if v < 0:
            v = v + n
            return v if v >= 0 else 0
        return v if v <= n else n

    return bound(s.start, 0), bound(s.stop, n), 1 if s.step is None else s.step


# a position no tensor has: where an index is outside its own dim, the merged index becomes this, and take raises
_PAST_ANY_END = 2**62


def _advanced(x: TensorProxy, positions: list[int], indices: list[TensorProxy]) -> TensorProxy:
    """``x`` indexed by integer tensors at ``positions`` (the other dims are kept whole)."""
    shape = clang.broadcast_shapes(*(i.shape for i in indices))
    sizes = [x.shape[p] for p in positions]
    linear = outside = None
    for index, n in zip(indices, sizes):
        index = clang.maybe_convert_to_dtype(index, torch.int64)
        if index.device != x.device:
            index = prims.device_put(index, x.device)
        index = clang.where(_int_op(index, 0, prims.lt, TypePromotion.ALWAYS_BOOL), _int_op(index, n, prims.add),
                            index)
        index = clang.expand_to(index, shape)
        if len(indices) > 1:  # an index outside its own dim could land inside the merged one: mark it
            out = prims.bitwise_or(_int_op(index, 0, prims.lt, TypePromotion.ALWAYS_BOOL),
                                   _int_op(index, n, prims.ge, TypePromotion.ALWAYS_BOOL))
            outside = out if outside is None else prims.bitwise_or(outside, out)
        linear = index if linear is None else _int_op(_int_op(linear, n, prims.mul), index, prims.add)
    if outside is not None:  # eager raises for it: so does take, given a position past the merged dim's end
        linear = clang.where(outside, _PAST_ANY_END, linear)
    flat_index = clang.reshape(linear, (prod(shape),))
    adjacent = positions == list(range(positions[0], positions[0] + len(positions)))
    if len(positions) == 1:
        taken = prims.take(x, flat_index, positions[0])
        where = positions[0]
    else:
        rest = [d for d in range(x.ndim) if d not in positions]
        moved = clang.permute(x, positions + rest)
        merged = clang.reshape(moved, (prod(sizes),) + tuple(x.shape[d] for d in rest))
        taken = prims.take(merged, flat_index, 0)
        if adjacent:  # put the indexed block back where the advanced indices were
            order = list(range(1, positions[0] + 1)) + [0] + list(range(positions[0] + 1, taken.ndim))
            taken = clang.permute(taken, order)
        where = positions[0] if adjacent else 0
    return clang.reshape(taken, tuple(taken.shape[:where]) + tuple(shape) + tuple(taken.shape[where + 1:]))


def _getitem(a: TensorProxy, key) -> TensorProxy:
    items = [_as_index(x, a) for x in _key_items(key)]
    py_bools = [x for x in items if isinstance(x, bool)]
    if py_bools and any(isinstance(x, TensorProxy) for x in items):
        raise NotImplementedError("fulmen.jit does not support indexing with Python bools together with tensor "
                                  "indices; index in two steps")
    items = _mask_indices(_expand_ellipsis(tuple(items), a), a)
    out, dim = a, 0
    positions: list[int] = []
    indices: list[TensorProxy] = []
    empty_dims: list[int] = []
    for x in items:
        if x is None or isinstance(x, bool):
            out = clang.unsqueeze(out, dim)
            if x is False:
                empty_dims.append(dim)
            dim += 1
        elif isinstance(x, slice):
            start, stop, step = _slice_bounds(x, out.shape[dim])
            out = clang.slice_in_dim(out, start, stop, step, dim)
            dim += 1
        elif isinstance(x, TensorProxy):
            positions.append(dim)
            indices.append(x)
            dim += 1
        else:
            n = out.shape[dim]
            # one condition for a data-dependent size (a chained comparison would ask about each half)
            expect(n > x if x >= 0 else n >= -x, lambda: f"index {x} is out of bounds for dimension {dim} with size "
                   f"{n}", IndexError)
            x = int(x) + n if x < 0 else int(x)
            out = clang.squeeze(clang.slice_in_dim(out, x, x + 1, 1, dim), (dim,))
    for d in empty_dims:
        out = clang.slice_in_dim(out, 0, 0, 1, d)
    if indices:
        return _advanced(out, positions, indices)
    return out


def _getitem_hook(bsym: BoundSymbol) -> None:
    if is_basic_key(bsym.args[1]):
        _view_hook(bsym)
    else:  # a new tensor, which eager lays out as the indexed one in the dims not indexed
        follow_input_layout(bsym)


@torchsymbol(torch.Tensor.__getitem__, method_name="__getitem__")
@new_tensor  # x[:], x[...]: eager's is a new view, which under no_grad stops gradients to x
def getitem(a, key):
    """``a[key]``: basic indexing gives a view, advanced (integer tensors, lists) a new tensor."""
    out = _getitem(a, key)
    return out if is_basic_key(key) else fresh(out, a)


getitem.post_hook = _getitem_hook
getitem.tags = getitem.tags + (OpTags.VIEW,)


def _captured(x):
    """Real tensors inside a key (closure or global index tensors) become trace inputs, as arguments do."""
    if isinstance(x, torch.Tensor) and not isinstance(x, TensorProxy):
        tracer = get_tracer()
        check(tracer is not None and tracer.captures_tensors, lambda: "indexing with a torch.Tensor inside a key "
              "needs a trace that captures tensors (fulmen.jit)", TypeError)
        return tracer.capture(x)
    if type(x) in (tuple, list):
        return type(x)(_captured(v) for v in x)
    return x


def _getitem_entry(a, key):
    return getitem(a, _captured(key))


register_function((torch.Tensor.__getitem__,), _getitem_entry, method_names=["__getitem__"])


# ---------------------------------------------------------------------------------------------------------
# a[key] = value


def _mask_fill(a: TensorProxy, items: list, value) -> TensorProxy | None:
    """``a[..., mask, ...] = value`` for one mask among whole slices: a ``where``; None if the key is other."""
    masks = [i for i, x in enumerate(items) if _is_mask(x)]
    if len(masks) != 1:
        return None
    if not all(x is Ellipsis or (isinstance(x, slice) and x == slice(None)) for i, x in enumerate(items)
               if i != masks[0]):
        return None
    mask = items[masks[0]]
    if mask.dtype is not torch.bool:
        mask = _int_op(mask, 0, prims.ne, TypePromotion.ALWAYS_BOOL)
    before, after = items[:masks[0]], items[masks[0] + 1:]
    if any(x is Ellipsis for x in before):
        start = a.ndim - mask.ndim - sum(1 for x in after if x is not Ellipsis)
    else:
        start = len(before)
    check(0 <= start and start + mask.ndim <= a.ndim, lambda: f"too many indices for tensor of dimension {a.ndim}",
          IndexError)
    for k in range(mask.ndim):
        check(mask.shape[k] == a.shape[start + k], lambda: f"The shape of the mask {list(mask.shape)} at index {k} "
              f"does not match the shape of the indexed tensor {list(a.shape)} at index {start + k}", IndexError)
    if isinstance(value, TensorProxy):
        if not known_equal(value.numel(), 1):  # several values: advanced indexing with the mask's positions
            return None
        value = clang.maybe_convert_to_dtype(clang.reshape(value, ()), a.dtype)
        if value.device != a.device and value.device.type != "cpu":
            value = prims.device_put(value, a.device)
    else:
        value = maybe_convert_to_dtype(value, a.dtype)
    mask = clang.reshape(mask, (1,) * start + tuple(mask.shape) + (1,) * (a.ndim - start - mask.ndim))
    return clang.where(mask, value, a)


def setitem(a: TensorProxy, key, value) -> None:
    """``a[key] = value`` (``Tensor.__setitem__``): basic, advanced and boolean-mask keys."""
    a, key, value = _captured(a), _captured(key), _captured(value)
    current = latest(a)
    items = [_as_index(x, current) for x in _key_items(key)]
    if any(_is_mask(x) for x in items):
        new = _mask_fill(current, items, value)
        if new is not None:  # one value: an elementwise where, with no data-dependent size
            mutate(a, new)
            return
    if isinstance(value, (list, tuple)):
        value = index_constant(value, dtype=current.dtype, device=current.device, op="__setitem__")
    _functional_setitem(a, tuple(items) if isinstance(key, (tuple, list)) else items[0], value)


register_function(tensor_methods("__setitem__"), setitem, method_names=["__setitem__"])


# ---------------------------------------------------------------------------------------------------------
# gather and scatter


def _empty_index(a, index, op: str):
    """The index of ``gather``/``scatter``/``scatter_add`` checked as eager checks it, or, for an index with no
    entries, an empty int64 index with ``a``'s number of dimensions: eager checks neither the dtype nor the shape of
    an index that selects nothing (its ``gather`` returns an empty tensor of the index's shape, its ``scatter`` a
    copy), so the prims, which keep their checks, get an index they accept. Returns (index, whether it was empty)."""
    check(isinstance(index, TensorProxy), lambda: f"{op}(): argument 'index' must be Tensor, not "
          f"{type(index).__name__}", TypeError)
    if not any(isinstance(s, int) and s == 0 for s in index.shape):
        # eager words the error "scatter()" for scatter_add too
        check(index.dtype in (torch.int64, torch.int32), lambda: f"{'gather' if op == 'gather' else 'scatter'}(): "
              "Expected dtype int32/int64 for index", RuntimeError)
        return index, False
    return clang.reshape(clang.maybe_convert_to_dtype(index, torch.int64), (0,) * max(a.ndim, 1)), True


@torchsymbol(torch.gather, torch.Tensor.gather, method_name="gather")
def gather(a, dim: int, index, *, sparse_grad: bool = False):
    """``torch.gather``: ``out[i][j] = a[index[i][j]][j]`` for ``dim=0``."""
    if sparse_grad and a.requires_grad and torch.is_grad_enabled():
        # eager's gradient of ``a`` is then a sparse COO tensor, which PyTorch's autograd of the opaque op gives
        # (transforms/sparse_gradients.py keeps it off fused regions)
        return _fallback(torch.gather)(a, dim, index, sparse_grad=True)
    index_, empty = _empty_index(a, index, "gather")
    out = prims.take_along_axis(a, index_, dim)
    return clang.reshape(out, index.shape) if empty else out


def _check_scatter_shapes(a, dim, index, src, op: str) -> None:
    check(index.ndim == a.ndim or (index.ndim <= 1 and a.ndim <= 1), lambda: "Index tensor must have the same number "
          "of dimensions as self tensor", RuntimeError)
    for d in range(index.ndim):
        ok = (d == dim or a.ndim == 0 or index.shape[d] <= a.shape[d]) and (
            not isinstance(src, TensorProxy) or src.ndim == 0 or index.shape[d] <= src.shape[d])
        check(ok, lambda: f"Expected index {list(index.shape)} to be no larger than self {list(a.shape)} apart from "
              f"dimension {dim} and to be no larger size than src {list(getattr(src, 'shape', ()))}", RuntimeError)


@torchsymbol(torch.scatter, torch.Tensor.scatter, method_name="scatter")
def scatter(a, dim: int, index, src=None, *, value=None, reduce=None):
    """``torch.scatter``: a copy of ``a`` with ``a[index[i][j]][j] = src[i][j]`` (dim 0), ``src`` a tensor or number."""
    if reduce is not None:
        return _fallback(torch.scatter)(a, dim, index, src if src is not None else value, reduce=reduce)
    src = value if src is None else src
    check(src is not None, lambda: "scatter() missing 1 required positional argument: 'src' (or 'value')", TypeError)
    index, empty = _empty_index(a, index, "scatter")
    dim = canonicalize_dim(a.ndim, dim)
    if isinstance(src, TensorProxy):
        check(src.dtype == a.dtype, lambda: "scatter(): Expected self.dtype to be equal to src.dtype", RuntimeError)
    else:
        src = maybe_convert_to_dtype(src, a.dtype)
    if empty:  # writes nothing: a copy of a (eager looks at no more of src than its dtype then)
        return prims.scatter(a, dim, index, maybe_convert_to_dtype(0, a.dtype))
    _check_scatter_shapes(a, dim, index, src, "scatter")
    return prims.scatter(a, dim, index, src)


@torchsymbol(torch.scatter_add, torch.Tensor.scatter_add, method_name="scatter_add")
def scatter_add(a, dim: int, index, src):
    """``torch.scatter_add``: a copy of ``a`` with ``src[i][j]`` added at ``a[index[i][j]][j]`` (dim 0)."""
    index, empty = _empty_index(a, index, "scatter_add")
    dim = canonicalize_dim(a.ndim, dim)
    check(isinstance(src, TensorProxy) and src.dtype == a.dtype,
          lambda: "scatter_add(): Expected self.dtype to be equal to src.dtype", RuntimeError)
    if empty:  # adds nothing: a copy of a
        return prims.scatter(a, dim, index, maybe_convert_to_dtype(0, a.dtype))
    _check_scatter_shapes(a, dim, index, src, "scatter_add")
    return prims.scatter_add(a, dim, index, src)


@torchsymbol(torch.index_select, torch.Tensor.index_select, method_name="index_select")
def index_select(a, dim: int, index):
    """``torch.index_select``: the entries ``index`` (a vector) of ``a`` along ``dim``."""
    check(isinstance(index, TensorProxy) and index.dtype in (torch.int64, torch.int32),
          lambda: "index_select(): Expected dtype int32 or int64 for index", RuntimeError)
    check(index.ndim <= 1, lambda: "index_select(): Index is supposed to be a vector", IndexError)
    return prims.take(a, index, dim)


@torchsymbol(torch.index_add, torch.Tensor.index_add, method_name="index_add")
def index_add(a, dim: int, index, source, *, alpha=1):
    """``torch.index_add``: a copy of ``a`` with ``alpha * source`` rows added at ``index`` along ``dim``."""
    check(isinstance(index, TensorProxy) and index.dtype in (torch.int64, torch.int32) and index.ndim <= 1,
          lambda: "index_add_(): Index is supposed to be a vector of int32 or int64", IndexError)
    check(source.dtype == a.dtype, lambda: f"index_add_(): self ({a.dtype}) and source ({source.dtype}) must have "
          "the same scalar type", RuntimeError)
    dim = canonicalize_dim(a.ndim, dim)
    check(source.ndim == 0 and index.numel() == 1 or source.ndim > 0 and source.shape[dim] == index.numel(),
          lambda: "index_add_(): Number of indices should be equal to source.size(dim)", IndexError)
    same_rest = source.ndim == a.ndim and all(s == t for d, (s, t) in enumerate(zip(source.shape, a.shape)) if d != dim)
    check(source.ndim == 0 or same_rest,
          lambda: f"source tensor shape must match self tensor shape, excluding the specified dimension. Got "
          f"self.shape = {list(a.shape)} source.shape = {list(source.shape)}", RuntimeError)
    if alpha != 1:
        check(not (isinstance(alpha, float) and dtypes.is_exact_dtype(a.dtype)), lambda: "For integral input "
              "tensors, argument alpha must not be a floating point number.", RuntimeError)
        source = clang.maybe_convert_to_dtype(_int_op(source, alpha, prims.mul), a.dtype)
    return prims.index_add(a, dim, index, source)


@torchsymbol(torch.take_along_dim, torch.Tensor.take_along_dim, method_name="take_along_dim")
def take_along_dim(a, indices, dim=None):
    """``torch.take_along_dim``: ``gather`` with ``a`` and ``indices`` broadcast against each other (but ``dim``)."""
    check(indices.dtype is torch.int64, lambda: f"torch.take_along_dim(): dtype of indices should be Long but got "
          f"{str(indices.dtype).replace('torch.', '')}", RuntimeError)
    if dim is None:
        return prims.take_along_axis(clang.reshape(a, (a.numel(),)), clang.reshape(indices, (indices.numel(),)), 0)
    check(a.ndim == indices.ndim, lambda: f"torch.take_along_dim(): input and indices should have the same number of "
          f"dimensions, but got {a.ndim} dimensions for input, and {indices.ndim} dimensions for indices",
          RuntimeError)
    dim = canonicalize_dim(a.ndim, dim)
    a_shape, i_shape = list(a.shape), list(indices.shape)
    a_shape[dim], i_shape[dim] = 1, 1
    common = list(clang.broadcast_shapes(a_shape, i_shape))
    a = clang.expand_to(a, common[:dim] + [a.shape[dim]] + common[dim + 1:])
    indices = clang.expand_to(indices, common[:dim] + [indices.shape[dim]] + common[dim + 1:])
    # eager wraps the index into [0, size) first (index -1 is the last entry, 4 of a size-4 dim the first), so its
    # gather reads, and its backward saves, that new tensor: a later in-place write of the caller's index changes
    # neither the result nor the gradient
    indices = _int_op(indices, a.shape[dim], prims.remainder)
    return prims.take_along_axis(a, indices, dim)


def _fallback(fn):
    from fulmen.core import langctx

    return langctx.fallback[0](fn)


@torchsymbol(torch.index_put, torch.Tensor.index_put, method_name="index_put")
def index_put(a, indices, values, accumulate: bool = False):
    """``torch.index_put``: a copy of ``a`` with ``a[indices] = values`` (``+=`` with ``accumulate``)."""
    check(isinstance(indices, (tuple, list)), lambda: "index_put(): argument 'indices' must be tuple of Tensors",
          TypeError)
    check(isinstance(values, TensorProxy), lambda: f"index_put(): argument 'values' must be Tensor, not "
          f"{type(values).__name__}", TypeError)
    check(values.dtype == a.dtype, lambda: f"Index put requires the source and destination dtypes match, got "
          f"{a.dtype} for the destination and {values.dtype} for the source.", RuntimeError)
    check(len(indices) <= a.ndim, lambda: f"too many indices for tensor of dimension {a.ndim} (got {len(indices)})",
          IndexError)
    items = [slice(None) if i is None else _as_index(i, a) for i in _captured(indices)]
    if any(_is_mask(x) for x in items):
        target = _int_op(a, values, prims.add) if accumulate else values
        new = _mask_fill(a, items, target) if known_equal(values.numel(), 1) else None
        if new is not None:
            return new
    return _put(a, tuple(items), values, accumulate)


def _put(a: TensorProxy, key: tuple, values, accumulate: bool) -> TensorProxy:
    """A copy of ``a`` with the elements ``a[key]`` picks set to (or incremented by) ``values``."""
    numbers = clang.reshape(prims.iota(a.numel(), start=0, step=1, device=a.device, dtype=torch.int64), a.shape)
    picked = _getitem(numbers, key)
    values = clang.expand_to(clang.maybe_convert_to_dtype(values, a.dtype), picked.shape)
    flat = prims.index_put(clang.reshape(a, (a.numel(),)), [clang.reshape(picked, (picked.numel(),))],
                           clang.reshape(values, (values.numel(),)), accumulate)
    return clang.reshape(flat, a.shape)


# ---------------------------------------------------------------------------------------------------------
# in-place variants


def _inplace(name: str, functional, doc: str):
    def fn(a, *args, **kwargs):
        return mutate(a, functional(a, *args, **kwargs))

    fn.__name__ = name
    fn.__doc__ = doc
    torch_fns = tensor_methods(name) + ((getattr(torch, name),) if hasattr(torch, name) else ())
    register_function(torch_fns, fn, method_names=[name])
    return fn


index_put_ = _inplace("index_put_", index_put, "``Tensor.index_put_``: ``a[indices] = values`` in place.")
index_add_ = _inplace("index_add_", index_add, "``Tensor.index_add_``: rows of ``alpha * source`` added in place.")
scatter_ = _inplace("scatter_", scatter, "``Tensor.scatter_``: ``scatter`` in place.")
scatter_add_ = _inplace("scatter_add_", scatter_add, "``Tensor.scatter_add_``: ``scatter_add`` in place.")
