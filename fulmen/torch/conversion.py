"""Torch language: dtype and device conversion (``Tensor.to``, ``float()``, ``cpu()`` ...) and ``copy_``.

As in eager PyTorch, a conversion that changes nothing returns its input itself (so an in-place update of
the result updates the input); ``copy=True`` always gives a new tensor.
"""

from __future__ import annotations

import builtins
import functools

import torch

from fulmen import prims
from fulmen.core.devices import Device, to_device
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import OpTags
from fulmen.core.utils import check
from fulmen.torch.inplace import mutate
from fulmen.torch.overlap import check_no_partial_overlap
from fulmen.torch.registry import register_function, tensor_methods, torchsymbol
from fulmen.torch.shape import clone, contiguous

__all__ = [
    "to", "type_as", "cpu", "cuda", "copy_", "float", "double", "half", "bfloat16", "int", "long", "short", "bool",
    "byte", "char",
]

_CONVERSION = (OpTags.DEVICE_OP,)
_DEVICE_TYPES = (str, torch.device, Device)


def _is_int(x) -> builtins.bool:
    return isinstance(x, builtins.int) and not isinstance(x, builtins.bool)


def _convert(a: TensorProxy, dtype: torch.dtype | None, device, copy: builtins.bool, memory_format) -> TensorProxy:
    out = a
    if dtype is not None and dtype != a.dtype:
        out = prims.convert_element_type(out, dtype)
    if device is not None:
        device = to_device(device)
        if device != a.device:
            out = prims.device_put(out, device)
    if memory_format not in (None, torch.preserve_format):
        out = contiguous(out, memory_format=memory_format)
    return clone(out) if copy and out is a else out


def _parse_to(a, args, kwargs):
    """``to(dtype)``, ``to(device, dtype)``, ``to(other)``, each with non_blocking / copy / memory_format."""
    dtype, device = kwargs.pop("dtype", None), kwargs.pop("device", None)
    other = kwargs.pop("other", None)
    rest = list(args)
    if rest and isinstance(rest[0], TensorProxy):
        other = rest.pop(0)
    elif rest and isinstance(rest[0], torch.dtype):
        dtype = rest.pop(0)
    elif rest and (isinstance(rest[0], _DEVICE_TYPES) or _is_int(rest[0])):
        device = rest.pop(0)
        if rest and (isinstance(rest[0], torch.dtype) or rest[0] is None):
            dtype = rest.pop(0)
    if other is not None:
        dtype, device = other.dtype, other.device
    non_blocking = kwargs.pop("non_blocking", rest.pop(0) if rest else False)
    copy = kwargs.pop("copy", rest.pop(0) if rest else False)
    memory_format = kwargs.pop("memory_format", None)
    check(not rest and not kwargs, lambda: f"to() received an invalid combination of arguments: {tuple(args)} "
          f"{kwargs}", TypeError)
    check(isinstance(non_blocking, builtins.bool) and isinstance(copy, builtins.bool),
          lambda: f"to() received an invalid combination of arguments: {tuple(args)}", TypeError)
    check(dtype is None or isinstance(dtype, torch.dtype), lambda: f"to(): expected a torch.dtype, got {dtype!r}",
          TypeError)
    if _is_int(device):
        device = torch.device("cuda", device)
    return dtype, device, copy, memory_format


@torchsymbol(torch.Tensor.to, method_name="to", tags=_CONVERSION)
def to(a, *args, **kwargs):
    """``Tensor.to``: ``a`` itself when dtype and device already match (and ``copy`` is False)."""
    dtype, device, copy, memory_format = _parse_to(a, args, dict(kwargs))
    return _convert(a, dtype, device, copy, memory_format)


@torchsymbol(torch.Tensor.type_as, method_name="type_as", tags=_CONVERSION)
def type_as(a, other):
    """``Tensor.type_as``: ``other``'s dtype (and device type, as the legacy tensor type names carry it)."""
    device = other.device if other.device.type != a.device.type else None
    return _convert(a, other.dtype, device, False, None)


@torchsymbol(torch.Tensor.cpu, method_name="cpu", tags=_CONVERSION)
def cpu(a, memory_format=torch.preserve_format):
    return _convert(a, None, "cpu", False, memory_format)


@torchsymbol(torch.Tensor.cuda, method_name="cuda", tags=_CONVERSION)
def cuda(a, device=None, non_blocking: builtins.bool = False, memory_format=torch.preserve_format):
    check(torch.cuda.is_available(), lambda: "Tensor.cuda(): CUDA is not available (torch was not built with CUDA "
          "or no GPU is visible); keep the tensor on the CPU or use .to(device) with an available device",
          RuntimeError)
    target = torch.device("cuda", device) if _is_int(device) else torch.device(device or "cuda")
    return _convert(a, None, target, False, memory_format)


_LEGACY_NAMES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
                 torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)


@functools.cache
def _legacy_type_name(dtype: torch.dtype, device_type: str) -> str:
    """``Tensor.type()``: torch's own name for the dtype (``torch.ComplexFloatTensor``), ``torch.cuda.`` on CUDA."""
    with torch._C.DisableTorchFunction():  # a real CPU tensor of no elements, made outside the tracer
        name = torch.empty(0, dtype=dtype).type()
    return name.replace("torch.", "torch.cuda.", 1) if device_type == "cuda" else name


def _type(a, dtype=None, non_blocking: builtins.bool = False, **kwargs):
    """``Tensor.type()`` (the legacy type name, a string) and ``Tensor.type(dtype or name)`` (a conversion)."""
    if dtype is None:
        return _legacy_type_name(a.dtype, a.device.type)
    if isinstance(dtype, str):
        by_name = {_legacy_type_name(d, t): (d, t) for d in _LEGACY_NAMES for t in ("cpu", "cuda")}
        check(dtype in by_name, lambda: f"invalid type: '{dtype}'", ValueError)
        dtype, device_type = by_name[dtype]
        return to(a, device_type if device_type != a.device.type else a.device, dtype)
    return to(a, dtype)


register_function(tensor_methods("type"), _type, method_names=["type"])


def copy_(a, src, non_blocking: builtins.bool = False):
    """``Tensor.copy_``: ``a`` (and what it views) takes ``src``'s values."""
    check(isinstance(src, TensorProxy), lambda: f"copy_(): argument 'src' (position 1) must be Tensor, not "
          f"{type(src).__name__}", TypeError)
    check_no_partial_overlap("copy_", a, src)
    if src.device != a.device:
        src = prims.device_put(src, a.device)
    elif src.dtype == a.dtype and tuple(src.shape) == tuple(a.shape):
        # ``a`` gets its own copy: were ``src`` itself ``a``'s new value, both would follow one chain of values
        # and a later in-place update of either would show in the other
        src = clone(src)
    return mutate(a, src, overwrites=True)


register_function(tensor_methods("copy_"), copy_, method_names=["copy_"])


def _dtype_method(name: str, dtype: torch.dtype):
    def fn(a, memory_format=torch.preserve_format):
        return _convert(a, dtype, None, False, memory_format)

    fn.__name__ = name
    fn.__doc__ = f"``Tensor.{name}()``: ``a.to({dtype})``; ``a`` itself when it already is {dtype}."
    return torchsymbol(getattr(torch.Tensor, name), method_name=name, tags=_CONVERSION)(fn)


# Defined last: from here on these names shadow the builtins float, int and bool in this module.
float = _dtype_method("float", torch.float32)  # noqa: A001
double = _dtype_method("double", torch.float64)
half = _dtype_method("half", torch.float16)
bfloat16 = _dtype_method("bfloat16", torch.bfloat16)
int = _dtype_method("int", torch.int32)  # noqa: A001
long = _dtype_method("long", torch.int64)
short = _dtype_method("short", torch.int16)
bool = _dtype_method("bool", torch.bool)  # noqa: A001
byte = _dtype_method("byte", torch.uint8)
char = _dtype_method("char", torch.int8)
