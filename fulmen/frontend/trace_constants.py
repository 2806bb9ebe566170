"""Which torch calls the user's code makes may run once while tracing, their results kept as constants.

``_UserTorchCalls`` (``fulmen.frontend.tracing``) handles each torch call of the user's code with its mode switched
off: whatever it runs itself runs once, and its result is baked into the program. That is sound only for a value
that depends on nothing that can change between calls. These calls break the rule and are recorded instead:

- a torch function written in Python with no torch-language rule (``F.softmin``, ``torch.cdist``, ``torch.unique``)
  on a tensor read from a global, a closure or an object: its inner torch calls come from torch's own frames with
  the mode off, so none of them is recorded. Its real tensors are captured as inputs of the trace (as ``W * 1``
  captures ``W``) and the call goes where it would go had the user passed them as arguments
  (``TensorProxy.__torch_function__``: its rule, or one opaque op running it on every call). So does a call mixing
  proxies and real tensors (``torch.stft(W, n, window=proxy)``, which dispatches on ``W`` alone);
- a Python read of such a tensor's values (``W.item()``, ``float(W)``): the proxy's, checked at every call by a
  value guard, or an error naming the user's line (``W.numpy()``, whose array shares the tensor's memory);
- an ATen function that makes tensors from no tensor at all (``aten.scalar_tensor``, ``aten.empty_strided``, as
  aten graphs run through ``TorchCalls`` call them) is recorded by ``computes_tensors``, so a returned or written
  result is a fresh tensor at each call, not one tensor shared by every call.

What still runs once is what reads no tensor's values: metadata (``W.dim()``), hooks, storage questions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from fulmen.core.proxies import TensorProxy
from fulmen.core.tracectx import current

# torch.Tensor methods written in Python that keep books on the tensor object rather than compute from its values:
# eager runs them on the real tensor, and so does the trace (once)
_BOOKKEEPING = frozenset(
    (
        "storage",
        "storage_type",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "is_shared",
        "share_memory_",
        "module_load",
        "reinforce",
        "index",
    )
)

# torch.Tensor methods that give Python a tensor's values: on a captured tensor the proxy's, which read the value at
# every call (a value guard) or name the user's line
_VALUE_READS = frozenset(
    (
        "item",
        "tolist",
        "numpy",
        "__array__",
        "__bool__",
        "__float__",
        "__int__",
        "__index__",
        "__complex__",
        "__contains__",
    )
)


# torch.Tensor's operators written in Python (``1 - W`` calls ``W.__rsub__(1)``, ``0.9 ** W`` ``W.__rpow__(0.9)``):
# they compute from the tensor's values like any method
_PYTHON_OPERATORS = frozenset(
    (
        "__rsub__",
        "__rdiv__",
        "__rtruediv__",
        "__pow__",
        "__ipow__",
        "__rpow__",
        "__rmod__",
        "__floordiv__",
        "__rfloordiv__",
        "__rlshift__",
        "__rrshift__",
        "__rmatmul__",
        "__reversed__",
    )
)


def _python_computation(func: Callable) -> bool:
    """Whether ``func`` is a torch function written in Python that may compute tensors from the ones it is given."""
    if not inspect.isfunction(func):
        return False
    name = func.__name__
    if getattr(torch.Tensor, name, None) is func:  # a Tensor method: computing ones only, not __repr__ or hooks
        return name in _PYTHON_OPERATORS or (not name.startswith("_") and name not in _BOOKKEEPING)
    return (func.__module__ or "").startswith("torch")


def _reads_values(func: Callable) -> bool:
    """Whether ``func`` is a ``torch.Tensor`` method that gives Python the tensor's values (``W.item()``)."""
    name = getattr(func, "__name__", None)
    return name in _VALUE_READS and getattr(torch.Tensor, name, None) is func


def reads_captured_tensors(func: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether the user's call ``func(*args, **kwargs)`` (no proxy among them, no torch-language rule) is a Python
    torch function computing on real tensors: tensors of the program's state, to be read at every call."""
    return (_python_computation(func) or _reads_values(func)) and any(
        isinstance(x, torch.Tensor) for x in tree_leaves((args, kwargs))
    )


def _is_real(x: Any) -> bool:
    return type(x) is not TensorProxy and isinstance(x, torch.Tensor)


def mixes_real_tensors(args: tuple, kwargs: dict) -> bool:
    """Whether a call on proxies also takes real tensors, as arguments or in a list of them: ``torch.stft(W, n,
    window=proxy)`` dispatches on ``W`` alone, so torch would run its Python body with fulmen's mode off and compute
    on ``W`` once, while tracing. (Asked of every traced call of the user's code: a flat scan, not a tree walk.)"""
    for x in (*args, *kwargs.values()):
        kind = type(x)
        if kind is tuple or kind is list:
            if any(map(_is_real, x)):
                return True
        elif _is_real(x):
            return True
    return False


def call_on_captured(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``func`` called with its real tensors captured as inputs of the trace, as if they had been passed as proxies."""
    args, kwargs = tree_map_only(torch.Tensor, current.tracer.capture, (args, kwargs))
    return TensorProxy.__torch_function__(func, (TensorProxy,), args, kwargs)
