"""OpInfos for torch.nn.functional: activations, normalization, embedding, one_hot and dropout here; convolution,
pooling and interpolation in ``nn_conv.py``; losses and attention in ``nn_losses.py`` (all imported below).

Ops with an ``inplace=`` flag are tested through the ``torch.nn.functional`` callable (``op=F.relu``), so the
samples can call the in-place form and the tests compare the caller's tensors after the call. Random ops
(dropout) set ``is_random``: the tests seed torch's generator before the eager and the compiled call. Their
samples are contiguous because eager draws a dropout mask in the input's memory order and the decomposition
draws it in logical order (``tests/test_ltorch_nn.py`` covers the transposed case separately).
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F

import fulmen.torch as ltorch
from fulmen.tests.opinfos.base import OpInfo, SampleInput, make_tensor

F32, F64, BF16, I64 = torch.float32, torch.float64, torch.bfloat16, torch.int64
FLOATS = (F32, F64, BF16)


def _maker(device, dtype, requires_grad, **kwargs):
    rg = requires_grad and (dtype.is_floating_point or dtype.is_complex)
    return partial(make_tensor, device=device, dtype=dtype, requires_grad=rg, **kwargs)


def _leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A leaf keeping t's strides (a transposed view stays transposed)."""
    return t.detach().requires_grad_(requires_grad and t.dtype.is_floating_point)


def _specials(device, dtype, leave_out=()):
    values = [math.nan, math.inf, -math.inf, 0.0, -0.0, 2.5, -1.5, 0.25, 30.0, -30.0]
    return torch.tensor([v for v in values if v not in leave_out], device=device, dtype=dtype)


def _unary_inputs(device, dtype, requires_grad, *, specials=True, leave_out=()):
    """0-d, empty, 1-d, 3-d, gapped and transposed tensors, then NaN/inf/signed zeros and large magnitudes
    (less the special values in ``leave_out``)."""
    make = _maker(device, dtype, requires_grad)
    yield make(())
    yield make((0,))
    yield make((7,))
    yield make((2, 3, 4))
    yield make((4, 6), noncontiguous=True)
    yield _leaf(make((5, 3)).transpose(0, 1), requires_grad)
    if specials and dtype.is_floating_point:
        yield _specials(device, dtype, leave_out)


# ---------------------------------------------------------------------------------------------------------
# activations


def _activation_generator(*kwarg_sets, inplace=True, specials=True, leave_out=()):
    """Every unary input with each kwargs set; with ``inplace``, also the in-place form on a fresh tensor."""

    def gen(op, device, dtype, requires_grad, **kw):
        for kwargs in kwarg_sets:
            for x in _unary_inputs(device, dtype, requires_grad, specials=specials, leave_out=leave_out):
                yield SampleInput(x, **kwargs)
        if inplace:
            make = _maker(device, dtype, False)
            for kwargs in kwarg_sets:
                yield SampleInput(make((3, 5)), **kwargs, inplace=True)
            yield SampleInput(_leaf(make((5, 3)).transpose(0, 1), False), **kwarg_sets[0], inplace=True)

    return gen


def _activation(fn, *kwarg_sets, ref=None, dtypes=FLOATS, inplace=True, specials=True, leave_out=(), name=None,
                **opinfo_kwargs):
    name = name or getattr(fn, "name", None) or fn.__name__
    return OpInfo(fn, name=name, torch_reference=ref or fn, dtypes=dtypes,
                  sample_input_generator=_activation_generator(*(kwarg_sets or ({},)), inplace=inplace,
                                                               specials=specials, leave_out=leave_out),
                  **opinfo_kwargs)


def _inplace_generator(op, device, dtype, requires_grad, **kw):
    make = _maker(device, dtype, False)
    yield SampleInput(make((3, 5)))
    yield SampleInput(_leaf(make((5, 3)).transpose(0, 1), False))
    if dtype.is_floating_point:
        yield SampleInput(_specials(device, dtype))


relu_opinfo = _activation(F.relu, dtypes=FLOATS + (I64,))
relu__opinfo = OpInfo(torch.relu_, name="relu_", torch_reference=torch.relu_, dtypes=FLOATS + (I64,),
                      sample_input_generator=_inplace_generator)
relu6_opinfo = _activation(F.relu6)
hardtanh_opinfo = _activation(F.hardtanh, {}, {"min_val": -0.5, "max_val": 2.0}, {"min_val": 1.0, "max_val": 1.0})
leaky_relu_opinfo = _activation(F.leaky_relu, {}, {"negative_slope": 0.2}, {"negative_slope": -1.5})
elu_opinfo = _activation(F.elu, {}, {"alpha": 0.5})
elu__opinfo = OpInfo(F.elu_, name="elu_", torch_reference=F.elu_, dtypes=FLOATS,
                     sample_input_generator=_inplace_generator)
selu_opinfo = _activation(F.selu)
celu_opinfo = _activation(F.celu, {}, {"alpha": 2.0})
silu_opinfo = _activation(F.silu)
hardswish_opinfo = _activation(F.hardswish)
hardsigmoid_opinfo = _activation(F.hardsigmoid)
mish_opinfo = _activation(F.mish)
threshold_opinfo = _activation(F.threshold, {"threshold": 0.5, "value": -2.0}, {"threshold": -1.0, "value": 0.0},
                               name="threshold")
# No +inf sample: eager's F.gelu is no reference there. Its vectorized CPU kernel returns nan at +inf and its
# scalar tail the limit, +inf, so which one an element gets depends on the tensor's length and the CPU's vector
# width. tests/test_soundness_numerics.py checks fulmen's decomposition against the limit instead.
gelu_opinfo = _activation(ltorch.gelu, {}, {"approximate": "tanh"}, inplace=False, ref=F.gelu, leave_out=(math.inf,))
softplus_opinfo = _activation(ltorch.softplus, {}, {"beta": 2.0}, {"beta": 0.5, "threshold": 3.0}, inplace=False,
                              ref=F.softplus)
logsigmoid_opinfo = _activation(ltorch.logsigmoid, inplace=False, ref=F.logsigmoid)
softsign_opinfo = _activation(ltorch.softsign, inplace=False, ref=F.softsign)
tanhshrink_opinfo = _activation(ltorch.tanhshrink, inplace=False, ref=F.tanhshrink)
softshrink_opinfo = _activation(ltorch.softshrink, {}, {"lambd": 1.0}, {"lambd": 0.0}, inplace=False, ref=F.softshrink)
hardshrink_opinfo = _activation(ltorch.hardshrink, {}, {"lambd": 1.0}, inplace=False, ref=F.hardshrink)


def _activation_errors(op, device, **kw):
    x = make_tensor((3, 4), device=device, dtype=F32)
    yield SampleInput(x, min_val=2.0, max_val=1.0), ValueError, "min_val cannot be greater than max_val"


hardtanh_opinfo.error_input_generator = _activation_errors


def _gelu_errors(op, device, **kw):
    x = make_tensor((3, 4), device=device, dtype=F32)
    yield SampleInput(x, approximate="foo"), RuntimeError, "approximate argument must be either none or tanh"
    yield SampleInput(make_tensor((3,), device=device, dtype=I64)), NotImplementedError, "GeluKernelImpl"


gelu_opinfo.error_input_generator = _gelu_errors


def _softshrink_errors(op, device, **kw):
    yield SampleInput(make_tensor((3,), device=device, dtype=F32), -1.0), RuntimeError, "lambda must be in range"


softshrink_opinfo.error_input_generator = _softshrink_errors


def _celu_errors(op, device, **kw):
    yield SampleInput(make_tensor((3,), device=device, dtype=F32), alpha=0.0), RuntimeError, "alpha cannot be 0"


celu_opinfo.error_input_generator = _celu_errors


def _glu_generator(op, device, dtype, requires_grad, **kw):
    make = _maker(device, dtype, requires_grad)
    yield SampleInput(make((4, 6)))
    yield SampleInput(make((4, 6)), 0)
    yield SampleInput(make((2, 4, 3)), 1)
    yield SampleInput(make((2, 4, 2)), -1)
    yield SampleInput(make((0, 4)))
    yield SampleInput(_leaf(make((6, 3)).transpose(0, 1), requires_grad), 1)


def _glu_errors(op, device, **kw):
    yield SampleInput(make_tensor((3, 5), device=device, dtype=F32)), RuntimeError, "Halving dimension must be even"
    yield SampleInput(make_tensor((), device=device, dtype=F32)), RuntimeError, "glu does not support scalars"


glu_opinfo = OpInfo(ltorch.glu, torch_reference=F.glu, dtypes=FLOATS, sample_input_generator=_glu_generator,
                    error_input_generator=_glu_errors)


def _prelu_generator(op, device, dtype, requires_grad, **kw):
    make = _maker(device, dtype, requires_grad)
    yield SampleInput(make((2, 3, 4)), make((3,)))
    yield SampleInput(make((2, 3, 4, 5), noncontiguous=True), make((1,)))
    yield SampleInput(make((5,)), make(()))
    yield SampleInput(make((4, 3)), make((3,)))
    yield SampleInput(_specials(device, dtype).reshape(2, 5), make((5,)))


def _prelu_errors(op, device, **kw):
    make = partial(make_tensor, device=device, dtype=F32)
    yield SampleInput(make((2, 3)), make((4,))), RuntimeError, "Mismatch of parameter numbers and input channel size"


prelu_opinfo = OpInfo(ltorch.prelu, torch_reference=F.prelu, dtypes=FLOATS, sample_input_generator=_prelu_generator,
                      error_input_generator=_prelu_errors)


# ---------------------------------------------------------------------------------------------------------
# normalization


def _layer_norm_generator(op, device, dtype, requires_grad, **kw):
    make = _maker(device, dtype, requires_grad)
    yield SampleInput(make((4, 5)), (5,))
    yield SampleInput(make((4, 5)), (5,), make((5,)), make((5,)))
    yield SampleInput(make((2, 3, 4)), (3, 4), make((3, 4)), None, eps=1e-3)
    yield SampleInput(make((2, 3, 4)), [4], None, make((4,)))
    yield SampleInput(make((0, 5)), (5,), make((5,)), make((5,)))
    yield SampleInput(_leaf(make((6, 4)).transpose(0, 1), requires_grad), (6,), make((6,), noncontiguous=True))
    yield SampleInput(make((3, 7), low=4.0, high=5.0), (7,))  # a mean large against the spread


def _layer_norm_errors(op, device, **kw):
    make = partial(make_tensor, device=device, dtype=F32)
    yield SampleInput(make((3, 4)), (3,)), RuntimeError, r"Given normalized_shape=\[3\], expected input with shape"
    yield SampleInput(make((3, 4)), (4,), make((3,))), RuntimeError, "Expected weight to be of same shape"


layer_norm_opinfo = OpInfo(ltorch.layer_norm, torch_reference=F.layer_norm, dtypes=FLOATS,
                           sample_input_generator=_layer_norm_generator, error_input_generator=_layer_norm_errors)


def _rms_norm_generator(op, device, dtype, requires_grad, **kw):
    make = _maker(device, dtype, requires_grad)
    yield SampleInput(make((4, 5)), (5,))
    yield SampleInput(make((4, 5)), [5], make((5,)))
    yield SampleInput(make((2, 3, 4)), (3, 4), make((3, 4)), 1e-3)
    yield SampleInput(make((3, 8), low=-1e-3, high=1e-3), (8,), make((8,)))  # tiny values: eps matters
    yield SampleInput(make((0, 5)), (5,))
    yield SampleInput(_leaf(make((6, 4)).transpose(0, 1), requires_grad), (6,), None, eps=1e-6)


def _rms_norm_errors(op, device, **kw):
    yield SampleInput(make_tensor((3, 4), device=device, dtype=F32), (3,)), RuntimeError, "Given normalized_shape"


rms_norm_opinfo = OpInfo(ltorch.rms_norm, torch_reference=F.rms_norm, dtypes=FLOATS,
                         sample_input_generator=_rms_norm_generator, error_input_generator=_rms_norm_errors)


def _group_norm_generator(op, device, dtype, requires_grad, **kw):
    make = _maker(device, dtype, requires_grad)
    yield SampleInput(make((2, 6, 4)), 3)
    yield SampleInput(make((2, 6, 3, 3)), 2, make((6,)), make((6,)))
    yield SampleInput(make((3, 4)), 2, None, make((4,)), eps=1e-3)
    yield SampleInput(make((2, 4, 5), noncontiguous=True), 4, make((4,)))
    yield SampleInput(make((1, 6, 5)), 1)


def _group_norm_errors(op, device, **kw):
    make = partial(make_tensor, device=device, dtype=F32)
    yield SampleInput(make((2, 5, 3)), 2), RuntimeError, "Expected number of channels in input to be divisible"
    yield SampleInput(make((5,)), 1), RuntimeError, "Expected at least 2 dimensions"
    yield SampleInput(make((1, 2, 1)), 2), ValueError, "Expected more than 1 value per channel"


group_norm_opinfo = OpInfo(ltorch.group_norm, torch_reference=F.group_norm, dtypes=FLOATS,
                           sample_input_generator=_group_norm_generator, error_input_generator=_group_norm_errors)


def _batch_norm_generator(op, device, dtype, requires_grad, **kw):
    make = _maker(device, dtype, requires_grad)

    def stats(c):  # running statistics are buffers: never require grad
        return make_tensor((c,), device=device, dtype=dtype), make_tensor((c,), device=device, dtype=dtype, low=0.5,
                                                                         high=2.0)

    for shape in ((6, 4), (3, 4, 5), (2, 4, 3, 3)):
        rm, rv = stats(4)
        yield SampleInput(make(shape), rm, rv, make((4,)), make((4,)), training=True)  # updates rm, rv in place
        rm, rv = stats(4)
        yield SampleInput(make(shape), rm, rv, make((4,)), make((4,)), False)
    rm, rv = stats(3)
    yield SampleInput(make((5, 3)), rm, rv, None, None, True, 0.3, 1e-3)
    yield SampleInput(make((5, 3, 2)), None, None, make((3,)), None, True)
    rm, rv = stats(3)
    yield SampleInput(_leaf(make((3, 5)).transpose(0, 1), requires_grad), rm, rv, training=False, eps=0.1)


def _batch_norm_errors(op, device, **kw):
    make = partial(make_tensor, device=device, dtype=F32)
    yield SampleInput(make((1, 3)), make((3,)), make((3,)), training=True), ValueError, \
        "Expected more than 1 value per channel when training"
    yield SampleInput(make((2, 3)), None, None, training=False), RuntimeError, \
        "running_mean must be defined in evaluation mode"
    yield SampleInput(make((2, 3)), make((4,)), make((4,))), RuntimeError, "running_mean should contain 3 elements"


# torch's bfloat16 CPU kernel rounds its batch statistics; near-zero outputs then differ by a few bfloat16 ulps
batch_norm_opinfo = OpInfo(ltorch.batch_norm, name="batch_norm", torch_reference=F.batch_norm, dtypes=FLOATS,
                           tolerance={BF16: (5e-2, 4e-2)},
                           sample_input_generator=_batch_norm_generator, error_input_generator=_batch_norm_errors)


def _instance_norm_generator(op, device, dtype, requires_grad, **kw):
    make = _maker(device, dtype, requires_grad)
    yield SampleInput(make((2, 3, 5)))
    yield SampleInput(make((2, 3, 4, 4)), weight=make((3,)), bias=make((3,)))
    yield SampleInput(make((2, 3, 5)), make((3,)), make((3,), low=0.5, high=2.0), momentum=0.2)
    yield SampleInput(make((2, 3, 5)), make((3,)), make((3,), low=0.5, high=2.0), use_input_stats=False)


def _instance_norm_errors(op, device, **kw):
    yield SampleInput(make_tensor((2, 3, 1), device=device, dtype=F32)), ValueError, \
        "Expected more than 1 spatial element"


instance_norm_opinfo = OpInfo(ltorch.instance_norm, name="instance_norm", torch_reference=F.instance_norm,
                              dtypes=FLOATS, sample_input_generator=_instance_norm_generator,
                              error_input_generator=_instance_norm_errors)


def _normalize_generator(op, device, dtype, requires_grad, **kw):
    make = _maker(device, dtype, requires_grad)
    yield SampleInput(make((4, 5)))
    yield SampleInput(make((4, 5)), p=1.0, dim=0)
    yield SampleInput(make((2, 3, 4)), p=float("inf"), dim=-1)
    yield SampleInput(make((2, 3, 4), noncontiguous=True), p=3.0, dim=1, eps=1e-3)
    yield SampleInput(torch.zeros(3, 4, device=device, dtype=dtype))  # eps guards the zero norm
    yield SampleInput(make((5,)), dim=0)


normalize_opinfo = OpInfo(ltorch.normalize, torch_reference=F.normalize, dtypes=FLOATS,
                          sample_input_generator=_normalize_generator)


# ---------------------------------------------------------------------------------------------------------
# embedding, one_hot


def _embedding_generator(op, device, dtype, requires_grad, **kw):
    make = _maker(device, dtype, requires_grad)
    idx = partial(make_tensor, device=device, dtype=I64, low=0, high=10)
    yield SampleInput(idx((5,)), make((10, 3)))
    yield SampleInput(idx((2, 4)), make((10, 4)), padding_idx=2)
    yield SampleInput(idx(()), make((10, 3)), padding_idx=-1)
    yield SampleInput(idx((0,)), make((10, 3)))
    yield SampleInput(idx((3, 2), dtype=torch.int32), _leaf(make((5, 10)).transpose(0, 1), requires_grad))


def _embedding_errors(op, device, **kw):
    w = make_tensor((10, 3), device=device, dtype=F32)
    yield SampleInput(make_tensor((4,), device=device, dtype=F32), w), RuntimeError, "Expected tensor for argument #1"
    yield SampleInput(torch.tensor([1], device=device), make_tensor((3,), device=device, dtype=F32)), RuntimeError, \
        "'weight' must be 2-D"
    yield SampleInput(torch.tensor([1], device=device), w, padding_idx=10), AssertionError, "Padding_idx must be"


embedding_opinfo = OpInfo(ltorch.embedding, torch_reference=F.embedding, dtypes=FLOATS,
                          sample_input_generator=_embedding_generator, error_input_generator=_embedding_errors)


def _one_hot_generator(op, device, dtype, requires_grad, **kw):
    idx = partial(make_tensor, device=device, dtype=I64, low=0, high=5)
    yield SampleInput(idx((6,)), 5)
    yield SampleInput(idx((2, 3)), 7)
    yield SampleInput(idx(()), 5)
    yield SampleInput(idx((0,)), 3)
    yield SampleInput(idx((4, 3), noncontiguous=True), num_classes=6)


def _one_hot_errors(op, device, **kw):
    from fulmen.core.proxies import DataDependentError

    yield SampleInput(torch.tensor([1, 2], device=device)), DataDependentError, "num_classes"
    yield SampleInput(torch.tensor([1.0], device=device), 3), RuntimeError, "one_hot is only applicable to index"


one_hot_opinfo = OpInfo(ltorch.one_hot, torch_reference=F.one_hot, dtypes=(I64,), supports_grad=False,
                        sample_input_generator=_one_hot_generator, error_input_generator=_one_hot_errors)


# ---------------------------------------------------------------------------------------------------------
# dropout (seeded: the mask matches eager for contiguous inputs)


def _dropout_generator(op, device, dtype, requires_grad, **kw):
    make = _maker(device, dtype, requires_grad)
    yield SampleInput(make((64, 33)))
    yield SampleInput(make((8, 9, 10)), 0.3)
    yield SampleInput(make((5, 7)), p=0.0)
    yield SampleInput(make((5, 7)), p=1.0)
    yield SampleInput(make((5, 7)), 0.5, False)
    yield SampleInput(make(()), 0.2)
    yield SampleInput(make((0, 3)), 0.2)
    yield SampleInput(make_tensor((6, 5), device=device, dtype=dtype), 0.4, inplace=True)


def _dropout_errors(op, device, **kw):
    yield SampleInput(make_tensor((3,), device=device, dtype=F32), 1.5), ValueError, \
        "dropout probability has to be between 0 and 1, but got 1.5"


dropout_opinfo = OpInfo(F.dropout, name="dropout", torch_reference=F.dropout, dtypes=FLOATS, is_random=True,
                        sample_input_generator=_dropout_generator, error_input_generator=_dropout_errors)


def _feature_dropout_generator(shapes):
    def gen(op, device, dtype, requires_grad, **kw):
        make = _maker(device, dtype, requires_grad)
        for shape in shapes:
            yield SampleInput(make(shape), 0.4)
        yield SampleInput(make(shapes[0]), 0.4, False)
        yield SampleInput(make_tensor(shapes[-1], device=device, dtype=dtype), 0.5, inplace=True)

    return gen


def _dropout1d_errors(op, device, **kw):
    yield SampleInput(make_tensor((3,), device=device, dtype=F32)), RuntimeError, "Expected 2D or 3D input"


dropout1d_opinfo = OpInfo(F.dropout1d, name="dropout1d", torch_reference=F.dropout1d, dtypes=FLOATS, is_random=True,
                          sample_input_generator=_feature_dropout_generator(((4, 6, 5), (6, 5))),
                          error_input_generator=_dropout1d_errors)
dropout2d_opinfo = OpInfo(F.dropout2d, name="dropout2d", torch_reference=F.dropout2d, dtypes=FLOATS, is_random=True,
                          sample_input_generator=_feature_dropout_generator(((4, 6, 3, 3), (2, 8, 5))))

from fulmen.tests.opinfos.nn_conv import *  # noqa: E402,F401,F403
from fulmen.tests.opinfos.nn_losses import *  # noqa: E402,F401,F403
