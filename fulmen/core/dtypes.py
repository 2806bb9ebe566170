"""Datatypes.

fulmen uses ``torch.dtype`` objects directly (``fulmen.dtypes.float32 is torch.float32``): a proxy's dtype
compares equal to the dtype of the tensor it stands for, and no conversion runs on the call path. This module
adds the classification and type-promotion helpers the languages need, and the short names traces print.
"""

from __future__ import annotations

import numbers

import torch

bool8 = torch.bool
uint8 = torch.uint8
int8 = torch.int8
int16 = torch.int16
int32 = torch.int32
int64 = torch.int64
float16 = torch.float16
bfloat16 = torch.bfloat16
float32 = torch.float32
float64 = torch.float64
complex64 = torch.complex64
complex128 = torch.complex128
float8_e4m3fn = torch.float8_e4m3fn
float8_e5m2 = torch.float8_e5m2
dtype = torch.dtype

_SHORT_NAMES = {
    torch.bool: "b8", torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32",
    torch.int64: "i64", torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32",
    torch.float64: "f64", torch.complex64: "c64", torch.complex128: "c128", torch.complex32: "c32",
    torch.float8_e4m3fn: "f8_e4m3fn", torch.float8_e5m2: "f8_e5m2", torch.uint16: "u16",
    torch.uint32: "u32", torch.uint64: "u64",
}

_FLOAT = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2}
_COMPLEX = {torch.complex32, torch.complex64, torch.complex128}
_INT = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64}

all_dtypes = tuple(_SHORT_NAMES)
float_dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
low_precision_dtypes = (torch.float16, torch.bfloat16)
int_dtypes = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
complex_dtypes = (torch.complex64, torch.complex128)


def short_name(d: torch.dtype) -> str:
    return _SHORT_NAMES.get(d, str(d).replace("torch.", ""))


def is_boolean_dtype(d: torch.dtype) -> bool:
    return d is torch.bool


def is_integer_dtype(d: torch.dtype) -> bool:
    """True for integer *and* boolean dtypes, as in ``torch._prims_common``."""
    return d in _INT or d is torch.bool


def is_exact_dtype(d: torch.dtype) -> bool:
    return is_integer_dtype(d)


def is_float_dtype(d: torch.dtype) -> bool:
    return d in _FLOAT


def is_complex_dtype(d: torch.dtype) -> bool:
    return d in _COMPLEX


def is_inexact_dtype(d: torch.dtype) -> bool:
    return d in _FLOAT or d in _COMPLEX


def is_low_precision_dtype(d: torch.dtype) -> bool:
    return d in (torch.float16, torch.bfloat16)


def to_torch_dtype(d: torch.dtype | type | None) -> torch.dtype | None:
    """Accept torch dtypes and the Python types torch accepts (``float``, ``int``, ``bool``, ``complex``)."""
    if d is None or isinstance(d, torch.dtype):
        return d
    if d is bool:
        return torch.bool
    if d is int:
        return torch.int64
    if d is float:
        return torch.get_default_dtype()
    if d is complex:
        return corresponding_complex_dtype(torch.get_default_dtype())
    raise TypeError(f"Expected a torch.dtype, but got {type(d).__name__} ({d!r})")


def corresponding_real_dtype(d: torch.dtype) -> torch.dtype:
    return {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}.get(d, d)


def corresponding_complex_dtype(d: torch.dtype) -> torch.dtype:
    return {torch.float16: torch.complex32, torch.bfloat16: torch.complex64, torch.float32: torch.complex64,
            torch.float64: torch.complex128}.get(d, d)


def python_type_dtype(x: bool | int | float | complex) -> torch.dtype:
    """The dtype torch gives a Python scalar (for type promotion these are *weak*)."""
    if isinstance(x, (bool, torch.SymBool)):
        return torch.bool
    if isinstance(x, (int, torch.SymInt)):
        return torch.int64
    if isinstance(x, (float, torch.SymFloat)):
        return torch.get_default_dtype()
    if isinstance(x, complex):
        return corresponding_complex_dtype(torch.get_default_dtype())
    # other number types (NumPy scalars): as torch treats them, by kind
    if isinstance(x, numbers.Integral):
        return torch.int64
    if isinstance(x, numbers.Real):
        return torch.get_default_dtype()
    if isinstance(x, numbers.Complex):
        return corresponding_complex_dtype(torch.get_default_dtype())
    raise TypeError(f"Expected a number, but got {type(x).__name__}")


_SCALAR_TYPE_NAMES = {
    torch.bool: "Bool", torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int",
    torch.int64: "Long", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float",
    torch.float64: "Double", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
}


def scalar_type_name(d: torch.dtype) -> str:
    """The name PyTorch's error messages give a dtype (``Float``, ``Long``)."""
    return _SCALAR_TYPE_NAMES.get(d, str(d).replace("torch.", ""))
