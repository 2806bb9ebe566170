"""Declaring primitives: ``make_prim`` and the metadata helpers their meta functions share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum, auto

import torch

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import OpTags, Symbol
from fulmen.core.symbolic import INT_TYPES, NUMBER_TYPES
from fulmen.core.utils import check


class PrimIDs(Enum):
    # unpacking and returning (trace structure)
    UNPACK_TRIVIAL = auto()
    RETURN = auto()
    # conversions and movement
    CONVERT_ELEMENT_TYPE = auto()
    DEVICE_PUT = auto()
    # creation
    FULL = auto()
    IOTA = auto()
    EMPTY = auto()
    UNIFORM = auto()
    NORMAL = auto()
    BERNOULLI = auto()
    RANDINT = auto()
    # the default generator's state
    MANUAL_SEED = auto()
    GET_RNG_STATE = auto()
    SET_RNG_STATE = auto()
    # elementwise unary
    ABS = auto(); NEG = auto(); EXP = auto(); EXP2 = auto(); EXPM1 = auto(); LOG = auto()  # noqa: E702
    LOG1P = auto(); LOG2 = auto(); LOG10 = auto(); SIN = auto(); COS = auto(); TAN = auto()  # noqa: E702
    ASIN = auto(); ACOS = auto(); ATAN = auto(); SINH = auto(); COSH = auto(); TANH = auto()  # noqa: E702
    ASINH = auto(); ACOSH = auto(); ATANH = auto(); SQRT = auto(); RSQRT = auto()  # noqa: E702
    RECIPROCAL = auto(); SIGN = auto(); SIGNBIT = auto(); FLOOR = auto(); CEIL = auto()  # noqa: E702
    ROUND = auto(); TRUNC = auto(); ERF = auto(); ERFC = auto(); ERFINV = auto(); LGAMMA = auto()  # noqa: E702
    DIGAMMA = auto(); SIGMOID = auto(); LOGICAL_NOT = auto(); BITWISE_NOT = auto()  # noqa: E702
    ISFINITE = auto(); ISNAN = auto(); ISINF = auto(); REAL = auto(); IMAG = auto(); CONJ = auto()  # noqa: E702
    # elementwise binary
    ADD = auto(); SUB = auto(); MUL = auto(); DIV = auto(); FLOOR_DIVIDE = auto()  # noqa: E702
    REMAINDER = auto(); FMOD = auto(); POW = auto(); ATAN2 = auto(); MAXIMUM = auto()  # noqa: E702
    MINIMUM = auto(); EQ = auto(); NE = auto(); LT = auto(); LE = auto(); GT = auto(); GE = auto()  # noqa: E702
    BITWISE_AND = auto(); BITWISE_OR = auto(); BITWISE_XOR = auto(); SHIFT_LEFT = auto()  # noqa: E702
    SHIFT_RIGHT = auto(); COPYSIGN = auto(); NEXTAFTER = auto()  # noqa: E702
    # elementwise ternary
    WHERE = auto()
    # shape
    BROADCAST_IN_DIM = auto()
    RESHAPE = auto()
    TRANSPOSE = auto()
    SQUEEZE = auto()
    SLICE = auto()
    PAD = auto()
    CAT = auto()
    FLIP = auto()
    UNFOLD = auto()
    STRIDE_ORDER = auto()
    # indexing
    TAKE = auto()
    TAKE_ALONG_AXIS = auto()
    INDEX_ADD = auto()
    INDEX_PUT = auto()
    SCATTER = auto()
    SCATTER_ADD = auto()
    # reductions
    SUM = auto(); PROD = auto(); AMAX = auto(); AMIN = auto(); VAR = auto(); VAR_MEAN = auto()  # noqa: E702
    ARGMAX = auto(); ARGMIN = auto(); CUMSUM = auto(); CUMPROD = auto(); TOPK = auto(); SORT = auto()  # noqa: E702
    # linear algebra, convolution, pooling
    MATMUL = auto()
    LINEAR = auto()
    CONVOLUTION = auto()
    # side effects
    COPY_ = auto()


_prims_by_id: dict[PrimIDs, Symbol] = {}


def make_prim(
    id: PrimIDs,
    name: str,
    *,
    meta: Callable,
    torch_impl: Callable,
    tags: Sequence[OpTags] = (),
    doc: str = "",
) -> Symbol:
    """Declare a primitive: its meta function (all input checks), its torch implementation, tags and docstring."""
    sym = Symbol(name=name, meta=meta, id=id, is_prim=True, tags=tuple(tags), module="prims", torch_impl=torch_impl,
                 doc=doc)
    _prims_by_id[id] = sym
    return sym


def all_prims() -> list[Symbol]:
    return list(_prims_by_id.values())


def prim_by_id(pid: PrimIDs) -> Symbol:
    return _prims_by_id[pid]


# ---- metadata helpers ----

def tensor_args(*args) -> list[TensorProxy]:
    return [a for a in args if isinstance(a, TensorProxy)]


def same_shape_device(op: str, *args) -> tuple[torch.Size, torch.device]:
    """Elementwise prims take tensors of one shape on one device (clang broadcasts before calling them)."""
    tensors = tensor_args(*args)
    check(tensors, lambda: f"prims.{op} expects at least one tensor", TypeError)
    shape, device = tensors[0].shape, tensors[0].device
    for t in tensors[1:]:
        check(t.shape == shape, lambda: f"prims.{op} expects tensors of one shape, but got {tuple(shape)} "
              f"and {tuple(t.shape)}; broadcast first (clang does this)", ValueError)
        check(t.device == device, lambda: f"prims.{op} expects tensors on one device, but got {device} and "
              f"{t.device}", RuntimeError)
    return shape, device


def same_dtype(op: str, *args) -> torch.dtype:
    tensors = tensor_args(*args)
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        check(t.dtype == dtype, lambda: f"prims.{op} expects tensors of one dtype, but got {dtype} and {t.dtype}; "
              "convert first (clang does this)", TypeError)
    for a in args:
        if not isinstance(a, (TensorProxy, *NUMBER_TYPES)) and a is not None:
            raise TypeError(f"prims.{op} expects tensors or numbers, but got {type(a).__name__}")
    return dtype


def check_valid_shape(shape: Sequence[int], op: str) -> None:
    for s in shape:
        check(isinstance(s, INT_TYPES) and not isinstance(s, bool) and s >= 0,
              lambda: f"{op}: shape entries must be non-negative ints, but got {tuple(shape)}", RuntimeError)
