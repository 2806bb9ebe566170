"""Small helpers shared by every layer: lazy-message checks and dimension arithmetic."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from fulmen.core.symbolic import INT_TYPES

#: Held while importing PyTorch's compiler stack (Dynamo, Inductor, symbolic shapes) lazily. The inductor
#: executor imports it on its background thread while tracing may import it on the main thread; two threads
#: importing those circular packages at once can see a partly initialized module.
compiler_import_lock = threading.RLock()


def check(cond: Any, message: Callable[[], str], exception_type: type[Exception] = RuntimeError) -> None:
    """Raise ``exception_type(message())`` when ``cond`` is false; the message is built only on failure."""
    if not cond:
        raise exception_type(message())


def check_type(value: Any, types: type | tuple[type, ...], what: str) -> None:
    if not isinstance(value, types):
        names = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
        raise TypeError(f"{what} must be {names}, but got {type(value).__name__} ({value!r})")


def canonicalize_dim(rank: int, dim: int, wrap_scalar: bool = True) -> int:
    """Map a possibly negative ``dim`` into ``[0, rank)``, raising torch's IndexError when out of range."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"dim must be an int, but got {type(dim).__name__} ({dim!r})")
    bound = rank if rank > 0 or not wrap_scalar else 1
    if dim < -bound or dim >= bound:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-bound}, {bound - 1}], but got {dim})")
    return dim + bound if dim < 0 else dim


def canonicalize_dims(rank: int, dims: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(dims, int):
        return (canonicalize_dim(rank, dims),)
    result = tuple(canonicalize_dim(rank, d) for d in dims)
    check(len(set(result)) == len(result), lambda: f"dim {tuple(dims)} appears multiple times in the list of dims")
    return result


def prod(xs: Sequence[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for length in reversed(shape):
        strides.append(acc)
        acc *= max(length, 1)
    return tuple(reversed(strides))


def extract_shape(*shape: Any) -> tuple[int, ...]:
    """Accept ``f(2, 3)``, ``f((2, 3))`` and ``f([2, 3])`` / ``torch.Size`` the way torch factories do."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    for s in shape:
        if not isinstance(s, INT_TYPES) or isinstance(s, bool):
            raise TypeError(f"shape entries must be ints, but got {type(s).__name__} ({s!r}) in {tuple(shape)}")
    return tuple(shape)
