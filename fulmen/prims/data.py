"""Primitives that create tensors, convert dtypes, move devices, draw random numbers and copy."""

from __future__ import annotations

from numbers import Number

import torch

from fulmen.core import dtypes
from fulmen.core.devices import to_device, to_torch_device
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import OpTags
from fulmen.core.symbolic import INT_TYPES
from fulmen.core.utils import check
from fulmen.prims.base import PrimIDs, check_valid_shape, make_prim


def _convert_element_type_meta(a, dtype):
    check(isinstance(dtype, torch.dtype), lambda: f"convert_element_type expects a torch.dtype, got {dtype!r}",
          TypeError)
    check(isinstance(a, TensorProxy), lambda: f"convert_element_type expects a tensor, got {type(a).__name__}",
          TypeError)
    keeps_grad = a.requires_grad and dtypes.is_inexact_dtype(dtype)
    return TensorProxy(like=a, dtype=dtype, requires_grad=keeps_grad)


def _torch_convert(a, dtype):
    return a.to(dtype)


convert_element_type = make_prim(
    PrimIDs.CONVERT_ELEMENT_TYPE, "convert_element_type", meta=_convert_element_type_meta,
    torch_impl=_torch_convert, tags=(OpTags.ELEMENTWISE,),
    doc="Convert to another dtype with torch's casting rules.",
)


def _device_put_meta(a, device):
    return TensorProxy(like=a, device=to_device(device))


def _torch_device_put(a, device):
    return a.to(to_torch_device(device))


device_put = make_prim(PrimIDs.DEVICE_PUT, "device_put", meta=_device_put_meta, torch_impl=_torch_device_put,
                       tags=(OpTags.DEVICE_OP,), doc="Copy to another device.")


def _creation_meta(op):
    def meta(shape, *args, device, dtype, **kwargs):
        check_valid_shape(shape, f"prims.{op}")
        check(isinstance(dtype, torch.dtype), lambda: f"prims.{op} needs a torch.dtype, got {dtype!r}", TypeError)
        return TensorProxy(shape=tuple(shape), device=to_device(device), dtype=dtype)

    return meta


def _torch_full(shape, fill_value, *, device: torch.device, dtype):
    return torch.full(tuple(shape), fill_value, device=to_torch_device(device), dtype=dtype)


def _full_meta(shape, fill_value, *, device, dtype):
    check(isinstance(fill_value, Number), lambda: f"prims.full expects a number fill value, got {fill_value!r}",
          TypeError)
    return _creation_meta("full")(shape, device=device, dtype=dtype)


full = make_prim(PrimIDs.FULL, "full", meta=_full_meta, torch_impl=_torch_full, tags=(OpTags.CREATION,),
                 doc="A tensor of the given shape filled with one value.")


def _iota_meta(length, *, start, step, device, dtype):
    check(isinstance(length, INT_TYPES) and length >= 0,
          lambda: f"prims.iota expects a non-negative length, got {length}", RuntimeError)
    return TensorProxy(shape=(length,), device=to_device(device), dtype=dtype)


def _torch_iota(length, *, start, step, device, dtype):
    return torch.arange(start, start + step * length, step, device=to_torch_device(device), dtype=dtype)[:length]


iota = make_prim(PrimIDs.IOTA, "iota", meta=_iota_meta, torch_impl=_torch_iota, tags=(OpTags.CREATION,),
                 doc="start, start + step, ... (length values).")


def _torch_empty(shape, *, device, dtype):
    return torch.empty(tuple(shape), device=to_torch_device(device), dtype=dtype)


empty = make_prim(PrimIDs.EMPTY, "empty", meta=_creation_meta("empty"), torch_impl=_torch_empty,
                  tags=(OpTags.CREATION,), doc="An uninitialized tensor.")


def _torch_uniform(shape, minval, maxval, *, device, dtype):
    return torch.empty(tuple(shape), device=to_torch_device(device), dtype=dtype).uniform_(minval, maxval)


uniform = make_prim(PrimIDs.UNIFORM, "uniform", meta=_creation_meta("uniform"), torch_impl=_torch_uniform,
                    tags=(OpTags.CREATION, OpTags.RANDOM_OP),
                    doc="Uniform samples in [minval, maxval) from torch's default generator (as torch.rand).")


def _torch_normal(shape, mean, std, *, device, dtype):
    return torch.empty(tuple(shape), device=to_torch_device(device), dtype=dtype).normal_(mean, std)


normal = make_prim(PrimIDs.NORMAL, "normal", meta=_creation_meta("normal"), torch_impl=_torch_normal,
                   tags=(OpTags.CREATION, OpTags.RANDOM_OP),
                   doc="Normal samples from torch's default generator (as torch.randn).")


def _bernoulli_meta(shape, p, *, device, dtype):
    return _creation_meta("bernoulli")(shape, device=device, dtype=dtype)


def _torch_bernoulli(shape, p, *, device, dtype):
    # Same generator calls as torch.nn.functional.dropout, so seeded runs match eager bit for bit.
    return torch.empty(tuple(shape), device=to_torch_device(device), dtype=dtype).bernoulli_(p)


bernoulli = make_prim(PrimIDs.BERNOULLI, "bernoulli", meta=_bernoulli_meta, torch_impl=_torch_bernoulli,
                      tags=(OpTags.CREATION, OpTags.RANDOM_OP), doc="1 with probability p, else 0.")


def _torch_randint(shape, low, high, *, device, dtype):
    return torch.randint(low, high, tuple(shape), device=to_torch_device(device), dtype=dtype)


randint = make_prim(PrimIDs.RANDINT, "randint", meta=_creation_meta("randint"), torch_impl=_torch_randint,
                    tags=(OpTags.CREATION, OpTags.RANDOM_OP), doc="Integers uniform in [low, high).")


def _manual_seed_meta(seed):
    check(isinstance(seed, int) and not isinstance(seed, bool), lambda: f"manual_seed expects an int, got {seed!r}",
          TypeError)


def _torch_manual_seed(seed):
    torch.manual_seed(seed)


manual_seed = make_prim(PrimIDs.MANUAL_SEED, "manual_seed", meta=_manual_seed_meta, torch_impl=_torch_manual_seed,
                        tags=(OpTags.SIDE_EFFECT, OpTags.RANDOM_OP),
                        doc="Seed torch's default generators (as torch.manual_seed).")


def _get_rng_state_meta():
    return TensorProxy(shape=(torch.get_rng_state().numel(),), dtype=torch.uint8, device="cpu")


get_rng_state = make_prim(PrimIDs.GET_RNG_STATE, "get_rng_state", meta=_get_rng_state_meta,
                          torch_impl=torch.get_rng_state, tags=(OpTags.RANDOM_OP,),
                          doc="The CPU default generator's state, as a uint8 tensor (as torch.get_rng_state).")


def _set_rng_state_meta(state):
    check(isinstance(state, TensorProxy) and state.dtype is torch.uint8, lambda: "set_rng_state expects the uint8 "
          f"tensor torch.get_rng_state() returns, got {state!r}", TypeError)


def _torch_set_rng_state(state):
    torch.set_rng_state(state)


set_rng_state = make_prim(PrimIDs.SET_RNG_STATE, "set_rng_state", meta=_set_rng_state_meta,
                          torch_impl=_torch_set_rng_state, tags=(OpTags.SIDE_EFFECT, OpTags.RANDOM_OP),
                          doc="Restore the CPU default generator's state (as torch.set_rng_state).")


def _copy_meta(src, dst):
    check(isinstance(dst, TensorProxy), lambda: "prims.copy_ writes into a tensor", TypeError)
    return TensorProxy(like=dst)


def _torch_copy(src, dst):
    with torch.no_grad():
        if 0 in dst.stride() and dst.numel() > 1:
            # dst's elements share memory (an expanded input written through, fulmen.torch.inplace
            # view_input_as_its_memory): src holds one value per memory location, so one element of each is written
            _without_repeats(dst).copy_(_without_repeats(src, like=dst))
            return dst
        return dst.copy_(src)


def _without_repeats(t, like=None):
    for d, st in enumerate((like if like is not None else t).stride()):
        if st == 0:
            t = t.narrow(d, 0, min(1, t.shape[d]))
    return t


copy_ = make_prim(PrimIDs.COPY_, "copy_", meta=_copy_meta, torch_impl=_torch_copy,
                  tags=(OpTags.SIDE_EFFECT, OpTags.NON_DIFFERENTIABLE),
                  doc="Write src into the caller's tensor dst (how in-place updates of inputs leave a trace).")
