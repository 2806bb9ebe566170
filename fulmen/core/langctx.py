"""The language context: what methods, operators and torch callables mean on a proxy.

``core`` cannot import the torch language (imports point down the layers), so the torch language
fills these tables when it is imported and ``TensorProxy`` looks names up here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: ``Tensor`` method name -> function taking the proxy first (``"add"`` -> ``ltorch.add``).
methods: dict[str, Callable] = {}
#: ``Tensor`` property name -> function of the proxy (``"T"``, ``"mT"``, ``"real"``).
properties: dict[str, Callable] = {}
#: torch callable (``torch.add``, ``torch.Tensor.add``, ``F.relu``) -> the torch-language function.
torch_functions: dict[Any, Callable] = {}
#: ``"module.QualName"`` of a ``torch.autograd.Function`` -> the torch-language function its ``apply`` records
#: (keyed by name: the Function's module need not be imported before it is used).
autograd_functions: dict[str, Callable] = {}
#: Called with a torch callable that has no torch-language function; returns a callable that records it opaquely.
fallback: list[Callable] = []
#: Called as ``check(op name, out tensor, *inputs)`` before ``op(..., out=...)`` writes (eager's overlap check).
out_checks: list[Callable] = []
#: ``TensorProxy.__array_ufunc__``'s handler, ``(ufunc, method, inputs, kwargs) -> result``: a NumPy ufunc or operator
#: met a proxy (``fulmen.torch.numpy_values``).
numpy_ufunc: list[Callable] = []


def method(name: str) -> Callable:
    """The torch-language function for ``Tensor.<name>``; without one, the opaque fallback for it."""
    fn = methods.get(name)
    if fn is not None:
        return fn
    import torch

    tensor_attr = getattr(torch.Tensor, name, None)
    if tensor_attr is not None and fallback:
        return fallback[0](tensor_attr)
    raise AttributeError(f"'TensorProxy' has no method {name!r} (no torch-language rule for Tensor.{name})")
