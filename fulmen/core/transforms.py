"""The seeds' import path for autodiff: ``from fulmen.core.transforms import grad, get_grad, put_grads, ...``.

The functions live in ``fulmen.transforms.autodiff`` (a higher layer than ``fulmen.core``); this module
re-exports them lazily, on first attribute access, so that importing the core never imports autodiff.
``inline`` is kept for the seeds' ``@inline @value_and_grad`` form: in fulmen a transformed function is
always traced inline when it is called inside another trace, so ``inline`` returns its argument.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

_AUTODIFF = ("grad", "value_and_grad", "vjp", "get_grad", "put_grad", "put_grads", "compute_in_forward",
             "register_grad", "register_augmented_forward", "register_backward")

__all__ = ["inline", *_AUTODIFF]


def inline(fn: Callable) -> Callable:
    """Returns ``fn``: fulmen traces transformed functions (``value_and_grad(f)``) inline already."""
    if not callable(fn):
        raise TypeError(f"inline expects a callable, but got {type(fn).__name__}")
    return fn


def __getattr__(name: str) -> Any:
    if name in _AUTODIFF:
        value = getattr(importlib.import_module("fulmen.transforms.autodiff"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fulmen.core.transforms' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_AUTODIFF))
