"""The seeds' import path for autodiff: ``from fulmen.core.transforms import grad, get_grad, put_grads, ...``.

The functions live in higher layers (``grad`` / ``value_and_grad`` / ``vjp`` in ``fulmen.frontend.functional``, the
rule registration in ``fulmen.transforms.linearize``); the core never imports them. ``import fulmen``, which runs
before any of its submodules is imported, hands them to this module (``provide``). ``inline`` is kept for the
seeds' ``@inline @value_and_grad`` form: in fulmen a transformed function is always traced inline when it is called
inside another trace, so ``inline`` returns its argument.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The names ``provide`` fills in.
SEED_NAMES = (
    "grad",
    "value_and_grad",
    "vjp",
    "get_grad",
    "put_grad",
    "put_grads",
    "compute_in_forward",
    "register_grad",
    "register_augmented_forward",
    "register_backward",
)

__all__ = ["inline", *SEED_NAMES]


def inline(fn: Callable) -> Callable:
    """Returns ``fn``: fulmen traces transformed functions (``value_and_grad(f)``) inline already."""
    if not callable(fn):
        raise TypeError(f"inline expects a callable, but got {type(fn).__name__}")
    return fn


def provide(**functions: Callable) -> None:
    """Make the layers' functions importable from here (called once, by ``fulmen/__init__.py``)."""
    unknown = set(functions) - set(SEED_NAMES)
    if unknown:
        raise ValueError(f"fulmen.core.transforms.provide: {sorted(unknown)} are not seed names ({SEED_NAMES})")
    globals().update(functions)


def __getattr__(name: str) -> Any:
    if name in SEED_NAMES:  # only while `import fulmen` has not finished
        raise AttributeError(
            f"fulmen.core.transforms.{name} is provided by `import fulmen`, which has not finished (a circular import?)"
        )
    raise AttributeError(f"module 'fulmen.core.transforms' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(SEED_NAMES))
