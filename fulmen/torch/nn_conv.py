"""Torch language: convolution, pooling and interpolation from torch.nn.functional.

Convolutions are ``prims.convolution``. Pooling pads the input (``-inf`` for max, 0 for average), cuts
sliding windows with ``prims.unfold`` and reduces them; adaptive pooling and interpolation are separable,
one spatial dim at a time, with index and weight vectors built from ``prims.iota`` exactly as torch's
kernels compute them (float32 index math for ``nearest``; the computation dtype for linear weights).
"""

from __future__ import annotations

import math
import struct

import torch
import torch.nn.functional as F

from fulmen import clang, prims
from fulmen.core import dtypes
from fulmen.core.symbol import OpTags
from fulmen.core.utils import check
from fulmen.torch.elementwise import (
    add,
    eq,
    floor,
    floor_divide,
    ge,
    logical_and,
    lt,
    mul,
    sub,
    true_divide,
    where,
)
from fulmen.torch.fallback import opaque_symbol
from fulmen.torch.registry import torchsymbol
from fulmen.torch.shape import fresh

__all__ = [
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_max_pool1d", "adaptive_max_pool2d", "interpolate",
]


def _opmath(a):
    return clang.maybe_convert_to_dtype(a, torch.float32) if dtypes.is_low_precision_dtype(a.dtype) else a


def _clamp(a, lo=None, hi=None):
    """min(max(a, lo), hi) with prims (``torch.maximum`` refuses Python numbers; see nn._clamp)."""
    if lo is not None:
        a = clang.elementwise_binary(a, lo, prims.maximum, clang.TypePromotion.NO_OPMATH)
    if hi is not None:
        a = clang.elementwise_binary(a, hi, prims.minimum, clang.TypePromotion.NO_OPMATH)
    return a


def _tuple(x, n: int, what: str, op: str) -> tuple[int, ...]:
    if isinstance(x, int):
        return (x,) * n
    x = tuple(x)
    if len(x) == 1:
        return x * n
    check(len(x) == n, lambda: f"{op}: {what} must either be a single int, or a tuple of {n} ints", RuntimeError)
    return x


def _f32(x: float) -> float:
    """x rounded to float32, for index math torch does in float."""
    return struct.unpack("f", struct.pack("f", x))[0]


# ---------------------------------------------------------------------------------------------------------
# convolution


def _conv(input, weight, bias, stride, padding, dilation, groups, n: int, name: str):
    check(input.ndim in (n + 1, n + 2), lambda: f"Expected {n + 1}D (unbatched) or {n + 2}D (batched) input to "
          f"{name}, but got input of size: {list(input.shape)}", RuntimeError)
    check(weight.ndim == n + 2, lambda: f"weight should have at least three dimensions, but got {weight.ndim}D weight "
          f"for {name}", RuntimeError)
    check(isinstance(groups, int) and groups > 0, lambda: "non-positive groups is not supported", RuntimeError)
    unbatched = input.ndim == n + 1
    x = clang.unsqueeze(input, 0) if unbatched else input
    stride, dilation = _tuple(stride, n, "stride", name), _tuple(dilation, n, "dilation", name)
    check(all(s > 0 for s in stride), lambda: "non-positive stride is not supported", RuntimeError)
    kernel = weight.shape[2:]
    if isinstance(padding, str):
        check(padding in ("same", "valid"), lambda: f"Invalid padding string: '{padding}'", RuntimeError)
        if padding == "valid":
            padding = (0,) * n
        else:
            check(all(s == 1 for s in stride), lambda: "padding='same' is not supported for strided convolutions",
                  RuntimeError)
            total = [d * (k - 1) for d, k in zip(dilation, kernel)]
            left = [t // 2 for t in total]
            extra = [t - lo - lo for t, lo in zip(total, left)]
            if any(extra):  # an odd total: torch pads the right side by the difference first
                config = [(0, 0, 0), (0, 0, 0)] + [(0, e, 0) for e in extra]
                x = prims.pad(x, 0.0 if dtypes.is_inexact_dtype(x.dtype) else 0, config)
            padding = tuple(left)
    padding = _tuple(padding, n, "padding", name)
    check(all(p >= 0 for p in padding), lambda: "negative padding is not supported", RuntimeError)
    out = prims.convolution(x, weight, bias, stride, padding, dilation, False, (0,) * n, groups)
    return clang.squeeze(out, (0,)) if unbatched else out


@torchsymbol(F.conv1d, tags=(OpTags.MATMUL_OP,))
def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups: int = 1):
    """1-D convolution; ``padding`` may be an int, a tuple, ``"valid"`` or ``"same"``."""
    return _conv(input, weight, bias, stride, padding, dilation, groups, 1, "conv1d")


@torchsymbol(F.conv2d, tags=(OpTags.MATMUL_OP,))
def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups: int = 1):
    """2-D convolution; ``padding`` may be an int, a tuple, ``"valid"`` or ``"same"``."""
    return _conv(input, weight, bias, stride, padding, dilation, groups, 2, "conv2d")


@torchsymbol(F.conv3d, tags=(OpTags.MATMUL_OP,))
def conv3d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups: int = 1):
    """3-D convolution; ``padding`` may be an int, a tuple, ``"valid"`` or ``"same"``."""
    return _conv(input, weight, bias, stride, padding, dilation, groups, 3, "conv3d")


def _conv_transpose(input, weight, bias, stride, padding, output_padding, groups, dilation, n: int, name: str):
    check(input.ndim in (n + 1, n + 2), lambda: f"Expected {n + 1}D (unbatched) or {n + 2}D (batched) input to "
          f"{name}, but got input of size: {list(input.shape)}", RuntimeError)
    check(weight.ndim == n + 2, lambda: f"{name}: expected a {n + 2}D weight, got {weight.ndim}D", RuntimeError)
    unbatched = input.ndim == n + 1
    x = clang.unsqueeze(input, 0) if unbatched else input
    check(x.shape[1] == weight.shape[0], lambda: f"Given transposed=1, weight of size {list(weight.shape)}, expected "
          f"input{list(x.shape)} to have {weight.shape[0]} channels, but got {x.shape[1]} channels instead",
          RuntimeError)
    stride, padding = _tuple(stride, n, "stride", name), _tuple(padding, n, "padding", name)
    output_padding, dilation = _tuple(output_padding, n, "output_padding", name), _tuple(dilation, n, "dilation", name)
    for op, s, d in zip(output_padding, stride, dilation):
        check(op < s or op < d, lambda: f"output padding must be smaller than either stride or dilation, but got "
              f"output_padding={list(output_padding)}, stride={list(stride)}, dilation={list(dilation)}", RuntimeError)
    out = prims.convolution(x, weight, bias, stride, padding, dilation, True, output_padding, groups)
    return clang.squeeze(out, (0,)) if unbatched else out


@torchsymbol(F.conv_transpose1d, tags=(OpTags.MATMUL_OP,))
def conv_transpose1d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups: int = 1, dilation=1):
    return _conv_transpose(input, weight, bias, stride, padding, output_padding, groups, dilation, 1,
                           "conv_transpose1d")


@torchsymbol(F.conv_transpose2d, tags=(OpTags.MATMUL_OP,))
def conv_transpose2d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups: int = 1, dilation=1):
    return _conv_transpose(input, weight, bias, stride, padding, output_padding, groups, dilation, 2,
                           "conv_transpose2d")


@torchsymbol(F.conv_transpose3d, tags=(OpTags.MATMUL_OP,))
def conv_transpose3d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups: int = 1, dilation=1):
    return _conv_transpose(input, weight, bias, stride, padding, output_padding, groups, dilation, 3,
                           "conv_transpose3d")


# ---------------------------------------------------------------------------------------------------------
# pooling


def _pool_output_size(length, k, s, p, d, ceil_mode) -> int:
    """torch's ``pooling_output_shape``: the last window must start inside the input or its left padding."""
    out = (length + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= length + p:
        out -= 1
    return out


def _pool_args(input, kernel_size, stride, padding, dilation, ceil_mode, n, name):
    check(input.ndim in (n + 1, n + 2), lambda: f"{name}: Expected {n + 1}D or {n + 2}D (batch mode) tensor with "
          f"optional 0 dim batch size for input, but got: {list(input.shape)}", RuntimeError)
    kernel = _tuple(kernel_size, n, "kernel_size", name)
    stride = kernel if stride is None or (not isinstance(stride, int) and len(stride) == 0) else \
        _tuple(stride, n, "stride", name)
    padding, dilation = _tuple(padding, n, "padding", name), _tuple(dilation, n, "dilation", name)
    check(all(k > 0 for k in kernel), lambda: f"{name}: kernel_size must be greater than zero, but got "
          f"{list(kernel)}", RuntimeError)
    check(all(s > 0 for s in stride), lambda: f"{name}: stride must be greater than zero, but got {list(stride)}",
          RuntimeError)
    check(all(d > 0 for d in dilation), lambda: f"{name}: dilation must be greater than zero, but got "
          f"{list(dilation)}", RuntimeError)
    for k, p, d in zip(kernel, padding, dilation):
        check(0 <= p <= (d * (k - 1) + 1) // 2, lambda: f"pad should be at most half of effective kernel size, but got "
              f"pad={p}, kernel_size={k} and dilation={d}", RuntimeError)
    spatial = input.shape[input.ndim - n:]
    outs = tuple(_pool_output_size(L, k, s, p, d, ceil_mode)
                 for L, k, s, p, d in zip(spatial, kernel, stride, padding, dilation))
    check(all(o > 0 for o in outs), lambda: f"Given input size: ({'x'.join(str(s) for s in input.shape[-n - 1:])}). "
          f"Calculated output size: ({'x'.join(str(s) for s in (input.shape[-n - 1], *outs))}). Output size is too "
          "small", RuntimeError)
    return kernel, stride, padding, dilation, outs


def _windows(x, kernel, stride, padding, dilation, outs, pad_value):
    """(..., o1, .., on, k1, .., kn): every pooling window of the last n dims, padded with ``pad_value``."""
    n = len(kernel)
    lead = x.ndim - n
    config = [(0, 0, 0)] * lead
    for L, k, s, p, d, o in zip(x.shape[lead:], kernel, stride, padding, dilation, outs):
        needed = (o - 1) * s + d * (k - 1) + 1
        config.append((p, needed - L - p, 0))  # a negative high end crops what no window reaches
    if any(lo or hi for lo, hi, _ in config):
        x = prims.pad(x, pad_value, config)
    for i, (k, s, d) in enumerate(zip(kernel, stride, dilation)):
        x = prims.unfold(x, lead + i, d * (k - 1) + 1, s)
    if any(d > 1 for d in dilation):
        starts, ends, steps = [0] * x.ndim, list(x.shape), [1] * x.ndim
        for i, d in enumerate(dilation):
            steps[x.ndim - n + i] = d
        x = prims.slice_prim(x, starts, ends, steps)
    return x


def _pool_pick(values, positions, dims, size):
    """The input position eager's max-pool kernels pick in each window over ``dims``: the last NaN, else the first
    maximum, in input order. ``positions`` are the flat input positions (``size`` of them), -1 where padded,
    broadcasting to ``values``.

    The output is then gathered at that position, so the gradient goes to it alone, as eager's
    ``max_pool*_with_indices_backward`` scatters it, rather than split among tied maxima."""
    m = prims.amax(values, dims)
    kept = tuple(i for i in range(values.ndim) if i not in dims)
    m = prims.broadcast_in_dim(m, tuple(values.shape), kept)
    valid = ge(positions, 0)
    # one int key per element whose largest is the pick: NaNs above the maxima, later NaNs and earlier maxima first
    key = where(logical_and(prims.isnan(values), valid), add(positions, size),
                where(logical_and(eq(values, m), valid), sub(size - 1, positions), -1))
    key = prims.amax(key, dims)
    return where(ge(key, size), sub(key, size), sub(size - 1, key))


def _max_pool(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices, n, name):
    check(not return_indices, lambda: f"{name}(return_indices=True) is traced as an opaque torch call, not through "
          "this symbol", NotImplementedError)
    kernel, stride, padding, dilation, outs = _pool_args(input, kernel_size, stride, padding, dilation, ceil_mode,
                                                         n, name)
    low = -math.inf if dtypes.is_inexact_dtype(input.dtype) else torch.iinfo(input.dtype).min
    w = _windows(input, kernel, stride, padding, dilation, outs, low)
    lead, spatial = tuple(input.shape[:input.ndim - n]), tuple(input.shape[input.ndim - n:])
    size = math.prod(spatial)
    positions = clang.reshape(prims.iota(size, start=0, step=1, device=input.device, dtype=torch.int64), spatial)
    positions = _windows(positions, kernel, stride, padding, dilation, outs, -1)
    picked = _pool_pick(w, positions, tuple(range(w.ndim - n, w.ndim)), size)
    out_count = math.prod(outs)
    flat = prims.take_along_axis(clang.reshape(input, (*lead, size)), clang.reshape(picked, (*lead, out_count)),
                                 len(lead))
    return clang.reshape(flat, (*lead, *outs))


@torchsymbol(F.max_pool1d, torch.max_pool1d, tags=(OpTags.REDUCTION,))
def max_pool1d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
               return_indices: bool = False):
    return _max_pool(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices, 1, "max_pool1d")


@torchsymbol(F.max_pool2d, torch.max_pool2d, tags=(OpTags.REDUCTION,))
def max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
               return_indices: bool = False):
    return _max_pool(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices, 2, "max_pool2d")


@torchsymbol(F.max_pool3d, torch.max_pool3d, tags=(OpTags.REDUCTION,))
def max_pool3d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
               return_indices: bool = False):
    return _max_pool(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices, 3, "max_pool3d")


def _window_counts(length, o, k, s, p, count_include_pad, device):
    """How many elements each output position of one dim averages over (torch's ``pool_size`` / valid count)."""
    start = sub(mul(prims.iota(o, start=0, step=1, device=device, dtype=torch.int64), s), p)
    end = _clamp(add(start, k), hi=length + p)
    if count_include_pad:
        return sub(end, start)
    return sub(_clamp(end, hi=length), _clamp(start, 0))


def _avg_pool(input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, n, name):
    kernel, stride, padding, dilation, outs = _pool_args(input, kernel_size, stride, padding, 1, ceil_mode, n, name)
    check(divisor_override is None or divisor_override != 0, lambda: "divisor must be not zero", RuntimeError)
    x = _opmath(input)
    w = _windows(x, kernel, stride, padding, dilation, outs, 0.0 if dtypes.is_inexact_dtype(x.dtype) else 0)
    total = prims.sum(w, tuple(range(w.ndim - n, w.ndim)))
    if divisor_override is not None:
        out = true_divide(total, divisor_override)
    else:
        divisor = None
        lead = input.ndim - n
        for i, (L, o, k, s, p) in enumerate(zip(input.shape[lead:], outs, kernel, stride, padding)):
            counts = _window_counts(L, o, k, s, p, count_include_pad, input.device)
            shape = [1] * n
            shape[i] = o
            counts = prims.broadcast_in_dim(counts, tuple(shape), (i,))
            divisor = counts if divisor is None else mul(divisor, counts)
        out = true_divide(total, clang.maybe_convert_to_dtype(divisor, total.dtype))
    return clang.maybe_convert_to_dtype(out, input.dtype)


@torchsymbol(F.avg_pool1d, tags=(OpTags.REDUCTION,))
def avg_pool1d(input, kernel_size, stride=None, padding=0, ceil_mode: bool = False, count_include_pad: bool = True):
    return _avg_pool(input, kernel_size, stride, padding, ceil_mode, count_include_pad, None, 1, "avg_pool1d")


@torchsymbol(F.avg_pool2d, tags=(OpTags.REDUCTION,))
def avg_pool2d(input, kernel_size, stride=None, padding=0, ceil_mode: bool = False, count_include_pad: bool = True,
               divisor_override: int | None = None):
    return _avg_pool(input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 2,
                     "avg_pool2d")


@torchsymbol(F.avg_pool3d, tags=(OpTags.REDUCTION,))
def avg_pool3d(input, kernel_size, stride=None, padding=0, ceil_mode: bool = False, count_include_pad: bool = True,
               divisor_override: int | None = None):
    return _avg_pool(input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 3,
                     "avg_pool3d")


def _adaptive_output(input, output_size, n, name):
    check(input.ndim in (n + 1, n + 2), lambda: f"{name}(): Expected {n + 1}D or {n + 2}D tensor, but got "
          f"{list(input.shape)}", RuntimeError)
    spatial = input.shape[input.ndim - n:]
    sizes = (output_size,) * n if isinstance(output_size, int) else tuple(output_size)
    check(len(sizes) == n, lambda: f"{name}: output_size must be {n}", RuntimeError)
    sizes = tuple(L if o is None else o for o, L in zip(sizes, spatial))
    for d in range(input.ndim - n):
        check(input.shape[d] > 0 or d == 0, lambda: f"{name}(): Expected input to have non-zero size for non-batch "
              f"dimensions, but input has sizes {list(input.shape)} with dimension {d} being empty", RuntimeError)
    check(all(o >= 0 for o in sizes), lambda: f"{name}: elements of output_size must be greater than or equal to 0 "
          f"but received {list(sizes)}", RuntimeError)
    return sizes


def _adaptive_mask(length, o, device):
    """(o, length) bool: window i covers [floor(i*L/o), ceil((i+1)*L/o))."""
    i = prims.iota(o, start=0, step=1, device=device, dtype=torch.int64)
    start = floor_divide(mul(i, length), o)
    end = floor_divide(add(mul(add(i, 1), length), o - 1), o)
    j = prims.broadcast_in_dim(prims.iota(length, start=0, step=1, device=device, dtype=torch.int64), (o, length), (1,))
    lo, hi = prims.broadcast_in_dim(start, (o, length), (0,)), prims.broadcast_in_dim(end, (o, length), (0,))
    return logical_and(ge(j, lo), lt(j, hi)), sub(end, start)


def _adaptive_pool_dim(x, axis, o, reduce):
    """Pool one dim of x to length o with adaptive windows, moving the dim last and back."""
    length = x.shape[axis]
    if o == length:
        return x
    x_last = clang.transpose(x, axis, -1) if axis != x.ndim - 1 else x
    if reduce == "avg" and o > 0 and length % o == 0:  # equal windows: a reshape and a mean
        k = length // o
        y = true_divide(prims.sum(clang.reshape(x_last, (*x_last.shape[:-1], o, k)), (x_last.ndim,)), k)
    else:
        mask, counts = _adaptive_mask(length, o, x.device)
        batch = x_last.shape[:-1]
        if reduce == "avg":
            weights = true_divide(clang.maybe_convert_to_dtype(mask, x.dtype), prims.broadcast_in_dim(
                clang.maybe_convert_to_dtype(counts, x.dtype), (o, length), (0,)))
            y = prims.matmul(x_last, clang.transpose(weights, 0, 1))
        else:
            # pooling one dim at a time picks the row-major first maximum (last NaN) of the whole window, as eager
            expanded = prims.broadcast_in_dim(x_last, (*batch, o, length), (*range(len(batch)), len(batch) + 1))
            j = prims.broadcast_in_dim(prims.iota(length, start=0, step=1, device=x.device, dtype=torch.int64),
                                       (o, length), (1,))
            picked = _pool_pick(where(mask, expanded, -math.inf), where(mask, j, -1), (len(batch) + 1,), length)
            y = prims.take_along_axis(x_last, picked, len(batch))
    return clang.transpose(y, axis, -1) if axis != x.ndim - 1 else y


def _adaptive_pool(input, output_size, n, name, reduce):
    sizes = _adaptive_output(input, output_size, n, name)
    x = _opmath(input) if reduce == "avg" else input
    for i in reversed(range(n)):
        x = _adaptive_pool_dim(x, input.ndim - n + i, sizes[i], reduce)
    return fresh(clang.maybe_convert_to_dtype(x, input.dtype), input)  # pooling to the same size still copies


@torchsymbol(F.adaptive_avg_pool1d, tags=(OpTags.REDUCTION,))
def adaptive_avg_pool1d(input, output_size):
    return _adaptive_pool(input, output_size, 1, "adaptive_avg_pool1d", "avg")


@torchsymbol(F.adaptive_avg_pool2d, tags=(OpTags.REDUCTION,))
def adaptive_avg_pool2d(input, output_size):
    return _adaptive_pool(input, output_size, 2, "adaptive_avg_pool2d", "avg")


def _adaptive_max(input, output_size, return_indices, n, name):
    check(not return_indices, lambda: f"{name}(return_indices=True) is traced as an opaque torch call",
          NotImplementedError)
    check(dtypes.is_inexact_dtype(input.dtype), lambda: f'"{name}" not implemented for {input.dtype}',
          NotImplementedError)
    return _adaptive_pool(input, output_size, n, name, "max")


@torchsymbol(F.adaptive_max_pool1d, tags=(OpTags.REDUCTION,))
def adaptive_max_pool1d(input, output_size, return_indices: bool = False):
    return _adaptive_max(input, output_size, return_indices, 1, "adaptive_max_pool1d")


@torchsymbol(F.adaptive_max_pool2d, tags=(OpTags.REDUCTION,))
def adaptive_max_pool2d(input, output_size, return_indices: bool = False):
    return _adaptive_max(input, output_size, return_indices, 2, "adaptive_max_pool2d")


# ---------------------------------------------------------------------------------------------------------
# interpolation


_LINEAR_MODES = {"linear": 1, "bilinear": 2, "trilinear": 3}


def _interpolate_sizes(input, size, scale_factor, recompute_scale_factor):
    n = input.ndim - 2
    spatial = list(input.shape[2:])
    if size is not None and scale_factor is not None:
        raise ValueError("only one of size or scale_factor should be defined")
    if size is not None:
        if isinstance(size, (list, tuple)):
            check(len(size) == n, lambda: "Input and output must have the same number of spatial dimensions, but got "
                  f"input with spatial dimensions of {spatial} and output size of {size}. Please provide input tensor "
                  "in (N, C, d1, d2, ...,dK) format and output size in (o1, o2, ...,oK) format.", ValueError)
            out = list(size)
        else:
            out = [size] * n
        scales = [None] * n
    elif scale_factor is not None:
        check(not (recompute_scale_factor and size is not None), lambda: "recompute_scale_factor is not meaningful "
              "with an explicit size.", ValueError)
        if isinstance(scale_factor, (list, tuple)):
            check(len(scale_factor) == n, lambda: "Input and scale_factor must have the same number of spatial "
                  f"dimensions, but got input with spatial dimensions of {spatial} and scale_factor of shape "
                  f"{scale_factor}. Please provide input tensor in (N, C, d1, d2, ...,dK) format and scale_factor in "
                  "(s1, s2, ...,sK) format.", ValueError)
            scales = [float(s) for s in scale_factor]
        else:
            scales = [float(scale_factor)] * n
        out = [math.floor(float(L) * s) for L, s in zip(spatial, scales)]
        if recompute_scale_factor:
            scales = [None] * n
    else:
        raise ValueError("either size or scale_factor should be defined")
    check(all(o > 0 for o in out), lambda: f"Input and output sizes should be greater than 0, but got input "
          f"({', '.join(map(str, spatial))}) and output ({', '.join(map(str, out))})", RuntimeError)
    return out, scales


def _gather_dim(x, axis, index):
    return prims.take(x, index, axis)


def _nearest_dim(x, axis, o, scale):
    length = x.shape[axis]
    if o == length:
        return x
    i = prims.iota(o, start=0, step=1, device=x.device, dtype=torch.int64)
    if o == 2 * length:
        src = floor_divide(i, 2)
    else:
        s = _f32(1.0 / scale) if scale is not None and scale > 0 else _f32(length / o)
        src = clang.maybe_convert_to_dtype(floor(mul(clang.maybe_convert_to_dtype(i, torch.float32), s)), torch.int64)
        src = _clamp(src, hi=length - 1)
    return _gather_dim(x, axis, src)


def _linear_dim(x, axis, o, scale, align_corners, weight_dtype):
    """Linear interpolation along one dim, with torch's source index and lambda computation.

    ``weight_dtype`` is the dtype torch keeps the lambdas in (its generic CPU kernel stores them in the input
    dtype, so bfloat16 lambdas are rounded before interpolating in float32).
    """
    length = x.shape[axis]
    if o == length:
        return x
    comp = x.dtype
    if align_corners:
        ratio = (length - 1) / (o - 1) if o > 1 else 0.0
    else:
        ratio = 1.0 / scale if scale is not None and scale > 0 else float(length) / o
    if comp is torch.float32:  # torch computes the ratio in the computation dtype
        ratio = _f32(ratio)
    i = clang.maybe_convert_to_dtype(prims.iota(o, start=0, step=1, device=x.device, dtype=torch.int64), comp)
    if align_corners:
        real = mul(i, ratio)
    else:
        real = sub(mul(add(i, 0.5), ratio), 0.5)
        real = where(lt(real, 0), 0.0, real)
    i0 = _clamp(clang.maybe_convert_to_dtype(floor(real), torch.int64), hi=length - 1)
    lam1 = _clamp(sub(real, clang.maybe_convert_to_dtype(i0, comp)), 0.0, 1.0)
    if weight_dtype is comp:
        lam0 = sub(1.0, lam1)
    else:
        lam1 = clang.maybe_convert_to_dtype(lam1, weight_dtype)
        lam0 = clang.maybe_convert_to_dtype(sub(1.0, lam1), comp)
        lam1 = clang.maybe_convert_to_dtype(lam1, comp)
    i1 = add(i0, clang.maybe_convert_to_dtype(lt(i0, length - 1), torch.int64))
    shape = [1] * x.ndim
    shape[axis] = o
    lam0 = prims.broadcast_in_dim(lam0, tuple(shape), (axis,))
    lam1 = prims.broadcast_in_dim(lam1, tuple(shape), (axis,))
    return add(mul(_gather_dim(x, axis, i0), lam0), mul(_gather_dim(x, axis, i1), lam1))


@torchsymbol(F.interpolate, tags=())
def interpolate(input, size=None, scale_factor=None, mode: str = "nearest", align_corners: bool | None = None,
                recompute_scale_factor: bool | None = None, antialias: bool = False):
    """Resize the spatial dims: ``nearest`` and ``(bi|tri)linear`` (both ``align_corners``) are decomposed; other
    modes and ``antialias`` are recorded as one opaque torch call."""
    if mode in ("nearest", "area", "nearest-exact"):
        check(align_corners is None, lambda: "align_corners option can only be set with the interpolating modes: "
              "linear | bilinear | bicubic | trilinear", ValueError)
    elif align_corners is None:
        align_corners = False
    n = input.ndim - 2
    supported = not antialias and (mode == "nearest" and 1 <= n <= 3 or _LINEAR_MODES.get(mode) == n)
    if not supported:
        return opaque_symbol(F.interpolate)(input, size=size, scale_factor=scale_factor, mode=mode,
                                            align_corners=align_corners,
                                            recompute_scale_factor=recompute_scale_factor, antialias=antialias)
    out_sizes, scales = _interpolate_sizes(input, size, scale_factor, recompute_scale_factor)
    if mode == "nearest":
        x = input
        for i in range(n):
            x = _nearest_dim(x, 2 + i, out_sizes[i], scales[i])
        return fresh(x, input)  # resizing to the same size still copies, as in eager
    x = _opmath(input)
    # torch interpolates the innermost dim first, then the outer ones: the same rounding order. Its 2-d kernel
    # keeps float32 lambdas for bfloat16/float16 inputs; the 1-d and 3-d ones round them to the input dtype.
    weight_dtype = x.dtype if mode == "bilinear" else input.dtype
    for i in reversed(range(n)):
        x = _linear_dim(x, 2 + i, out_sizes[i], scales[i], align_corners, weight_dtype)
    return fresh(clang.maybe_convert_to_dtype(x, input.dtype), input)

