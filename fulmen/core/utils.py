"""Small helpers shared by every layer: lazy-message checks and dimension arithmetic."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

#: Held while importing PyTorch's compiler stack (Dynamo, Inductor, symbolic shapes) lazily. The inductor
#: executor imports it on its background thread while tracing may import it on the main thread; two threads
#: importing those circular packages at once can see a partly initialized module.
compiler_import_lock = threading.RLock()


class RunsEagerly(Exception):  # noqa: N818 (not an error: the call runs, eagerly)
    """Raised while tracing where a program cannot compute what eager does; the caller runs the function eagerly
    for calls with this key (``str(e)`` says why, naming the user's line)."""


def check(cond: Any, message: Callable[[], str], exception_type: type[Exception] = RuntimeError) -> None:
    """Raise ``exception_type(message())`` when ``cond`` is false; the message is built only on failure."""
    if not cond:
        raise exception_type(message())


def canonicalize_dim(rank: int, dim: int, wrap_scalar: bool = True) -> int:
    """Map a possibly negative ``dim`` into ``[0, rank)``, raising torch's IndexError when out of range."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"dim must be an int, but got {type(dim).__name__} ({dim!r})")
    bound = rank if rank > 0 or not wrap_scalar else 1
    if dim < -bound or dim >= bound:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-bound}, {bound - 1}], but got {dim})")
    return dim + bound if dim < 0 else dim


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


class IdentityRef:
    """A key part that is an object's identity (equal only to a reference to the same object). It holds the object,
    so the object's address cannot be reused by another one while the key exists: a key holding ``id()`` alone
    would let a new object at a dead one's address select what was cached for the dead one."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return type(other) is IdentityRef and other.obj is self.obj

    def __repr__(self) -> str:
        return f"<the {type(self.obj).__name__} object at {id(self.obj):#x}>"
