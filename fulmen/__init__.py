"""fulmen: a source-to-source compiler for PyTorch programs.

    import fulmen
    model = fulmen.jit(model)          # or torch.compile(model, backend="fulmen")
    out = model(x)                     # traced, compiled and cached on the first call
    print(fulmen.last_traces(model)[-1])
"""

from __future__ import annotations

import functools as _functools
from collections.abc import Callable, Sequence
from typing import Any

# `torch` in this namespace is the submodule fulmen.torch (importing a subpackage binds its name here),
# so PyTorch is imported under another name.
import torch as _pytorch

from fulmen import prims  # noqa: F401
from fulmen import torch as ltorch  # noqa: F401
from fulmen.core import dtypes  # noqa: F401
from fulmen.core import transforms as _seed_transforms
from fulmen.core.options import JitOptions  # noqa: F401
from fulmen.core.proxies import DataDependentError  # noqa: F401
from fulmen.core.steps import Step  # noqa: F401
from fulmen.executors import inductor as _inductor  # registers the inductor fusion executor
from fulmen.executors import torchex as _torchex  # noqa: F401  (registers the torch executor)
from fulmen.executors.base import Executor, add_default_executor
from fulmen.executors.base import get_default_executors as _default_executors
from fulmen.frontend import distributed_wrappers as _wrappers
from fulmen.frontend import training as _training  # noqa: F401  (imported now, not inside the first call)
from fulmen.frontend.functional import grad, value_and_grad, vjp
from fulmen.frontend.jit import JittedFunction, get_stats
from fulmen.frontend.module import JittedModule
from fulmen.report import report  # noqa: F401  (the function, which shadows its module's name here)
from fulmen.transforms import custom_op_grads as _custom_op_grads  # noqa: F401  (custom ops' autograd formulas)
from fulmen.transforms import linearize as _linearize

__version__ = "0.1.0"

# Fusion through Inductor is on by default: regions compile in the background and swap in when ready.
add_default_executor(_inductor.ex)

# The seeds import autodiff from fulmen.core.transforms; the functions live in higher layers, handed down here.
_seed_transforms.provide(grad=grad, value_and_grad=value_and_grad, vjp=vjp, get_grad=_linearize.get_grad,
                         put_grad=_linearize.put_grad, put_grads=_linearize.put_grads,
                         compute_in_forward=_linearize.compute_in_forward, register_grad=_linearize.register_grad,
                         register_augmented_forward=_linearize.register_augmented_forward,
                         register_backward=_linearize.register_backward)

# Public names that live in higher layers are imported on first use: `import fulmen` stays cheap and
# the layers below never import the frontend.
_LAZY = {
    "trace": "fulmen.api:trace",
    "compile": "fulmen.api:compile",
    "examine": "fulmen.api:examine",
    "extend": "fulmen.extend",
    "executors": "fulmen.executors",
    "tests": "fulmen.tests",
}


def __getattr__(name: str):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'fulmen' has no attribute {name!r}")
    import importlib

    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    value = getattr(module, attr) if attr else module
    globals()[name] = value
    return value


__all__ = ["jit", "default_executors", "grad", "value_and_grad", "vjp", "trace", "compile", "examine",
           "DataDependentError", "last_traces", "last_backward_traces", "last_prologue_traces", "compile_stats",
           "cache_hits", "cache_misses", "report", "JitOptions", "Step"]


def jit(fn: Callable | _pytorch.nn.Module, executors: Sequence[Executor | str] | None = None, **options) -> Any:
    """Compile a function or an ``nn.Module``.

    ``executors`` lists executors (objects or registered names) in priority order, and it REPLACES the default
    list (``fulmen.default_executors()``: inductor fusion), so ``executors=["sdpa"]`` runs without fusion. To add
    one to the defaults, put it first: ``executors=["sdpa", *fulmen.default_executors()]``. The torch executor is
    always added last. A module comes back as a wrapper module sharing the original's parameters::

        model = fulmen.jit(nn.Linear(4, 4))
        y = model(x)

    The other options (``dynamic=``, ``compile=``, ``cuda_graphs=``, ``steps=``, ...) are the fields of
    ``fulmen.JitOptions``, given as keywords or as one ``options=JitOptions(...)``; see ``fulmen.core.options``
    for each one and its environment override. ``steps=`` adds pipeline steps (``fulmen.Step``).
    """
    if isinstance(fn, JittedModule | JittedFunction):
        return fn
    if isinstance(fn, _pytorch.nn.Module):
        if _wrappers.is_ddp(fn):  # DDP's forward runs eagerly around the compiled module, on every call
            from fulmen.frontend.jitted_ddp import JittedDDP

            return JittedDDP(fn, executors, **options)
        _wrappers.refuse_fsdp1_outside(fn)
        return JittedModule(fn, executors, **options)
    if isinstance(fn, _functools.partial) and not isinstance(fn.func, _pytorch.nn.Module):
        from fulmen.frontend.partials import JittedPartial  # its bound arguments are keyed as arguments

        return JittedPartial(fn, executors, **options)
    return JittedFunction(fn, executors, **options)


def default_executors() -> list[Executor]:
    """The executors ``fulmen.jit`` uses when given none (the torch executor, always last, not included).

    ``fulmen.jit(f, executors=[...])`` replaces this list; ``executors=["sdpa", *fulmen.default_executors()]``
    adds to it."""
    return list(_default_executors())


def compile_stats(fn) -> Any:
    """Counters, per-phase times and traces of a jitted function or module."""
    return get_stats(fn)


def last_traces(fn) -> list:
    """The traces of the last compilation, computation trace first, execution trace last."""
    return get_stats(fn).last_traces


def last_backward_traces(fn) -> list:
    return get_stats(fn).last_backward_traces


def last_prologue_traces(fn) -> list:
    return get_stats(fn).last_prologue_traces


def cache_hits(fn) -> int:
    return get_stats(fn).cache_hits


def cache_misses(fn) -> int:
    return get_stats(fn).cache_misses
