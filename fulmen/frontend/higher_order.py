"""While a program is traced, calls of PyTorch's higher-order control-flow functions reach fulmen.

``torch.cond``, ``while_loop`` and ``associative_scan`` are plain Python functions: they check that their inputs
are real tensors and hand the work to Dynamo, and no ``__torch_function__`` sees them first. User code often holds
them under its own names (``from torch._higher_order_ops import associative_scan``), so replacing a module
attribute would miss calls. While some thread traces, each function's code is replaced by a stub that sends the
call to ``fulmen.torch.higher_order`` when the calling thread is tracing user code, and to PyTorch's own code
otherwise (other threads, eager calls); the last trace to end puts the original code back.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
import types
from collections.abc import Callable, Iterator

from fulmen.core.trace import get_tracectx
from fulmen.torch import higher_order

#: (module, function name) -> fulmen's traced version
_ROUTES = {
    ("torch._higher_order_ops.cond", "cond"): higher_order.cond,
    ("torch._higher_order_ops.while_loop", "while_loop"): higher_order.while_loop,
    ("torch._higher_order_ops.associative_scan", "associative_scan"): higher_order.associative_scan,
}

_lock = threading.Lock()
_users = 0
# function -> (its own code, a function running that code, the stub's code); filled at the first trace
_patched: dict[Callable, tuple[types.CodeType, Callable, types.CodeType]] = {}
_by_index: list[tuple[Callable, Callable]] = []  # stub index -> (PyTorch's code as a function, fulmen's version)


def route(index: int, *args, **kwargs):
    """Where a stub sends a call: fulmen's version when this thread is tracing user code, PyTorch's otherwise."""
    original, traced = _by_index[index]
    trc = get_tracectx()
    if trc is not None and len(trc.scopes) == 1:
        return traced(*args, **kwargs)
    return original(*args, **kwargs)


def _stub_code(fn: Callable, index: int) -> types.CodeType:
    """Code with ``fn``'s parameters that calls ``route(index, ...)`` with them."""
    params, call = [], []
    star_done = False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.POSITIONAL_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD:
            params.append(p.name)
            call.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            params.append(f"*{p.name}")
            call.append(f"*{p.name}")
            star_done = True
        elif p.kind is p.KEYWORD_ONLY:
            if not star_done:
                params.append("*")
                star_done = True
            params.append(p.name)
            call.append(f"{p.name}={p.name}")
        else:
            params.append(f"**{p.name}")
            call.append(f"**{p.name}")
    source = (f"def {fn.__name__}({', '.join(params)}):\n"
              "    from fulmen.frontend.higher_order import route\n"
              f"    return route({', '.join([str(index), *call])})\n")
    namespace: dict = {}
    exec(compile(source, f"<fulmen route {fn.__name__}>", "exec"), namespace)
    return namespace[fn.__name__].__code__


def _prepare() -> None:
    if _patched:
        return
    for (module_name, name), traced in _ROUTES.items():
        fn = getattr(importlib.import_module(module_name), name, None)
        if not isinstance(fn, types.FunctionType) or fn.__code__.co_freevars:
            continue  # another torch release: its calls are traced as they come
        original = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        original.__kwdefaults__ = fn.__kwdefaults__
        _patched[fn] = (fn.__code__, original, _stub_code(fn, len(_by_index)))
        _by_index.append((original, traced))


@contextlib.contextmanager
def routing_higher_order_ops() -> Iterator[None]:
    """Route the calls (see the module docstring) for as long as any thread traces."""
    global _users
    with _lock:
        if _users == 0:
            _prepare()
            for fn, (_, _, stub) in _patched.items():
                fn.__code__ = stub
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                for fn, (code, _, _) in _patched.items():
                    fn.__code__ = code
