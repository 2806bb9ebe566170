"""While a program is traced, calls of PyTorch's higher-order control-flow functions reach fulmen.

``torch.cond``, ``while_loop`` and ``associative_scan`` are plain Python functions: they check that their inputs
are real tensors and hand the work to Dynamo, and no ``__torch_function__`` sees them first. User code often holds
them under its own names (``from torch._higher_order_ops import associative_scan``), so replacing a module
attribute would miss calls. While some thread traces, each function's code is replaced by a stub that sends the
call to ``fulmen.torch.higher_order`` when the calling thread is tracing user code, and to PyTorch's own code
otherwise (other threads, eager calls); the last trace to end puts the original code back. The generator that
``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` runs around its function is routed the same way, to
``fulmen.frontend.checkpointing``, which records the checkpointed region.
"""

from __future__ import annotations

import importlib
import inspect
import types
from collections.abc import Callable

from fulmen.core.shared_patch import SharedPatch
from fulmen.core.trace import get_tracectx
from fulmen.frontend import checkpointing
from fulmen.torch import higher_order

#: (module, function's qualified name) -> fulmen's traced version (of a method: called without ``self``). The
#: operators' own ``__call__`` check their arguments' types before any ``__torch_function__`` sees them: Dynamo's
#: graphs call the operators (``torch.compile(backend="fulmen")``).
_ROUTES = {
    ("torch._higher_order_ops.cond", "cond"): higher_order.cond,
    ("torch._higher_order_ops.while_loop", "while_loop"): higher_order.while_loop,
    ("torch._higher_order_ops.associative_scan", "associative_scan"): higher_order.associative_scan,
    ("torch._higher_order_ops.cond", "CondOp.__call__"): higher_order.cond_op,
    ("torch._higher_order_ops.while_loop", "WhileLoopOp.__call__"): higher_order.while_loop_op,
    # checkpoint(use_reentrant=False) runs the function between two steps of this generator
    ("torch.utils.checkpoint", "_checkpoint_without_reentrant_generator"): checkpointing.without_reentrant,
    # a checkpointed function in a graph Dynamo captured
    ("torch._higher_order_ops.wrap", "TagActivationCheckpoint.__call__"): checkpointing.tag_activation_checkpoint,
}

# function -> (its own code, a function running that code, the stub's code); filled at the first trace
_patched: dict[Callable, tuple[types.CodeType, Callable, types.CodeType]] = {}
# stub index -> (PyTorch's code as a function, fulmen's version, whether it is a method)
_by_index: list[tuple[Callable, Callable, bool]] = []


def route(index: int, *args, **kwargs):
    """Where a stub sends a call: fulmen's version when this thread is tracing user code, PyTorch's otherwise."""
    original, traced, method = _by_index[index]
    trc = get_tracectx()
    if trc is not None and len(trc.scopes) == 1:
        return traced(*args[1:], **kwargs) if method else traced(*args, **kwargs)
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
    body = (f"def {fn.__name__}({', '.join(params)}):\n"
            "    from fulmen.frontend.higher_order import route\n"
            f"    return route({', '.join([str(index), *call])})\n")
    if fn.__code__.co_freevars:  # a method using super(): the stub is a method with the same __class__ cell
        body = body.replace("    from fulmen", "    __class__\n    from fulmen")
        body = "class _Stub:\n" + "".join("    " + line + "\n" for line in body.splitlines())
    namespace: dict = {}
    exec(compile(body, f"<fulmen route {fn.__qualname__}>", "exec"), namespace)
    stub = namespace["_Stub"].__dict__[fn.__name__] if fn.__code__.co_freevars else namespace[fn.__name__]
    return stub.__code__


def _prepare() -> None:
    if _patched:
        return
    for (module_name, qualname), traced in _ROUTES.items():
        fn = importlib.import_module(module_name)
        for part in qualname.split("."):
            fn = getattr(fn, part, None)
        if not isinstance(fn, types.FunctionType) or fn.__code__.co_freevars not in ((), ("__class__",)):
            continue  # another torch release: its calls are traced as they come
        original = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        original.__kwdefaults__ = fn.__kwdefaults__
        _patched[fn] = (fn.__code__, original, _stub_code(fn, len(_by_index)))
        _by_index.append((original, traced, "." in qualname))


def _route() -> None:
    _prepare()
    for fn, (_, _, stub) in _patched.items():
        fn.__code__ = stub


def _unroute() -> None:
    for fn, (code, _, _) in _patched.items():
        fn.__code__ = code


_routing = SharedPatch(_route, _unroute)


def routing_higher_order_ops() -> SharedPatch:
    """Route the calls (see the module docstring) for as long as any thread traces: ``with
    routing_higher_order_ops():``."""
    return _routing
