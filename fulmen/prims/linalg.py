"""Matrix multiplication, linear and convolution primitives."""

from __future__ import annotations

import torch

from fulmen.core import dtypes
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import OpTags
from fulmen.core.utils import check
from fulmen.prims.base import PrimIDs, make_prim


def _check_mm_inputs(op, *tensors):
    ref = tensors[0]
    for t in tensors:
        if t is None:
            continue
        check(isinstance(t, TensorProxy), lambda: f"{op} expects tensors, but got {type(t).__name__}", TypeError)
        check(t.dtype == ref.dtype, lambda: f"expected m1 and m2 to have the same dtype, but got: {ref.dtype} != "
              f"{t.dtype}", RuntimeError)
        check(t.device == ref.device, lambda: f"Expected all tensors to be on the same device, but found at least "
              f"two devices, {ref.device} and {t.device}!", RuntimeError)
        check(not dtypes.is_boolean_dtype(t.dtype), lambda: f"{op} does not support bool tensors", RuntimeError)


def matmul_shape(a_shape, b_shape) -> tuple[int, ...]:
    """The shape torch.matmul gives, with its error for mismatched inner dims."""
    check(len(a_shape) >= 1 and len(b_shape) >= 1,
          lambda: f"both arguments to matmul need to be at least 1D, but they are {len(a_shape)}D and {len(b_shape)}D")
    a_vec, b_vec = len(a_shape) == 1, len(b_shape) == 1
    a2 = (1,) + tuple(a_shape) if a_vec else tuple(a_shape)
    b2 = tuple(b_shape) + (1,) if b_vec else tuple(b_shape)
    check(a2[-1] == b2[-2], lambda: f"mat1 and mat2 shapes cannot be multiplied ({a2[-2]}x{a2[-1]} and "
          f"{b2[-2]}x{b2[-1]})")
    batch_a, batch_b = a2[:-2], b2[:-2]
    n = max(len(batch_a), len(batch_b))
    batch_a, batch_b = (1,) * (n - len(batch_a)) + batch_a, (1,) * (n - len(batch_b)) + batch_b
    batch = []
    for x, y in zip(batch_a, batch_b):
        check(x == y or x == 1 or y == 1, lambda: f"The size of tensor a ({x}) must match the size of tensor b ({y}) "
              f"at non-singleton dimension")
        batch.append(max(x, y) if min(x, y) != 0 else 0)
    shape = batch + [a2[-2], b2[-1]]
    if a_vec:
        shape.pop(-2)
    if b_vec:
        shape.pop(-1)
    return tuple(shape)


def _matmul_meta(a, b):
    _check_mm_inputs("matmul", a, b)
    return TensorProxy(like=a, shape=matmul_shape(a.shape, b.shape), requires_grad=a.requires_grad or b.requires_grad)


matmul = make_prim(PrimIDs.MATMUL, "matmul", meta=_matmul_meta, torch_impl=torch.matmul, tags=(OpTags.MATMUL_OP,),
                   doc="torch.matmul: broadcast batched matrix product, with vector promotion.")


def _linear_meta(a, w, bias):
    _check_mm_inputs("linear", a, w, bias)
    check(w.ndim in (1, 2), lambda: f"linear: weight must be 1D or 2D, but got {w.ndim}D", RuntimeError)
    check(a.ndim >= 1, lambda: "linear: input must be at least 1D", RuntimeError)
    check(a.shape[-1] == w.shape[-1], lambda: f"mat1 and mat2 shapes cannot be multiplied "
          f"({a.numel() // max(a.shape[-1], 1)}x{a.shape[-1]} and {w.shape[-1]}x{w.shape[0] if w.ndim == 2 else 1})")
    shape = tuple(a.shape[:-1]) + ((w.shape[0],) if w.ndim == 2 else ())
    if bias is not None:
        check(bias.ndim <= 1 and (bias.ndim == 0 or bias.shape[0] in (1, shape[-1] if shape else 1)),
              lambda: f"linear: bias of shape {tuple(bias.shape)} does not match output features", RuntimeError)
    rg = a.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad)
    return TensorProxy(like=a, shape=shape, requires_grad=rg)


linear = make_prim(PrimIDs.LINEAR, "linear", meta=_linear_meta, torch_impl=torch.nn.functional.linear,
                   tags=(OpTags.MATMUL_OP,), doc="a @ w.T + bias.")


def conv_output_shape(a_shape, w_shape, stride, padding, dilation, transposed, output_padding, groups):
    n, c_in = a_shape[0], a_shape[1]
    spatial = a_shape[2:]
    if transposed:
        c_out = w_shape[1] * groups
        sizes = [(i - 1) * s - 2 * p + d * (k - 1) + op + 1
                 for i, s, p, d, k, op in zip(spatial, stride, padding, dilation, w_shape[2:], output_padding)]
    else:
        check(c_in == w_shape[1] * groups, lambda: f"Given groups={groups}, weight of size {list(w_shape)}, expected "
              f"input{list(a_shape)} to have {w_shape[1] * groups} channels, but got {c_in} channels instead")
        c_out = w_shape[0]
        sizes = [(i + 2 * p - d * (k - 1) - 1) // s + 1
                 for i, s, p, d, k in zip(spatial, stride, padding, dilation, w_shape[2:])]
    for s in sizes:
        check(s > 0, lambda: f"Calculated output size {sizes} is too small for input {list(a_shape)}", RuntimeError)
    return (n, c_out, *sizes)


def _convolution_meta(a, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    _check_mm_inputs("convolution", a, weight, bias)
    check(a.ndim == weight.ndim, lambda: f"Expected {weight.ndim}-dimensional input for {weight.ndim}-dimensional "
          f"weight {list(weight.shape)}, but got {a.ndim}-dimensional input of size {list(a.shape)} instead")
    shape = conv_output_shape(a.shape, weight.shape, stride, padding, dilation, transposed, output_padding, groups)
    rg = a.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    return TensorProxy(like=a, shape=shape, requires_grad=rg)


def _torch_convolution(a, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    def conv(x, w, b):
        return torch.convolution(x, w, b, list(stride), list(padding), list(dilation), transposed,
                                 list(output_padding), groups)

    if not a.is_complex():
        return conv(a, weight, bias)
    # torch.convolution has no complex kernels; eager's conv1d/2d/3d run three real ones (Gauss's trick):
    # with p = conv(xr, wr, br), q = conv(xi, wi) and r = conv(xr + xi, wr + wi, br + bi), conv = p - q + i(r - p - q)
    xr, xi, wr, wi = a.real, a.imag, weight.real, weight.imag
    p = conv(xr, wr, bias.real if bias is not None else None)
    q = conv(xi, wi, None)
    r = conv(xr + xi, wr + wi, bias.real + bias.imag if bias is not None else None)
    return torch.complex(p - q, r - p - q)


convolution = make_prim(PrimIDs.CONVOLUTION, "convolution", meta=_convolution_meta, torch_impl=_torch_convolution,
                        tags=(OpTags.MATMUL_OP,),
                        doc="N-d (transposed) convolution with explicit stride, padding, dilation and groups.")
