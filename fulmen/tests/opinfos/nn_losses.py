"""OpInfos for the losses (``fulmen/torch/losses.py``) and scaled dot-product attention (``attention.py``)."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

import fulmen.torch as ltorch
from fulmen.tests.opinfos.base import OpInfo, SampleInput, make_tensor

F32, F64, BF16, I64 = torch.float32, torch.float64, torch.bfloat16, torch.int64
FLOATS = (F32, F64, BF16)


def _maker(device, dtype, requires_grad, **kwargs):
    return partial(make_tensor, device=device, dtype=dtype, requires_grad=requires_grad and dtype.is_floating_point,
                   **kwargs)


def _leaf(t, requires_grad):
    return t.detach().requires_grad_(requires_grad and t.dtype.is_floating_point)


def _targets(shape, classes, device, ignore=None, at=(1,)):
    """Class indices in [0, classes); entries at flat positions ``at`` become ``ignore`` when it is given."""
    t = make_tensor(shape, device=device, dtype=I64, low=0, high=classes)
    if ignore is not None and t.numel():
        for i in at:
            t.view(-1)[i % t.numel()] = ignore
    return t


def _probabilities(shape, device, dtype, class_dim=1):
    return torch.softmax(make_tensor(shape, device=device, dtype=F32), class_dim).to(dtype)


# ---------------------------------------------------------------------------------------------------------
# cross_entropy and nll_loss


def _cross_entropy_generator(op, device, dtype, requires_grad, **kw):
    make = _maker(device, dtype, requires_grad)
    w = make_tensor((5,), device=device, dtype=dtype, low=0.1, high=2.0)
    x = make((6, 5))
    for reduction in ("mean", "sum", "none"):
        yield SampleInput(x, _targets((6,), 5, device), reduction=reduction)
        yield SampleInput(x, _targets((6,), 5, device, -100, (1, 4)), w, reduction=reduction)
        yield SampleInput(x, _targets((6,), 5, device, 2), w, ignore_index=2, reduction=reduction, label_smoothing=0.2)
        yield SampleInput(x, _targets((6,), 5, device, -100), reduction=reduction, label_smoothing=0.3)
        yield SampleInput(x, _probabilities((6, 5), device, dtype), w, reduction=reduction)
        yield SampleInput(x, _probabilities((6, 5), device, dtype), reduction=reduction, label_smoothing=0.25)
        yield SampleInput(make((2, 5, 3, 4)), _targets((2, 3, 4), 5, device, -1, (0, 7)), w, ignore_index=-1,
                          reduction=reduction)
        yield SampleInput(make((2, 5, 3)), _targets((2, 3), 5, device, -100), w, reduction=reduction,
                          label_smoothing=0.1)
    yield SampleInput(make((5,)), _targets((), 5, device))  # unbatched: (C,) input, 0-d target
    yield SampleInput(make((5,)), _probabilities((5,), device, dtype, 0), label_smoothing=0.1)
    yield SampleInput(_leaf(make((5, 6)).transpose(0, 1), requires_grad), _targets((6,), 5, device), w)
    yield SampleInput(x, torch.full((6,), -100, device=device), w)  # every target ignored: mean is NaN
    yield SampleInput(make((0, 5)), _targets((0,), 5, device))  # empty batch: mean is NaN
    yield SampleInput(make((0, 5)), _targets((0,), 5, device), reduction="sum")
    yield SampleInput(x, _targets((6,), 5, device), size_average=False)  # legacy flags
    yield SampleInput(make((4, 5), low=-1e4, high=1e4), _targets((4,), 5, device))  # large logits


def _cross_entropy_errors(op, device, **kw):
    make = partial(make_tensor, device=device, dtype=F32)
    x, t = make((4, 5)), _targets((4,), 5, device)
    yield SampleInput(x, _targets((3,), 5, device)), ValueError, r"Expected input batch_size \(4\) to match target"
    yield SampleInput(x, t.int()), RuntimeError, "expected target dtype to be Long or Byte, but got Int"
    yield SampleInput(x, t, make((4,))), RuntimeError, "weight tensor should be defined either for all 5 classes"
    yield SampleInput(x, make((4, 5)), make((4,))), RuntimeError, "cross_entropy: weight tensor should be defined"
    yield SampleInput(x, make((4, 5)), ignore_index=1), RuntimeError, "ignore_index is not supported for floating"
    yield SampleInput(x, t, label_smoothing=1.5), RuntimeError, "label_smoothing must be between 0.0 and 1.0"
    yield SampleInput(x, t, reduction="foo"), ValueError, "foo is not a valid value for reduction"
    yield SampleInput(make((2, 5, 3)), _targets((2, 4), 5, device)), RuntimeError, r"Expected target size \[2, 3\]"
    yield SampleInput(make((2, 5, 3, 3)), _targets((2, 4), 5, device)), RuntimeError, "only batches of spatial targets"
    yield SampleInput(x, _targets((4, 2), 5, device)), RuntimeError, "0D or 1D target tensor expected"
    yield SampleInput(x.long(), t), NotImplementedError, "not implemented for 'Long'"


cross_entropy_opinfo = OpInfo(ltorch.cross_entropy, torch_reference=F.cross_entropy, dtypes=FLOATS,
                              sample_input_generator=_cross_entropy_generator,
                              error_input_generator=_cross_entropy_errors)


def _nll_loss_generator(op, device, dtype, requires_grad, **kw):
    make = _maker(device, dtype, requires_grad)
    w = make_tensor((5,), device=device, dtype=dtype, low=0.1, high=2.0)
    logp = partial(make, low=-5.0, high=0.0)
    for reduction in ("mean", "sum", "none"):
        yield SampleInput(logp((6, 5)), _targets((6,), 5, device, -100), reduction=reduction)
        yield SampleInput(logp((6, 5)), _targets((6,), 5, device, 3), w, ignore_index=3, reduction=reduction)
        yield SampleInput(logp((2, 5, 3, 2)), _targets((2, 3, 2), 5, device, -100), w, reduction=reduction)
        yield SampleInput(logp((2, 5, 4)), _targets((2, 4), 5, device), reduction=reduction)
    yield SampleInput(logp((5,)), _targets((), 5, device), w)
    yield SampleInput(logp((6, 5)), _targets((6,), 5, device).to(torch.uint8))
    x = torch.full((3, 5), -float("inf"), device=device, dtype=dtype)
    yield SampleInput(x, torch.tensor([-100, -100, -100], device=device), reduction="sum")  # ignored infs give 0


nll_loss_opinfo = OpInfo(ltorch.nll_loss, torch_reference=F.nll_loss, dtypes=FLOATS,
                         sample_input_generator=_nll_loss_generator)


# ---------------------------------------------------------------------------------------------------------
# regression losses


def _regression_generator(extra=({},), weighted=True):
    def gen(op, device, dtype, requires_grad, **kw):
        make = _maker(device, dtype, requires_grad)
        for kwargs in extra:
            for reduction in ("mean", "sum", "none"):
                yield SampleInput(make((4, 5)), make((4, 5)), reduction=reduction, **kwargs)
            yield SampleInput(make(()), make(()), **kwargs)
            yield SampleInput(make((0, 3)), make((0, 3)), **kwargs)
            yield SampleInput(make((4, 5), noncontiguous=True), _leaf(make((5, 4)).transpose(0, 1), requires_grad),
                              **kwargs)
        if weighted:
            w = make_tensor((4, 5), device=device, dtype=dtype, low=0.0, high=2.0)
            for reduction in ("mean", "sum", "none"):
                yield SampleInput(make((4, 5)), make((4, 5)), reduction=reduction, weight=w)

    return gen


def _weight_errors(op, device, **kw):
    make = partial(make_tensor, device=device, dtype=F32)
    yield SampleInput(make((3,)), make((3,)), weight=make((2,))), ValueError, "Weights and input must have the same"
    yield SampleInput(make((3,)), make((3,)), reduction="avg"), ValueError, "avg is not a valid value for reduction"


mse_loss_opinfo = OpInfo(ltorch.mse_loss, torch_reference=F.mse_loss, dtypes=FLOATS,
                         sample_input_generator=_regression_generator(), error_input_generator=_weight_errors)
l1_loss_opinfo = OpInfo(F.l1_loss, name="l1_loss", torch_reference=F.l1_loss, dtypes=FLOATS,
                        sample_input_generator=_regression_generator())
smooth_l1_loss_opinfo = OpInfo(ltorch.smooth_l1_loss, torch_reference=F.smooth_l1_loss, dtypes=FLOATS,
                               sample_input_generator=_regression_generator(({}, {"beta": 0.5}, {"beta": 0.0}),
                                                                            weighted=False))
huber_loss_opinfo = OpInfo(ltorch.huber_loss, torch_reference=F.huber_loss, dtypes=FLOATS,
                           sample_input_generator=_regression_generator(({}, {"delta": 0.3})))


def _smooth_l1_errors(op, device, **kw):
    x = make_tensor((3,), device=device, dtype=F32)
    yield SampleInput(x, x, beta=-1.0), RuntimeError, "smooth_l1_loss does not support negative values for beta"


smooth_l1_loss_opinfo.error_input_generator = _smooth_l1_errors


def _huber_errors(op, device, **kw):
    x = make_tensor((3,), device=device, dtype=F32)
    yield SampleInput(x, x, delta=0.0), RuntimeError, "huber_loss does not support non-positive values for delta"
    yield SampleInput(x, x, weight=make_tensor((2,), device=device, dtype=F32)), ValueError, "Weights and input"


huber_loss_opinfo.error_input_generator = _huber_errors


# ---------------------------------------------------------------------------------------------------------
# binary and distribution losses


def _bce_generator(op, device, dtype, requires_grad, **kw):
    make = _maker(device, dtype, requires_grad)
    prob = partial(make, low=0.01, high=0.99)
    for reduction in ("mean", "sum", "none"):
        yield SampleInput(prob((4, 5)), prob((4, 5)).detach(), reduction=reduction)
        yield SampleInput(prob((4, 5)), prob((4, 5)).detach(), make((5,), low=0.0, high=2.0), reduction=reduction)
    edges = torch.tensor([0.0, 1.0, 1e-30, 0.5], device=device, dtype=dtype)  # log(0) clamps at -100
    yield SampleInput(_leaf(edges, requires_grad), torch.tensor([0.3, 0.7, 1.0, 0.0], device=device, dtype=dtype))
    yield SampleInput(prob(()), prob(()).detach())
    yield SampleInput(prob((0, 2)), prob((0, 2)).detach())


def _bce_errors(op, device, **kw):
    make = partial(make_tensor, device=device, dtype=F32, low=0.0, high=1.0)
    yield SampleInput(make((3,)), make((4,))), ValueError, "Using a target size .* that is different to the input"


binary_cross_entropy_opinfo = OpInfo(ltorch.binary_cross_entropy, torch_reference=F.binary_cross_entropy,
                                     dtypes=FLOATS, sample_input_generator=_bce_generator,
                                     error_input_generator=_bce_errors)


def _bce_logits_generator(op, device, dtype, requires_grad, **kw):
    make = _maker(device, dtype, requires_grad)
    prob = partial(make_tensor, device=device, dtype=dtype, low=0.0, high=1.0)
    pos = make((5,), low=0.5, high=3.0)
    for reduction in ("mean", "sum", "none"):
        yield SampleInput(make((4, 5)), prob((4, 5)), reduction=reduction)
        yield SampleInput(make((4, 5)), prob((4, 5)), make((4, 5), low=0.0, high=2.0), pos_weight=pos,
                          reduction=reduction)
    yield SampleInput(make((3, 5), low=-200.0, high=200.0), prob((3, 5)), pos_weight=pos)  # stable for large |x|
    yield SampleInput(make(()), prob(()))
    yield SampleInput(_leaf(make((5, 4)).transpose(0, 1), requires_grad), prob((4, 5)), make((5,)))


def _bce_logits_errors(op, device, **kw):
    make = partial(make_tensor, device=device, dtype=F32)
    yield SampleInput(make((3,)), make((4,))), ValueError, "must be the same as input size"


binary_cross_entropy_with_logits_opinfo = OpInfo(
    ltorch.binary_cross_entropy_with_logits, torch_reference=F.binary_cross_entropy_with_logits, dtypes=FLOATS,
    sample_input_generator=_bce_logits_generator, error_input_generator=_bce_logits_errors)


def _kl_div_generator(op, device, dtype, requires_grad, **kw):
    make = _maker(device, dtype, requires_grad)
    logp = make((4, 5), low=-4.0, high=0.0)
    for reduction in ("sum", "none", "batchmean", "mean"):
        yield SampleInput(logp, _probabilities((4, 5), device, dtype), reduction=reduction)
        yield SampleInput(logp, make((4, 5), low=-4.0, high=0.0).detach(), reduction=reduction, log_target=True)
    target = _probabilities((4, 5), device, dtype)
    target[0, 0] = 0  # 0 * log(0) is 0
    yield SampleInput(logp, target, reduction="sum")


kl_div_opinfo = OpInfo(ltorch.kl_div, torch_reference=F.kl_div, dtypes=FLOATS,
                       sample_input_generator=_kl_div_generator)


def _cosine_generator(op, device, dtype, requires_grad, **kw):
    make = _maker(device, dtype, requires_grad)
    yield SampleInput(make((4, 5)), make((4, 5)))
    yield SampleInput(make((4, 5)), make((4, 5)), 0)
    yield SampleInput(make((2, 3, 4)), make((3, 4)), dim=-1)  # broadcasting
    yield SampleInput(make((4, 5)), torch.zeros(4, 5, device=device, dtype=dtype), eps=1e-3)  # eps guards 0
    yield SampleInput(make((4, 5), noncontiguous=True), _leaf(make((5, 4)).transpose(0, 1), requires_grad))


cosine_similarity_opinfo = OpInfo(ltorch.cosine_similarity, torch_reference=F.cosine_similarity, dtypes=FLOATS,
                                  sample_input_generator=_cosine_generator)


# ---------------------------------------------------------------------------------------------------------
# scaled_dot_product_attention


def _sdpa_generator(op, device, dtype, requires_grad, **kw):
    make = _maker(device, dtype, requires_grad)
    q, k, v = make((2, 3, 5, 8)), make((2, 3, 7, 8)), make((2, 3, 7, 6))
    yield SampleInput(q, k, v)
    yield SampleInput(q, k, v, scale=0.2)
    yield SampleInput(q, make((2, 3, 5, 8)), make((2, 3, 5, 6)), is_causal=True)
    yield SampleInput(q, k, v, is_causal=True)  # L < S: the top-left aligned triangle
    bool_mask = make_tensor((5, 7), device=device, dtype=torch.bool)
    bool_mask[2] = False  # a fully masked row gives zeros
    yield SampleInput(q, k, v, attn_mask=bool_mask)
    yield SampleInput(q, k, v, make_tensor((2, 1, 5, 7), device=device, dtype=torch.bool))  # broadcast over heads
    yield SampleInput(q, k, v, attn_mask=make((5, 7)).detach())  # additive float mask
    yield SampleInput(make((2, 6, 5, 8)), make((2, 2, 7, 8)), make((2, 2, 7, 8)), enable_gqa=True)
    yield SampleInput(make((2, 4, 5, 8)), make((2, 1, 7, 8)), make((2, 1, 7, 8)))  # one kv head broadcasts
    yield SampleInput(make((3, 5, 8)), make((3, 7, 8)), make((3, 7, 4)))  # no head dim
    t = _leaf(make((2, 5, 3, 8)).transpose(1, 2), requires_grad)  # (B, L, H, E) storage, as after a projection
    yield SampleInput(t, t, t, is_causal=True)
    yield SampleInput(q, k, v, dropout_p=0.3)
    yield SampleInput(q, k, v, attn_mask=bool_mask, dropout_p=0.5, scale=0.5)
    yield SampleInput(q, k, v, dropout_p=1.0)


def _sdpa_errors(op, device, **kw):
    make = partial(make_tensor, device=device, dtype=F32)
    q = make((2, 4, 3, 8))
    yield SampleInput(q, make((2, 4, 5, 8), dtype=F64), make((2, 4, 5, 8))), RuntimeError, \
        "Expected query, key, and value to have the same dtype"
    yield SampleInput(q, make((2, 3, 5, 8)), make((2, 3, 5, 8)), enable_gqa=True), RuntimeError, \
        "Number of heads in key and value must divide the number of heads in"
    yield SampleInput(q, q, q, attn_mask=make((3, 3), dtype=I64)), RuntimeError, \
        "Expected attn_mask dtype to be bool or float or to match query dtype"
    yield SampleInput(q, q, q, dropout_p=1.5), RuntimeError, "dropout probability has to be between 0 and 1"
    yield SampleInput(make((3,)), make((3,)), make((3,))), RuntimeError, "at least 2 dimensional"
    yield SampleInput(q, make((2, 4, 5, 8)), make((2, 4, 5, 6)), make((3, 5)) > 0, is_causal=True), RuntimeError, \
        "Explicit attn_mask should not be set when is_causal=True"


# float32: make_tensor's entries reach 9, so a score q.k/sqrt(E) reaches about 230 and its float32 rounding is
# up to ~1e-5 absolute. A softmax weight moves by the same relative amount and an output (|v| <= 9) by about
# 1e-4 between two correct summation orders; eager's flash kernel picks its blocking by thread count, so its
# own float32 result moves that much from one machine to another. A wrong function is off by far more.
sdpa_opinfo = OpInfo(ltorch.scaled_dot_product_attention, torch_reference=F.scaled_dot_product_attention,
                     dtypes=FLOATS, is_random=True, sample_input_generator=_sdpa_generator,
                     error_input_generator=_sdpa_errors, tolerance={F32: (1.3e-6, 1e-4)})
