"""Torch language: views, reshaping, joining and splitting.

View ops (``view``, ``reshape``, ``permute``, ``select``, ``split`` ...) are declared with ``view_symbol``
(``fulmen.torch.views``): besides computing their result they decide, as eager PyTorch would, whether the result
*aliases* its input, so that an in-place update of the result reaches the input (``fulmen.torch.inplace``), and
which strides it has: a view, a copy (``reshape`` / ``contiguous`` / ``flatten`` of a non-contiguous tensor), or
an error (``view`` of a tensor whose strides do not allow it). Results of non-view, non-elementwise ops are taken
to be contiguous: there fulmen may allow a ``view`` eager rejects, or alias where eager copies.

Copies (``clone``, ``cat``, ``flip``, ``roll``, ``repeat`` ...) never return their input proxy: a value the
caller may later update in place must not be the input itself. Padding, flipping, rolling, repeating and
triangles are in ``rearrange.py``; indexing (``a[key]``, gather, scatter) is in ``indexing.py``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from fulmen import clang, prims
from fulmen.core import dtypes, langctx
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import OpTags
from fulmen.core.symbolic import INT_TYPES
from fulmen.core.utils import canonicalize_dim, check, prod
from fulmen.torch.fallback import opaque_symbol
from fulmen.torch.registry import lazy_bits, register_function, set_lazy_bits, torchsymbol
from fulmen.torch.storage_views import link_to_storage
from fulmen.torch.views import (  # noqa: F401  (re-exported: the view machinery's home was this file)
    _on_meta,
    _set_strides,
    _view_hook,
    check_viewable,
    follow_input_layout,
    is_contiguous,
    layout_of,
    set_strides,
    strides_of,
    view_symbol,
)

__all__ = [
    "view", "reshape", "view_as", "reshape_as", "permute", "transpose", "swapaxes", "swapdims", "t", "T", "mT",
    "adjoint", "squeeze", "unsqueeze", "expand", "expand_as", "broadcast_to", "broadcast_tensors", "cat",
    "concatenate", "stack", "hstack", "vstack", "split", "split_with_sizes", "chunk", "unbind", "tensor_split",
    "flatten", "unflatten", "narrow", "select", "movedim", "diagonal", "unfold", "contiguous", "clone", "detach",
    "as_strided", "view_as_real", "view_as_complex", "strides_of", "layout_of", "set_strides", "view_symbol",
    "sizes_arg", "fresh",
]

_SHAPE = (OpTags.SHAPE_OP,)

# ---------------------------------------------------------------------------------------------------------
# argument helpers


def sizes_arg(op: str, args: Sequence, keyword=None, *, name: str = "size") -> tuple[int, ...]:
    """``f(2, 3)``, ``f((2, 3))``, ``f([2, 3])``, ``f(torch.Size(...))`` or ``f(size=...)`` -> ``(2, 3)``."""
    if keyword is not None:
        check(not args, lambda: f"{op}() got multiple values for argument '{name}'", TypeError)
        args = (keyword,)
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = tuple(args[0])
    # a one-element integer tensor is a size as in eager, which reads its value (a split point under fulmen.jit)
    args = tuple(operator.index(s) if isinstance(s, TensorProxy) else s for s in args)
    for s in args:
        check(isinstance(s, INT_TYPES) and not isinstance(s, bool),
              lambda: f"{op}(): argument '{name}' must be tuple of ints, but found element of type "
              f"{type(s).__name__} ({s!r})", TypeError)
    return tuple(args)


def fresh(out: TensorProxy, *inputs: TensorProxy) -> TensorProxy:
    """``out``, or a copy of it when it is one of ``inputs`` (ops that copy must not return their input)."""
    return clone(out) if any(out is i for i in inputs) else out


def _check_tensor(a, op: str) -> None:
    check(isinstance(a, TensorProxy), lambda: f"{op}(): argument 'input' must be Tensor, not {type(a).__name__}",
          TypeError)


# ---------------------------------------------------------------------------------------------------------
# reshaping


@view_symbol(torch.Tensor.view, method_name="view", tags=_SHAPE)
def view(a, *shape, size=None, dtype=None):
    """``Tensor.view(*shape)``: same elements, new shape; errors when the strides do not allow it, as eager."""
    if dtype is not None or (len(shape) == 1 and isinstance(shape[0], torch.dtype)):
        raise NotImplementedError("Tensor.view(dtype) (reinterpreting the bytes as another dtype) is not supported "
                                  "by fulmen.jit; use Tensor.to(dtype) to convert values instead")
    shape = clang.infer_shape(sizes_arg("view", shape, size), a.numel())
    check_viewable(torch.Tensor.view, a, shape)
    return clang.reshape(a, shape)


@view_symbol(torch.Tensor.reshape, torch.reshape, id="torch.reshape", method_name="reshape", tags=_SHAPE)
def reshape(a, *shape_args, shape=None):
    """``torch.reshape``: a view when the strides allow it, otherwise a copy (decided as eager decides)."""
    _check_tensor(a, "reshape")
    return clang.reshape(a, clang.infer_shape(sizes_arg("reshape", shape_args, shape, name="shape"), a.numel()))


@view_symbol(torch.Tensor.view_as, method_name="view_as", tags=_SHAPE)
def view_as(a, other):
    check_viewable(torch.Tensor.view, a, tuple(other.shape))
    return clang.reshape(a, clang.infer_shape(other.shape, a.numel()))


@view_symbol(torch.Tensor.reshape_as, method_name="reshape_as", tags=_SHAPE)
def reshape_as(a, other):
    return clang.reshape(a, clang.infer_shape(other.shape, a.numel()))


@view_symbol(torch.Tensor.flatten, torch.flatten, id="torch.flatten", method_name="flatten", tags=_SHAPE,
             may_return_input=True)
def flatten(a, start_dim: int = 0, end_dim: int = -1):
    _check_tensor(a, "flatten")
    if a.ndim == 0:
        canonicalize_dim(0, start_dim), canonicalize_dim(0, end_dim)
        return clang.reshape(a, (1,))
    s, e = canonicalize_dim(a.ndim, start_dim), canonicalize_dim(a.ndim, end_dim)
    check(s <= e, lambda: "flatten() has invalid args: start_dim cannot come after end_dim")
    if s == e:
        return a
    return clang.reshape(a, tuple(a.shape[:s]) + (prod(a.shape[s:e + 1]),) + tuple(a.shape[e + 1:]))


@view_symbol(torch.Tensor.unflatten, torch.unflatten, id="torch.unflatten", method_name="unflatten", tags=_SHAPE)
def unflatten(a, dim: int, sizes):
    dim = canonicalize_dim(a.ndim, dim)
    sizes = sizes_arg("unflatten", (sizes,), name="sizes")
    check(len(sizes) > 0, lambda: "unflatten: sizes must be non-empty", RuntimeError)
    n = a.shape[dim]
    known = prod(s for s in sizes if s != -1)
    inferred = [i for i, s in enumerate(sizes) if s == -1]
    ok = len(inferred) <= 1 and (known == n if not inferred else known != 0 and n % known == 0)
    check(ok, lambda: f"unflatten: Provided sizes {list(sizes)} don't multiply up to the size of dim {dim} ({n}) in "
          "the input tensor", RuntimeError)
    sizes = tuple(n // known if s == -1 else s for s in sizes)
    return clang.reshape(a, tuple(a.shape[:dim]) + sizes + tuple(a.shape[dim + 1:]))


@view_symbol(torch.Tensor.squeeze, torch.squeeze, id="torch.squeeze", method_name="squeeze", tags=_SHAPE)
def squeeze(a, dim=None):
    """``torch.squeeze``: drop length-1 dims (all, one, or a tuple); a named dim that is not 1 stays."""
    if dim is None:
        return clang.squeeze(a)
    dims = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
    canonical = [canonicalize_dim(a.ndim, d) for d in dims]
    check(len(set(canonical)) == len(canonical),
          lambda: f"dim {canonical[0]} appears multiple times in the list of dims", RuntimeError)
    return clang.squeeze(a, canonical)


@view_symbol(torch.Tensor.unsqueeze, torch.unsqueeze, id="torch.unsqueeze", method_name="unsqueeze", tags=_SHAPE)
def unsqueeze(a, dim: int):
    return clang.unsqueeze(a, dim)


# ---------------------------------------------------------------------------------------------------------
# permuting


@view_symbol(torch.Tensor.permute, torch.permute, id="torch.permute", method_name="permute", tags=_SHAPE)
def permute(a, *dims_args, dims=None):
    dims = sizes_arg("permute", dims_args, dims, name="dims")
    return clang.permute(a, dims)


@view_symbol(torch.Tensor.transpose, torch.transpose, id="torch.transpose", method_name="transpose", tags=_SHAPE)
def transpose(a, dim0: int, dim1: int):
    return clang.transpose(a, dim0, dim1)


@view_symbol(torch.Tensor.swapaxes, torch.swapaxes, id="torch.swapaxes", method_name="swapaxes", tags=_SHAPE)
def swapaxes(a, axis0: int, axis1: int):
    return clang.transpose(a, axis0, axis1)


@view_symbol(torch.Tensor.swapdims, torch.swapdims, id="torch.swapdims", method_name="swapdims", tags=_SHAPE)
def swapdims(a, dim0: int, dim1: int):
    return clang.transpose(a, dim0, dim1)


@view_symbol(torch.Tensor.t, torch.t, id="torch.t", method_name="t", tags=_SHAPE)
def t(a):
    check(a.ndim <= 2, lambda: f"t() expects a tensor with <= 2 dimensions, but self is {a.ndim}D", RuntimeError)
    return clang.transpose(a, 0, 1) if a.ndim == 2 else a


@view_symbol(id="torch.Tensor.T", property_name="T", meta_fn=lambda x: x.permute(tuple(range(x.ndim - 1, -1, -1))),
             tags=_SHAPE)
def T(a):
    """``Tensor.T``: all dims reversed (torch deprecates it for other than 2-D tensors, but allows it)."""
    return clang.permute(a, tuple(range(a.ndim - 1, -1, -1)))


@view_symbol(id="torch.Tensor.mT", property_name="mT", meta_fn=lambda x: x.mT, tags=_SHAPE)
def mT(a):
    """``Tensor.mT``: the last two dims swapped."""
    check(a.ndim >= 2, lambda: f"tensor.mT is only supported on matrices or batches of matrices. Got {a.ndim}-D "
          "tensor.", RuntimeError)
    return clang.transpose(a, -2, -1)


def adjoint(a):
    """``torch.adjoint``: the conjugate transpose of the last two dims; a view of ``a`` (through ``mT`` and
    ``conj``), so writes through it reach ``a`` conjugated back."""
    check(isinstance(a, TensorProxy), lambda: f"adjoint(): argument 'input' must be Tensor, not {type(a).__name__}",
          TypeError)
    check(a.ndim >= 2, lambda: f"tensor.adjoint() is only supported on matrices or batches of matrices. Got "
          f"{a.ndim}-D tensor.", RuntimeError)
    t = mT(a)
    return conj(t) if a.dtype.is_complex else t


register_function((torch.Tensor.adjoint, torch.adjoint), adjoint, method_names=("adjoint",))


def _mH(a):
    check(a.ndim >= 2, lambda: f"tensor.mH is only supported on matrices or batches of matrices. Got {a.ndim}-D "
          "tensor.", RuntimeError)
    return adjoint(a)


def _H(a):
    check(a.ndim in (0, 2), lambda: f"tensor.H is only supported on matrices (2-D tensors). Got {a.ndim}-D tensor.",
          RuntimeError)
    return adjoint(a) if a.ndim == 2 else conj(a)


langctx.properties["mH"] = _mH
langctx.properties["H"] = _H


@view_symbol(torch.Tensor.movedim, torch.movedim, torch.moveaxis, torch.Tensor.moveaxis, id="torch.movedim",
             method_name=("movedim", "moveaxis"), tags=_SHAPE)
def movedim(a, source, destination):
    src = (source,) if isinstance(source, int) else tuple(source)
    dst = (destination,) if isinstance(destination, int) else tuple(destination)
    check(len(src) == len(dst), lambda: f"movedim: Invalid source or destination dims: source ({list(src)} dims) "
          f"should contain the same number of dims as destination ({list(dst)} dims)", RuntimeError)
    rank = max(a.ndim, 1)
    src = tuple(canonicalize_dim(a.ndim, d) for d in src)
    dst = tuple(canonicalize_dim(a.ndim, d) for d in dst)
    check(len(set(src)) == len(src), lambda: f"movedim: repeated dim in `source` ({list(source)})", RuntimeError)
    check(len(set(dst)) == len(dst), lambda: f"movedim: repeated dim in `destination` ({list(destination)})",
          RuntimeError)
    if a.ndim == 0:
        return a
    order = [-1] * rank
    for s, d in zip(src, dst):
        order[d] = s
    rest = iter(i for i in range(rank) if i not in src)
    order = [o if o != -1 else next(rest) for o in order]
    return clang.permute(a, order)


# ---------------------------------------------------------------------------------------------------------
# broadcasting


def _expanded_shape(a, sizes: Sequence[int], op: str) -> tuple[int, ...]:
    check(len(sizes) >= a.ndim, lambda: f"{op}: the number of sizes provided ({len(sizes)}) must be greater or equal "
          f"to the number of dimensions in the tensor ({a.ndim})", RuntimeError)
    offset = len(sizes) - a.ndim
    out = []
    for i, s in enumerate(sizes):
        if i < offset:
            check(s >= 0, lambda: f"The expanded size of the tensor ({s}) isn't allowed in a leading, non-existing "
                  f"dimension {i}", RuntimeError)
            out.append(s)
            continue
        have = a.shape[i - offset]
        s = have if s == -1 else s
        check(have == 1 or have == s, lambda: f"The expanded size of the tensor ({s}) must match the existing size "
              f"({have}) at non-singleton dimension {i}.  Target sizes: {list(sizes)}.  Tensor sizes: "
              f"{list(a.shape)}", RuntimeError)
        check(s >= 0, lambda: f"Trying to create tensor with negative dimension {s}: {list(sizes)}", RuntimeError)
        out.append(s)
    return tuple(out)


@view_symbol(torch.Tensor.expand, method_name="expand", tags=_SHAPE)
def expand(a, *sizes, size=None, implicit: bool = False):
    """``Tensor.expand``: length-1 dims repeat without copying; ``-1`` keeps a dim."""
    return clang.expand_to(a, _expanded_shape(a, sizes_arg("expand", sizes, size), "expand"))


@view_symbol(torch.Tensor.expand_as, method_name="expand_as", tags=_SHAPE)
def expand_as(a, other):
    return clang.expand_to(a, _expanded_shape(a, tuple(other.shape), "expand_as"))


@view_symbol(torch.Tensor.broadcast_to, torch.broadcast_to, id="torch.broadcast_to", method_name="broadcast_to",
             tags=_SHAPE)
def broadcast_to(a, size):
    return clang.expand_to(a, _expanded_shape(a, sizes_arg("broadcast_to", (size,)), "broadcast_to"))


@torchsymbol(torch.broadcast_tensors, tags=_SHAPE)
def broadcast_tensors(*tensors):
    """``torch.broadcast_tensors``: each tensor expanded to the common shape (not tracked as views)."""
    if len(tensors) == 1 and isinstance(tensors[0], (tuple, list)):
        tensors = tuple(tensors[0])
    shape = clang.broadcast_shapes(*(t.shape for t in tensors))
    return tuple(clang.expand_to(t, shape) for t in tensors)


# ---------------------------------------------------------------------------------------------------------
# joining


def _tensor_list(tensors, op: str) -> list:
    check(isinstance(tensors, (tuple, list)), lambda: f"{op}(): argument 'tensors' must be tuple of Tensors, not "
          f"{type(tensors).__name__}", TypeError)
    for i, x in enumerate(tensors):
        check(isinstance(x, TensorProxy), lambda: f"{op}(): expected Tensor as element {i} in argument 0, but got "
              f"{type(x).__name__}", TypeError)
    return list(tensors)


def _cat(tensors: Sequence[TensorProxy], dim: int, op: str = "cat") -> TensorProxy:
    tensors = _tensor_list(tensors, op)
    check(len(tensors) > 0, lambda: f"torch.{op}(): expected a non-empty list of Tensors", ValueError)
    for i, x in enumerate(tensors):
        check(x.ndim > 0, lambda: f"zero-dimensional tensor (at position {i}) cannot be concatenated", RuntimeError)
    dtype = clang.result_dtype(*tensors)
    # torch still skips 1-D empty tensors whatever the others' shapes (legacy behaviour); they do count for dtype
    kept = [x for x in tensors if tuple(x.shape) != (0,)]
    if not kept:
        return fresh(clang.maybe_convert_to_dtype(tensors[0], dtype), *tensors)
    dim = canonicalize_dim(kept[0].ndim, dim)
    for x in kept:
        check(x.device == kept[0].device, lambda: f"Expected all tensors to be on the same device, but found at least "
              f"two devices, {kept[0].device} and {x.device}!", RuntimeError)
        check(x.ndim == kept[0].ndim, lambda: f"Tensors must have same number of dimensions: got {kept[0].ndim} and "
              f"{x.ndim}", RuntimeError)
    kept = [clang.maybe_convert_to_dtype(x, dtype) for x in kept]
    out = kept[0] if len(kept) == 1 else prims.cat(kept, dim)
    return fresh(out, *tensors)


@torchsymbol(torch.cat, torch.concat, tags=_SHAPE)
def cat(tensors, dim: int = 0):
    """``torch.cat``: tensors joined along ``dim``, with type promotion; a new tensor."""
    return _cat(tensors, dim)


@torchsymbol(torch.concatenate, tags=_SHAPE)
def concatenate(tensors, axis: int = 0, dim: int | None = None):
    return _cat(tensors, axis if dim is None else dim, "concatenate")


@torchsymbol(torch.stack, tags=_SHAPE)
def stack(tensors, dim: int = 0):
    """``torch.stack``: tensors of one shape joined along a new dim."""
    tensors = _tensor_list(tensors, "stack")
    check(len(tensors) > 0, lambda: "stack expects a non-empty TensorList", RuntimeError)
    for i, x in enumerate(tensors):
        check(x.shape == tensors[0].shape, lambda: f"stack expects each tensor to be equal size, but got "
              f"{list(tensors[0].shape)} at entry 0 and {list(x.shape)} at entry {i}", RuntimeError)
    dim = canonicalize_dim(tensors[0].ndim + 1, dim)
    return _cat([clang.unsqueeze(x, dim) for x in tensors], dim, "stack")


def _atleast(a: TensorProxy, ndim: int) -> TensorProxy:
    if a.ndim >= ndim:
        return a
    return clang.reshape(a, (1,) * (ndim - a.ndim) + tuple(a.shape))


@torchsymbol(torch.hstack, tags=_SHAPE)
def hstack(tensors):
    """``torch.hstack``: 1-D tensors joined end to end, others along dim 1."""
    tensors = [_atleast(x, 1) for x in _tensor_list(tensors, "hstack")]
    check(len(tensors) > 0, lambda: "hstack expects a non-empty TensorList", RuntimeError)
    return _cat(tensors, 0 if tensors[0].ndim == 1 else 1, "hstack")


@torchsymbol(torch.vstack, torch.row_stack, tags=_SHAPE)
def vstack(tensors):
    """``torch.vstack``: tensors made at least 2-D and joined along dim 0."""
    tensors = [_atleast(x, 2) for x in _tensor_list(tensors, "vstack")]
    check(len(tensors) > 0, lambda: "vstack expects a non-empty TensorList", RuntimeError)
    return _cat(tensors, 0, "vstack")


# ---------------------------------------------------------------------------------------------------------
# splitting (outputs are views of the input)


def _split_sizes(a, sizes: Sequence[int], dim: int) -> tuple[TensorProxy, ...]:
    outs, start = [], 0
    for s in sizes:
        outs.append(clang.slice_in_dim(a, start, start + s, 1, dim))
        start += s
    return tuple(outs)


def _check_splittable(a, op: str) -> None:
    check(a.ndim > 0, lambda: f"{op} expects at least a 1-dimensional tensor", RuntimeError)


@view_symbol(torch.Tensor.split, torch.split, id="torch.split", method_name="split", tags=_SHAPE)
def split(a, split_size_or_sections, dim: int = 0):
    """``torch.split``: pieces of ``split_size`` (the last may be smaller) or of the listed sizes."""
    _check_splittable(a, "split")
    dim = canonicalize_dim(a.ndim, dim)
    n = a.shape[dim]
    if isinstance(split_size_or_sections, int):
        size = split_size_or_sections
        check(size >= 0, lambda: f"split expects split_size be non-negative, but got split_size={size}", RuntimeError)
        check(size > 0 or n == 0, lambda: f"split_size can only be 0 if dimension size is 0, but got dimension size "
              f"of {n}", RuntimeError)
        pieces = max(-(-n // size), 1) if size else 1
        sizes = [size] * (pieces - 1) + [n - size * (pieces - 1)]
        return _split_sizes(a, sizes, dim)
    return _split_with_sizes(a, split_size_or_sections, dim)


def _split_with_sizes(a, split_sizes, dim):
    sizes = list(split_sizes)
    n = a.shape[dim]
    check(all(isinstance(s, int) and s >= 0 for s in sizes), lambda: f"split_with_sizes expects split_sizes have "
          f"only non-negative entries, but got split_sizes={sizes}", RuntimeError)
    check(sum(sizes) == n, lambda: f"split_with_sizes expects split_sizes to sum exactly to {n} (input tensor's size "
          f"at dimension {dim}), but got split_sizes={sizes}", RuntimeError)
    return _split_sizes(a, sizes, dim)


@view_symbol(torch.Tensor.split_with_sizes, torch.split_with_sizes, id="torch.split_with_sizes",
             method_name="split_with_sizes", tags=_SHAPE)
def split_with_sizes(a, split_sizes, dim: int = 0):
    _check_splittable(a, "split_with_sizes")
    return _split_with_sizes(a, split_sizes, canonicalize_dim(a.ndim, dim))


@view_symbol(torch.Tensor.chunk, torch.chunk, id="torch.chunk", method_name="chunk", tags=_SHAPE)
def chunk(a, chunks: int, dim: int = 0):
    """``torch.chunk``: at most ``chunks`` pieces of ``ceil(n / chunks)`` elements."""
    check(chunks > 0, lambda: f"chunk expects `chunks` to be greater than 0, got: {chunks}", RuntimeError)
    _check_splittable(a, "chunk")
    dim = canonicalize_dim(a.ndim, dim)
    n = a.shape[dim]
    size = -(-n // chunks)
    if n == 0:
        return _split_sizes(a, [0] * chunks, dim)
    pieces = -(-n // size)
    return _split_sizes(a, [size] * (pieces - 1) + [n - size * (pieces - 1)], dim)


@view_symbol(torch.Tensor.tensor_split, torch.tensor_split, id="torch.tensor_split", method_name="tensor_split",
             tags=_SHAPE, separate_views=True)
def tensor_split(a, indices_or_sections, dim: int = 0):
    """``torch.tensor_split``: ``n`` nearly equal pieces, or pieces between the given indices."""
    check(a.ndim > 0, lambda: f"tensor_split expected at least a 1-dimensional tensor, but got a tensor with "
          f"{a.ndim} dims", RuntimeError)
    check(not isinstance(indices_or_sections, TensorProxy), lambda: "tensor_split with a tensor of indices depends "
          "on tensor values; pass a Python int or list of ints", NotImplementedError)
    dim = canonicalize_dim(a.ndim, dim)
    n = a.shape[dim]
    if isinstance(indices_or_sections, int):
        sections = indices_or_sections
        check(sections > 0, lambda: f"number of sections must be larger than 0, got {sections}", RuntimeError)
        small, extra = divmod(n, sections)
        return _split_sizes(a, [small + 1] * extra + [small] * (sections - extra), dim)
    outs, start = [], 0
    for b in list(indices_or_sections) + [n]:
        b = min(max(b + n if b < 0 else b, 0), n)
        outs.append(clang.slice_in_dim(a, start, max(b, start), 1, dim))  # a piece ends where the next begins
        start = b
    return tuple(outs)


@view_symbol(torch.Tensor.unbind, torch.unbind, id="torch.unbind", method_name="unbind", tags=_SHAPE)
def unbind(a, dim: int = 0):
    """``torch.unbind``: the slices along ``dim``, each without that dim."""
    check(a.ndim > 0, lambda: "Dimension specified as 0 but tensor has no dimensions", IndexError)
    dim = canonicalize_dim(a.ndim, dim)
    return tuple(clang.squeeze(clang.slice_in_dim(a, i, i + 1, 1, dim), (dim,)) for i in range(a.shape[dim]))


def _narrow_at(a, dim: int, start: TensorProxy, length: int):
    """``narrow`` from a 0-d integer tensor ``start`` (its value is read on every call): the rows ``start + i``
    taken with an index, a negative start counting from the end as eager's. An index past the end raises at run
    time, as eager's narrow does."""
    check(start.ndim == 0 and dtypes.is_exact_dtype(start.dtype) and start.dtype is not torch.bool,
          lambda: f"narrow(): start must be a 0-dim integral Tensor, got {start.dtype}{list(start.shape)}",
          RuntimeError)
    n = a.shape[dim]
    start = clang.maybe_convert_to_dtype(start, torch.int64)
    start = clang.where(clang.elementwise_binary(start, 0, prims.lt, clang.TypePromotion.ALWAYS_BOOL),
                        clang.add(start, n), start)
    rows = clang.add(prims.iota(length, start=0, step=1, device=a.device, dtype=torch.int64), start)
    return prims.take(a, rows, dim)


def _narrow_layout(a, dim, start, length):
    # a view's strides do not depend on where it starts: meta tensors cannot read a tensor start (eager's .item())
    return torch.narrow(a, dim, 0 if isinstance(start, torch.Tensor) else start, length)


@view_symbol(torch.Tensor.narrow, torch.narrow, id="torch.narrow", method_name="narrow", tags=_SHAPE,
             meta_fn=_narrow_layout)
def narrow(a, dim: int, start: int, length: int):
    check(a.ndim > 0, lambda: "narrow() cannot be applied to a 0-dim tensor.", RuntimeError)
    check(length >= 0, lambda: "narrow(): length must be non-negative.", RuntimeError)
    dim = canonicalize_dim(a.ndim, dim)
    n = a.shape[dim]
    if isinstance(start, TensorProxy):
        return _narrow_at(a, dim, start, length)
    check(-n <= start <= n, lambda: f"start out of range (expected to be in range of [{-n}, {n}], but got {start})",
          IndexError)
    start = start + n if start < 0 else start
    check(start <= n - length, lambda: f"start ({start}) + length ({length}) exceeds dimension size ({n}).",
          RuntimeError)
    return clang.slice_in_dim(a, start, start + length, 1, dim)


@view_symbol(torch.Tensor.select, torch.select, id="torch.select", method_name="select", tags=_SHAPE)
def select(a, dim: int, index: int):
    check(a.ndim > 0, lambda: "select() cannot be applied to a 0-dim tensor.", IndexError)
    dim = canonicalize_dim(a.ndim, dim)
    n = a.shape[dim]
    check(-n <= index < n, lambda: f"select(): index {index} out of range for tensor of size {list(a.shape)} at "
          f"dimension {dim}", IndexError)
    index = index + n if index < 0 else index
    return clang.squeeze(clang.slice_in_dim(a, index, index + 1, 1, dim), (dim,))


@view_symbol(torch.Tensor.diagonal, torch.diagonal, id="torch.diagonal", method_name="diagonal", tags=_SHAPE)
def diagonal(a, offset: int = 0, dim1: int = 0, dim2: int = 1):
    """``torch.diagonal``: elements ``(i, i + offset)`` of the ``dim1``/``dim2`` planes, as a new last dim."""
    d1, d2 = canonicalize_dim(a.ndim, dim1), canonicalize_dim(a.ndim, dim2)
    check(d1 != d2, lambda: f"diagonal dimensions cannot be identical {dim1}, {dim2}", RuntimeError)
    return diagonal_of(a, offset, d1, d2)


def diagonal_of(a: TensorProxy, offset: int, d1: int, d2: int) -> TensorProxy:
    """The diagonal as a strided slice of the flattened ``(m, n)`` plane (step ``n + 1``)."""
    batch = [i for i in range(a.ndim) if i not in (d1, d2)]
    m, n = a.shape[d1], a.shape[d2]
    length = max(0, min(m, n - offset)) if offset >= 0 else max(0, min(m + offset, n))
    x = clang.permute(a, batch + [d1, d2])
    x = clang.reshape(x, tuple(a.shape[i] for i in batch) + (m * n,))
    if length == 0:
        return clang.slice_in_dim(x, 0, 0, 1, x.ndim - 1)
    start = offset if offset >= 0 else -offset * n
    return clang.slice_in_dim(x, start, start + (length - 1) * (n + 1) + 1, n + 1, x.ndim - 1)


@view_symbol(torch.Tensor.unfold, method_name="unfold", tags=_SHAPE)
def unfold(a, dimension: int, size: int, step: int):
    """``Tensor.unfold``: windows of ``size`` every ``step`` along ``dimension``, as a new last dim."""
    return prims.unfold(a, dimension, size, step)


@view_symbol(torch.as_strided, torch.Tensor.as_strided, method_name="as_strided", tags=_SHAPE)
def as_strided(a, size, stride, storage_offset=None):
    """``torch.as_strided``, recorded as one torch call (the view reads ``a``'s storage directly).

    Sizes, strides and offset address the storage ``a`` views, as in eager, for writes through the view too
    (``fulmen.torch.storage_views``); a write through an explicit offset into a program input's storage is refused.
    """
    return opaque_symbol(torch.as_strided)(a, size, stride, storage_offset)


def _as_strided_args(a, size, stride, storage_offset=None):
    return a, size, stride, storage_offset


def _as_strided_hook(bsym) -> None:
    """A view op's hook, then the link of the view to the storage it addresses."""
    _view_hook(bsym)
    a, size, stride, offset = _as_strided_args(*bsym.args, **bsym.kwargs)
    if isinstance(a, TensorProxy) and isinstance(bsym.output, TensorProxy):
        link_to_storage(as_strided, bsym.output, a, size, stride, offset)


as_strided.post_hook = _as_strided_hook


def _contiguous_now(a: TensorProxy) -> TensorProxy:
    return prims.stride_order(a, tuple(range(a.ndim - 1, -1, -1)))


@view_symbol(torch.view_as_real, tags=_SHAPE,
             unview=lambda new: opaque_symbol(torch.view_as_complex)(_contiguous_now(new)))
def view_as_real(a):
    """``torch.view_as_real``: a complex tensor's (real, imaginary) pairs as a new last dim of size 2, sharing
    memory; a write through it gives ``a`` the complex numbers the pairs now make."""
    check(a.dtype.is_complex, lambda: "view_as_real is only supported for complex tensors", RuntimeError)
    return opaque_symbol(torch.view_as_real)(a)


@view_symbol(torch.view_as_complex, tags=_SHAPE, unview=lambda new: opaque_symbol(torch.view_as_real)(new))
def view_as_complex(a):
    """``torch.view_as_complex``: the inverse of ``view_as_real`` (last dim of size 2), sharing memory."""
    return opaque_symbol(torch.view_as_complex)(a)


# ---------------------------------------------------------------------------------------------------------
# memory: contiguous, clone, detach

_FORMAT_ORDER = {
    torch.channels_last: (4, (3, 0, 2, 1), "channels_last"),
    torch.channels_last_3d: (5, (4, 0, 3, 2, 1), "channels_last_3d"),
}


def _stride_order(a, memory_format, op: str):
    if memory_format is torch.contiguous_format:
        return tuple(range(a.ndim - 1, -1, -1))
    check(memory_format is not torch.preserve_format,
          lambda: f"preserve memory format is unsupported by the {op} operator", RuntimeError)
    rank, order, name = _FORMAT_ORDER[memory_format]
    check(a.ndim == rank, lambda: f"required rank {rank} tensor to use {name} format", RuntimeError)
    return order


@view_symbol(torch.Tensor.contiguous, method_name="contiguous", tags=_SHAPE, may_return_input=True)
def contiguous(a, memory_format=torch.contiguous_format):
    """``Tensor.contiguous``: ``a`` itself when already laid out so (as eager's: under no_grad it keeps ``a``'s
    history, and ``y is a``), else a dense copy (``prims.stride_order``)."""
    order = _stride_order(a, memory_format, "contiguous")
    # the layout of a view or a computed value with symbolic sizes is not tracked (taken to be contiguous): a copy
    known = all(type(n) is int for n in a.shape) or (a.view_of is None and a.origin in ("input", "input-leaf"))
    if known and is_contiguous(a, memory_format):
        return a
    return prims.stride_order(a, order)


@torchsymbol(torch.clone, torch.Tensor.clone, method_name="clone", tags=_SHAPE)
def clone(a, *, memory_format=torch.preserve_format):
    """``torch.clone``: a new tensor with ``a``'s values.

    prims has no copy primitive; ``prims.flip`` over no dims is the identity on values and always allocates.
    """
    if memory_format not in (torch.preserve_format, torch.contiguous_format):
        return prims.stride_order(prims.flip(a, ()), _stride_order(a, memory_format, "clone"))
    return prims.flip(a, ())


clone.post_hook = follow_input_layout  # a clone is laid out as eager's: as a dense input, transposed or channels_last


@view_symbol(torch.Tensor.detach, torch.detach, method_name="detach", always_alias=True,
             tags=_SHAPE + (OpTags.NON_DIFFERENTIABLE,))
def detach(a):
    """``Tensor.detach``: the same values, sharing ``a``'s memory, with no gradient flowing back to ``a``.

    Its symbol id is ``torch.Tensor.detach``; autodiff must stop gradients there rather than differentiate the
    decomposition (an identity reshape, so that the result is a distinct value that requires no grad).
    """
    out = prims.reshape(a, tuple(a.shape))
    out.requires_grad = False
    return out


# ``Tensor.data`` reads as ``detach()`` (the same memory, no history)
langctx.properties["data"] = detach


# ---------------------------------------------------------------------------------------------------------
# complex views: conj, real, imag (eager shares memory; a write through them reaches the input)


@view_symbol(torch.conj, torch.Tensor.conj, id="torch.conj", method_name="conj", tags=_SHAPE,
             unview=lambda new: prims.conj(new) if new.dtype.is_complex else new, torch_executable=False,
             may_return_input=True)
def conj(a):
    """``torch.conj``: the complex conjugate, a view of ``a`` (``a`` itself for a real tensor).

    It runs as its decomposition (``prims.conj``, which conjugates physically): a tensor with torch's lazy
    conjugate bit would reach ops that refuse it (``view_as_real``), and fulmen values need no laziness.
    """
    check(isinstance(a, TensorProxy), lambda: f"conj(): argument 'input' must be Tensor, not {type(a).__name__}",
          TypeError)
    return prims.conj(a) if a.dtype.is_complex else a


@view_symbol(torch.conj_physical, torch.Tensor.conj_physical, id="torch.conj_physical",
             method_name="conj_physical", tags=_SHAPE, unview=lambda new: new, may_return_input=True)
def conj_physical(a):
    """``torch.conj_physical``: the complex conjugate as a new tensor (``a`` itself for a real tensor)."""
    check(isinstance(a, TensorProxy), lambda: "conj_physical(): argument 'input' must be Tensor, not "
          f"{type(a).__name__}", TypeError)
    return prims.conj(a) if a.dtype.is_complex else a


def _resolved(a: TensorProxy, bit: int, op: str) -> TensorProxy:
    check(isinstance(a, TensorProxy), lambda: f"{op}(): argument 'input' must be Tensor, not {type(a).__name__}",
          TypeError)
    # fulmen's values are already physical: resolving is a copy where eager copies, else ``a`` itself, as eager's
    return prims.flip(a, ()) if lazy_bits(a)[bit] else a


@torchsymbol(torch.resolve_conj, torch.Tensor.resolve_conj, id="torch.resolve_conj", method_name="resolve_conj",
             tags=_SHAPE, torch_executable=False)
def resolve_conj(a):
    """``torch.resolve_conj``: ``a`` itself unless it is a lazy conjugate (``z.conj()``), then a new tensor."""
    return _resolved(a, 0, "resolve_conj")


@torchsymbol(torch.resolve_neg, torch.Tensor.resolve_neg, id="torch.resolve_neg", method_name="resolve_neg",
             tags=_SHAPE, torch_executable=False)
def resolve_neg(a):
    """``torch.resolve_neg``: ``a`` itself unless it is a lazy negative (``z.conj().imag``), then a new tensor."""
    return _resolved(a, 1, "resolve_neg")


resolve_conj.post_hook = resolve_neg.post_hook = follow_input_layout  # a copy is laid out as eager's (empty_like)


def real(a):
    """``torch.real`` / ``Tensor.real``: the real parts, a view of ``a`` (``a`` itself for a real tensor)."""
    check(isinstance(a, TensorProxy), lambda: f"real(): argument 'input' must be Tensor, not {type(a).__name__}",
          TypeError)
    if not a.dtype.is_complex:
        return a
    out = select(view_as_real(a), -1, 0)
    set_lazy_bits(out, False, lazy_bits(a)[1])  # a conjugate's real parts are its own
    return out


def imag(a):
    """``torch.imag`` / ``Tensor.imag``: the imaginary parts, a view of a complex ``a``."""
    check(isinstance(a, TensorProxy), lambda: f"imag(): argument 'input' must be Tensor, not {type(a).__name__}",
          TypeError)
    check(a.dtype.is_complex, lambda: "imag is not implemented for tensors with non-complex dtypes.", RuntimeError)
    out = select(view_as_real(a), -1, 1)
    conj, neg = lazy_bits(a)
    set_lazy_bits(out, False, conj != neg)  # eager: a conjugate's imaginary parts are a negative view
    return out


register_function((torch.real,), real)
register_function((torch.imag,), imag)
langctx.properties["real"] = real
langctx.properties["imag"] = imag
