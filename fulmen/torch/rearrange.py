"""Torch language: copies that rearrange a tensor -- padding, flipping, rolling, repeating, triangles, diag.

Split from ``shape.py`` (views, reshaping, joining, splitting). None of these return their input proxy: a value the
caller may later update in place must not be the input itself.
"""

from __future__ import annotations

import torch

from fulmen import clang, prims
from fulmen.clang import TypePromotion, maybe_convert_to_dtype
from fulmen.core import langctx
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import OpTags
from fulmen.core.utils import canonicalize_dim, check
from fulmen.torch.elementwise import inplace_variant
from fulmen.torch.registry import torchsymbol
from fulmen.torch.shape import clone, diagonal_of, fresh, sizes_arg

_SHAPE = (OpTags.SHAPE_OP,)

__all__ = ["pad", "flip", "fliplr", "flipud", "roll", "repeat", "repeat_interleave", "tile", "tril", "triu", "diag"]


def _int_op(a, b, prim, kind=TypePromotion.DEFAULT):
    return clang.elementwise_binary(a, b, prim, kind)


_NON_CONSTANT_PAD_HELP = (
    "Supported combinations for non-constant padding:\n  - 2D or 3D input: padding size = 2 (pads last dimension)\n"
    "  - 3D or 4D input: padding size = 4 (pads last 2 dimensions)\n"
    "  - 4D or 5D input: padding size = 6 (pads last 3 dimensions)")


@torchsymbol(torch.nn.functional.pad, tags=_SHAPE)
def pad(a, pad, mode: str = "constant", value=None):
    """``F.pad``: constant (negative pads crop), reflect, replicate and circular padding of the last dims."""
    pads = sizes_arg("pad", (pad,), name="pad")
    check(len(pads) % 2 == 0, lambda: "Padding length must be divisible by 2", RuntimeError)
    k = len(pads) // 2
    check(k <= a.ndim, lambda: f"Padding length should be less than or equal to two times the input dimension but "
          f"got padding length {len(pads)} and input of dimension {a.ndim}", RuntimeError)
    config = {a.ndim - 1 - i: (pads[2 * i], pads[2 * i + 1]) for i in range(k)}
    if mode == "constant":
        for d, (lo, hi) in config.items():
            n = a.shape[d]
            check(n + lo + hi >= 0, lambda: f"The input size {n}, plus negative padding {lo} and {hi} resulted in a "
                  f"negative output size, which is invalid. Check dimension {d} of your input.", RuntimeError)
        fill = maybe_convert_to_dtype(0 if value is None else value, a.dtype)
        return prims.pad(a, fill, [(*config.get(d, (0, 0)), 0) for d in range(a.ndim)])
    check(mode in ("reflect", "replicate", "circular"), lambda: f"Unrecognised padding mode {mode}",
          NotImplementedError)
    check(value is None, lambda: f'Padding mode "{mode}" doesn\'t take in value argument', RuntimeError)
    check(1 <= k <= 3 and a.ndim in (k + 1, k + 2), lambda: f"Padding size {len(pads)} is not supported for "
          f"{a.ndim}D input tensor.\n{_NON_CONSTANT_PAD_HELP}", NotImplementedError)
    out = a
    for d, (lo, hi) in sorted(config.items()):
        n = a.shape[d]
        if mode == "reflect":
            check(lo < n and hi < n, lambda: f"Argument #4: Padding size should be less than the corresponding input "
                  f"dimension, but got: padding ({lo}, {hi}) at dimension {d} of input {list(a.shape)}", RuntimeError)
        elif mode == "circular":
            check(lo <= n and hi <= n, lambda: "Padding value causes wrapping around more than once.", RuntimeError)
        else:
            check(n > 0 or lo + hi <= 0, lambda: f"padding of a dimension of size 0 (dimension {d}) is not possible "
                  "with replicate padding", RuntimeError)
        index = prims.iota(n + lo + hi, start=-lo, step=1, device=a.device, dtype=torch.int64)
        if mode == "reflect":  # -1 -> 1, n -> n - 2: fold at 0 and at n - 1
            folded = clang.elementwise_unary(index, prims.abs)
            index = _int_op(n - 1, clang.elementwise_unary(_int_op(n - 1, folded, prims.sub), prims.abs), prims.sub)
        elif mode == "replicate":
            index = _int_op(_int_op(index, 0, prims.maximum), n - 1, prims.minimum)
        else:
            index = _int_op(index, n, prims.remainder)
        out = prims.take(out, index, d)
    return fresh(out, a)


@torchsymbol(torch.Tensor.flip, torch.flip, id="torch.flip", method_name="flip", tags=_SHAPE)
def flip(a, *dims_args, dims=None):
    """``torch.flip``: elements in reverse order along ``dims``; a new tensor."""
    dims = sizes_arg("flip", dims_args, dims, name="dims")
    canonical = [canonicalize_dim(a.ndim, d) for d in dims]
    check(len(set(canonical)) == len(canonical),
          lambda: f"dim {canonical[0]} appears multiple times in the list of dims", RuntimeError)
    return prims.flip(a, tuple(sorted(canonical)))


@torchsymbol(torch.fliplr, torch.Tensor.fliplr, method_name="fliplr", tags=_SHAPE)
def fliplr(a):
    check(a.ndim >= 2, lambda: "Input must be >= 2-d.", RuntimeError)
    return prims.flip(a, (1,))


@torchsymbol(torch.flipud, torch.Tensor.flipud, method_name="flipud", tags=_SHAPE)
def flipud(a):
    check(a.ndim >= 1, lambda: "Input must be >= 1-d.", RuntimeError)
    return prims.flip(a, (0,))


def _roll_dim(x: TensorProxy, shift: int, dim: int) -> TensorProxy:
    n = x.shape[dim]
    shift = shift % n if n else 0
    if shift == 0:
        return x
    tail = clang.slice_in_dim(x, n - shift, n, 1, dim)
    return prims.cat([tail, clang.slice_in_dim(x, 0, n - shift, 1, dim)], dim)


@torchsymbol(torch.Tensor.roll, torch.roll, id="torch.roll", method_name="roll", tags=_SHAPE)
def roll(a, shifts, dims=None):
    """``torch.roll``: elements shifted cyclically along ``dims`` (over the flattened tensor without dims)."""
    shifts = (shifts,) if isinstance(shifts, int) else tuple(shifts)
    dims = () if dims is None else ((dims,) if isinstance(dims, int) else tuple(dims))
    if not dims:
        check(len(shifts) == 1, lambda: f"shifts and dimensions must align. shifts: {len(shifts)}, dims:0",
              RuntimeError)
        n = a.numel()
        if n == 0 or shifts[0] % n == 0:
            return clone(a)
        return clang.reshape(_roll_dim(clang.reshape(a, (n,)), shifts[0], 0), a.shape)
    check(len(shifts) == len(dims), lambda: f"shifts and dimensions must align. shifts: {len(shifts)}, "
          f"dims:{len(dims)}", RuntimeError)
    out = a
    for s, d in zip(shifts, dims):
        d = canonicalize_dim(a.ndim, d)
        out = _roll_dim(out, s, d) if a.ndim else out
    return fresh(out, a)


@torchsymbol(torch.Tensor.repeat, method_name="repeat", tags=_SHAPE)
def repeat(a, *sizes, repeats=None):
    """``Tensor.repeat``: the whole tensor tiled ``sizes[i]`` times along dim ``i`` (new leading dims allowed)."""
    sizes = sizes_arg("repeat", sizes, repeats, name="repeats")
    check(len(sizes) >= a.ndim, lambda: "Number of dimensions of repeat dims can not be smaller than number of "
          "dimensions of tensor", RuntimeError)
    check(all(s >= 0 for s in sizes), lambda: f"Trying to create tensor with negative dimension "
          f"{min(sizes)}: {list(sizes)}", RuntimeError)
    shape = (1,) * (len(sizes) - a.ndim) + tuple(a.shape)
    # (s0, s1) -> (r0, s0, r1, s1) by broadcasting, then merge each pair
    interleaved = [x for pair in zip(sizes, shape) for x in pair]
    x = prims.broadcast_in_dim(clang.reshape(a, shape), interleaved, tuple(range(1, 2 * len(shape), 2)))
    return fresh(clang.reshape(x, tuple(r * s for r, s in zip(sizes, shape))), a)


@torchsymbol(torch.Tensor.tile, torch.tile, id="torch.tile", method_name="tile", tags=_SHAPE)
def tile(a, *dims_args, dims=None):
    """``torch.tile``: ``repeat`` with missing leading repeat counts taken as 1."""
    dims = sizes_arg("tile", dims_args, dims, name="dims")
    return repeat(a, (1,) * (a.ndim - len(dims)) + dims)


@torchsymbol(torch.repeat_interleave, torch.Tensor.repeat_interleave, method_name="repeat_interleave", tags=_SHAPE)
def repeat_interleave(a, repeats=None, dim=None, *, output_size=None):
    """``torch.repeat_interleave`` with an int ``repeats``: each element repeated in place.

    A tensor of repeats gives an output whose length depends on its values; that form is recorded as an opaque
    torch call (traceable only with ``output_size``).
    """
    if repeats is None or isinstance(repeats, TensorProxy):
        return langctx.fallback[0](torch.repeat_interleave)(a, repeats, dim, output_size=output_size)
    check(repeats >= 0, lambda: "Repeats must be non-negative", RuntimeError)
    if dim is None:
        a, dim = clang.reshape(a, (a.numel(),)), 0
    dim = canonicalize_dim(a.ndim, dim)
    if a.ndim == 0:
        a = clang.reshape(a, (1,))
    x = clang.unsqueeze(a, dim + 1)
    shape = list(x.shape)
    shape[dim + 1] = repeats
    x = clang.expand_to(x, shape)
    merged = tuple(a.shape[:dim]) + (a.shape[dim] * repeats,) + tuple(a.shape[dim + 1:])
    return fresh(clang.reshape(x, merged), a)


def _triangle(a, diagonal: int, lower: bool, op: str):
    check(a.ndim >= 2, lambda: f"{op}: input tensor must have at least 2 dimensions", RuntimeError)
    m, n = a.shape[-2], a.shape[-1]
    rows = clang.reshape(prims.iota(m, start=0, step=1, device=a.device, dtype=torch.int64), (m, 1))
    cols = clang.reshape(prims.iota(n, start=0, step=1, device=a.device, dtype=torch.int64), (1, n))
    keep = _int_op(_int_op(cols, rows, prims.sub), diagonal, prims.le if lower else prims.ge,
                   TypePromotion.ALWAYS_BOOL)
    return clang.where(keep, a, maybe_convert_to_dtype(0, a.dtype))


@torchsymbol(torch.tril, torch.Tensor.tril, method_name="tril", tags=_SHAPE)
def tril(a, diagonal: int = 0):
    """``torch.tril``: elements on and below the ``diagonal``-th diagonal, zeros elsewhere."""
    return _triangle(a, diagonal, True, "tril")


@torchsymbol(torch.triu, torch.Tensor.triu, method_name="triu", tags=_SHAPE)
def triu(a, diagonal: int = 0):
    """``torch.triu``: elements on and above the ``diagonal``-th diagonal, zeros elsewhere."""
    return _triangle(a, diagonal, False, "triu")


@torchsymbol(torch.diag, torch.Tensor.diag, method_name="diag", tags=_SHAPE)
def diag(a, diagonal: int = 0):
    """``torch.diag``: a 1-D tensor placed on a diagonal of a square matrix, or a matrix's diagonal (a copy)."""
    check(a.ndim in (1, 2), lambda: f"diag(): Supports 1D or 2D tensors. Got {a.ndim}D", RuntimeError)
    if a.ndim == 2:
        return fresh(diagonal_of(a, diagonal, 0, 1), a)
    n = a.shape[0]
    size = n + abs(diagonal)
    zero = maybe_convert_to_dtype(0, a.dtype)
    # each value followed by `size` zeros, laid row-major into the matrix from the diagonal's first position
    rows = prims.pad(clang.reshape(a, (n, 1)), zero, [(0, 0, 0), (0, size, 0)])
    flat = clang.reshape(rows, (n * (size + 1),))
    start = max(-diagonal, 0) * size + max(diagonal, 0)
    flat = prims.pad(flat, zero, [(start, size * size - start - n * (size + 1), 0)])
    return clang.reshape(flat, (size, size))


inplace_variant(tril, "tril")
inplace_variant(triu, "triu")
