"""OpInfos for convolution, pooling and interpolation (``fulmen/torch/nn_conv.py``)."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

import fulmen.torch as ltorch
from fulmen.tests.opinfos.base import OpInfo, SampleInput, make_tensor

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
FLOATS = (F32, F64, BF16)
_BF16_LOOSE = {BF16: (2e-2, 3e-2)}  # sums of many bfloat16 products round differently in each kernel


def _maker(device, dtype, requires_grad, **kwargs):
    return partial(make_tensor, device=device, dtype=dtype, requires_grad=requires_grad and dtype.is_floating_point,
                   **kwargs)


def _leaf(t, requires_grad):
    return t.detach().requires_grad_(requires_grad and t.dtype.is_floating_point)


# ---------------------------------------------------------------------------------------------------------
# convolution


def _conv_generator(n):
    def gen(op, device, dtype, requires_grad, **kw):
        make = _maker(device, dtype, requires_grad)
        sp = (7, 6, 5)[:n]
        k = (3, 2, 3)[:n]
        yield SampleInput(make((2, 4, *sp)), make((6, 4, *k)))
        yield SampleInput(make((2, 4, *sp)), make((6, 4, *k)), make((6,)), stride=2, padding=1)
        yield SampleInput(make((2, 4, *sp)), make((6, 2, *k)), None, 1, 2, 2, 2)  # padding 2, dilation 2, groups 2
        yield SampleInput(make((2, 4, *sp)), make((4, 1, *k)), make((4,)), groups=4, padding="same")
        yield SampleInput(make((2, 4, *sp)), make((6, 4, *k)), padding="same", dilation=2)
        yield SampleInput(make((2, 4, *sp)), make((6, 4, *k)), padding="valid")
        yield SampleInput(make((4, *sp)), make((6, 4, *k)), make((6,)))  # unbatched
        yield SampleInput(make((2, 4, *sp), noncontiguous=True), make((6, 4, *k), noncontiguous=True),
                          stride=(2,) * n, padding=(1,) * n)
        yield SampleInput(make((0, 4, *sp)), make((6, 4, *k)))

    return gen


def _conv_errors(n, name):
    def gen(op, device, **kw):
        make = partial(make_tensor, device=device, dtype=F32)
        sp, k = (6,) * n, (3,) * n
        yield SampleInput(make((2, 5, *sp)), make((6, 4, *k))), RuntimeError, "expected input.* to have 4 channels"
        yield SampleInput(make((2, 4, *sp)), make((6, 4, *k)), stride=2, padding="same"), RuntimeError, \
            "padding='same' is not supported for strided convolutions"
        yield SampleInput(make((2, 4, *sp)), make((6, 4, *k)), padding="full"), RuntimeError, "Invalid padding string"
        yield SampleInput(make(sp), make((6, 4, *k))), RuntimeError, f"to {name}, but got input of size"

    return gen


conv1d_opinfo = OpInfo(ltorch.conv1d, torch_reference=F.conv1d, dtypes=FLOATS, tolerance=_BF16_LOOSE,
                       sample_input_generator=_conv_generator(1), error_input_generator=_conv_errors(1, "conv1d"))
conv2d_opinfo = OpInfo(ltorch.conv2d, torch_reference=F.conv2d, dtypes=FLOATS, tolerance=_BF16_LOOSE,
                       sample_input_generator=_conv_generator(2), error_input_generator=_conv_errors(2, "conv2d"))
conv3d_opinfo = OpInfo(ltorch.conv3d, torch_reference=F.conv3d, dtypes=(F32, F64),
                       sample_input_generator=_conv_generator(3), error_input_generator=_conv_errors(3, "conv3d"))


def _conv_transpose_generator(n):
    def gen(op, device, dtype, requires_grad, **kw):
        make = _maker(device, dtype, requires_grad)
        sp, k = (5, 4)[:n], (3, 2)[:n]
        yield SampleInput(make((2, 4, *sp)), make((4, 3, *k)))
        yield SampleInput(make((2, 4, *sp)), make((4, 3, *k)), make((3,)), stride=2, padding=1, output_padding=1)
        yield SampleInput(make((2, 4, *sp)), make((4, 2, *k)), None, 1, 0, 0, 2, 2)  # groups 2, dilation 2
        yield SampleInput(make((4, *sp)), make((4, 3, *k)))

    return gen


def _conv_transpose_errors(op, device, **kw):
    make = partial(make_tensor, device=device, dtype=F32)
    yield SampleInput(make((1, 5, 10)), make((4, 3, 3))), RuntimeError, "expected input.* to have 4 channels"


conv_transpose1d_opinfo = OpInfo(ltorch.conv_transpose1d, torch_reference=F.conv_transpose1d, dtypes=FLOATS,
                                 tolerance=_BF16_LOOSE, sample_input_generator=_conv_transpose_generator(1),
                                 error_input_generator=_conv_transpose_errors)
conv_transpose2d_opinfo = OpInfo(ltorch.conv_transpose2d, torch_reference=F.conv_transpose2d, dtypes=(F32, F64),
                                 sample_input_generator=_conv_transpose_generator(2))


# ---------------------------------------------------------------------------------------------------------
# pooling


def _max_pool_generator(n):
    def gen(op, device, dtype, requires_grad, **kw):
        make = _maker(device, dtype, requires_grad)
        sp = (9, 8)[:n]
        yield SampleInput(make((2, 3, *sp)), 2)
        yield SampleInput(make((2, 3, *sp)), 3, 2, 1)
        yield SampleInput(make((2, 3, *sp)), 3, 2, 1, ceil_mode=True)
        yield SampleInput(make((2, 3, *sp)), 2, 1, 0, 2)  # dilation 2
        yield SampleInput(make((2, 3, *sp)), (3,) * n, stride=(2,) * n, padding=1, dilation=2, ceil_mode=True)
        yield SampleInput(make((3, *sp)), 2, ceil_mode=True)  # unbatched
        yield SampleInput(make((2, 3, *sp), noncontiguous=True), 2, stride=None)
        x = make((1, 1, *sp))
        x.view(-1)[3] = float("nan")  # NaN wins, as in eager
        yield SampleInput(_leaf(x, requires_grad), 2)

    return gen


def _max_pool_errors(n, name):
    def gen(op, device, **kw):
        make = partial(make_tensor, device=device, dtype=F32)
        sp = (6,) * n
        yield SampleInput(make((1, 2, *sp)), 2, 2, 2), RuntimeError, "pad should be at most half of effective kernel"
        yield SampleInput(make((1, 2, *(1,) * n)), 2), RuntimeError, "Output size is too small"
        bad = make((2, 1, 2, *sp)) if n == 1 else make((2,))
        yield SampleInput(bad, 2), RuntimeError, r"Expected \dD"

    return gen


max_pool1d_opinfo = OpInfo(ltorch.max_pool1d, torch_reference=F.max_pool1d, dtypes=FLOATS,
                           sample_input_generator=_max_pool_generator(1),
                           error_input_generator=_max_pool_errors(1, "max_pool1d"))
max_pool2d_opinfo = OpInfo(ltorch.max_pool2d, torch_reference=F.max_pool2d, dtypes=FLOATS,
                           sample_input_generator=_max_pool_generator(2),
                           error_input_generator=_max_pool_errors(2, "max_pool2d"))


def _avg_pool_generator(n):
    def gen(op, device, dtype, requires_grad, **kw):
        make = _maker(device, dtype, requires_grad)
        sp = (9, 8)[:n]
        yield SampleInput(make((2, 3, *sp)), 2)
        yield SampleInput(make((2, 3, *sp)), 3, 2, 1)
        yield SampleInput(make((2, 3, *sp)), 3, 2, 1, count_include_pad=False)
        yield SampleInput(make((2, 3, *sp)), 3, 2, 1, ceil_mode=True)
        yield SampleInput(make((2, 3, *sp)), 3, 2, 1, ceil_mode=True, count_include_pad=False)
        yield SampleInput(make((2, 3, *sp)), 4, 3, 2, True, True)
        yield SampleInput(make((3, *sp), noncontiguous=True), (2,) * n, stride=(1,) * n)
        if n == 2:
            yield SampleInput(make((2, 3, *sp)), 3, 2, 1, divisor_override=5)

    return gen


def _avg_pool_errors(op, device, **kw):
    make = partial(make_tensor, device=device, dtype=F32)
    yield SampleInput(make((1, 2, 6, 6)), 2, 2, 2), RuntimeError, "pad should be"
    yield SampleInput(make((1, 2, 6, 6)), 2, divisor_override=0), RuntimeError, "divisor must be not zero"


avg_pool1d_opinfo = OpInfo(ltorch.avg_pool1d, torch_reference=F.avg_pool1d, dtypes=FLOATS,
                           sample_input_generator=_avg_pool_generator(1))
avg_pool2d_opinfo = OpInfo(ltorch.avg_pool2d, torch_reference=F.avg_pool2d, dtypes=FLOATS,
                           sample_input_generator=_avg_pool_generator(2), error_input_generator=_avg_pool_errors)


def _adaptive_generator(n):
    def gen(op, device, dtype, requires_grad, **kw):
        make = _maker(device, dtype, requires_grad)
        sp = (9, 8)[:n]
        yield SampleInput(make((2, 3, *sp)), 3 if n == 1 else (3, 4))  # equal windows
        yield SampleInput(make((2, 3, *sp)), 5 if n == 1 else (5, 3))  # overlapping windows
        yield SampleInput(make((2, 3, *sp)), 1)
        yield SampleInput(make((3, *sp), noncontiguous=True), 4 if n == 1 else (None, 6))
        yield SampleInput(make((2, 3, *sp)), 12 if n == 1 else (12, 8))  # larger than the input

    return gen


def _adaptive_errors(op, device, **kw):
    yield SampleInput(make_tensor((2, 3, 4, 5, 6), device=device, dtype=F32), (2, 2)), RuntimeError, "Expected 3D or 4D"


adaptive_avg_pool1d_opinfo = OpInfo(ltorch.adaptive_avg_pool1d, torch_reference=F.adaptive_avg_pool1d,
                                    dtypes=FLOATS, sample_input_generator=_adaptive_generator(1))
adaptive_avg_pool2d_opinfo = OpInfo(ltorch.adaptive_avg_pool2d, torch_reference=F.adaptive_avg_pool2d,
                                    dtypes=FLOATS, sample_input_generator=_adaptive_generator(2),
                                    error_input_generator=_adaptive_errors)
adaptive_max_pool1d_opinfo = OpInfo(ltorch.adaptive_max_pool1d, torch_reference=F.adaptive_max_pool1d,
                                    dtypes=FLOATS, sample_input_generator=_adaptive_generator(1))
adaptive_max_pool2d_opinfo = OpInfo(ltorch.adaptive_max_pool2d, torch_reference=F.adaptive_max_pool2d,
                                    dtypes=FLOATS, sample_input_generator=_adaptive_generator(2))


# ---------------------------------------------------------------------------------------------------------
# interpolation


def _interpolate_generator(op, device, dtype, requires_grad, **kw):
    make = _maker(device, dtype, requires_grad)
    x4, x3 = make((2, 3, 5, 7)), make((2, 3, 6))
    yield SampleInput(x4, scale_factor=2)
    yield SampleInput(x4, size=(8, 4))
    yield SampleInput(x4, scale_factor=1.7)
    yield SampleInput(x4, scale_factor=(0.5, 1.3))
    yield SampleInput(x4, scale_factor=1.7, recompute_scale_factor=True)
    yield SampleInput(x3, size=11)
    yield SampleInput(make((1, 2, 3, 4, 5)), size=(4, 5, 3))
    for align in (False, True):
        yield SampleInput(x4, size=(9, 4), mode="bilinear", align_corners=align)
        yield SampleInput(x4, scale_factor=1.5, mode="bilinear", align_corners=align)
        yield SampleInput(x3, size=13, mode="linear", align_corners=align)
        yield SampleInput(x3, scale_factor=0.5, mode="linear", align_corners=align)
    yield SampleInput(x4, size=(5, 7), mode="bilinear")  # same size: a copy
    yield SampleInput(make((1, 2, 3, 4, 5)), size=(5, 3, 6), mode="trilinear")
    yield SampleInput(_leaf(make((2, 3, 7, 5)).transpose(-1, -2), requires_grad), size=(6, 9), mode="bilinear")
    yield SampleInput(x4, size=(9, 11), mode="bicubic")  # not decomposed: one opaque torch call


def _interpolate_errors(op, device, **kw):
    x = make_tensor((1, 2, 4, 4), device=device, dtype=F32)
    yield SampleInput(x), ValueError, "either size or scale_factor should be defined"
    yield SampleInput(x, size=3, scale_factor=2), ValueError, "only one of size or scale_factor should be defined"
    yield SampleInput(x, size=(3, 3, 3)), ValueError, "Input and output must have the same number of spatial"
    yield SampleInput(x, size=3, align_corners=True), ValueError, "align_corners option can only be set"


interpolate_opinfo = OpInfo(ltorch.interpolate, torch_reference=F.interpolate, dtypes=FLOATS,
                            sample_input_generator=_interpolate_generator, error_input_generator=_interpolate_errors)
