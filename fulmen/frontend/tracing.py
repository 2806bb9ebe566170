"""Running a user function on proxies to get its computation trace."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from fulmen import prims
from fulmen.core import langctx
from fulmen.core.codeutils import sanitize_name
from fulmen.core.proxies import Proxy, TensorProxy, is_library_file, latest
from fulmen.core.trace import Trace, get_tracectx, tracectx
from fulmen.transforms.autocast import current_policies


@dataclass
class InputSpec:
    """How the flat tensor inputs of a trace are found in a call's arguments."""

    tensor_proxies: list[TensorProxy] = field(default_factory=list)
    captured: list[torch.Tensor] = field(default_factory=list)  # closure/global tensors, passed after the args


def _arg_names(fn: Callable, args: tuple, kwargs: dict) -> list[str]:
    try:
        sig = inspect.signature(fn)
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return [f"t_{i}" for i in range(len(args))] + list(kwargs)
    names = []
    for name, param in sig.parameters.items():
        if name not in bound.arguments:
            continue
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            names += [f"{name}_{i}" for i in range(len(bound.arguments[name]))]
        elif param.kind is not inspect.Parameter.VAR_KEYWORD:
            names.append(name)
    return names


def proxify(trace: Trace, value: Any, name: str, flat: list[TensorProxy], sizes: list | None = None) -> Any:
    """Replace every tensor in ``value`` (tuples, lists, dicts) by a named TensorProxy input; ``sizes`` (by flat
    position) overrides the tensors' shapes with symbolic ones."""
    if isinstance(value, torch.Tensor):
        shape = value.shape if sizes is None else sizes[len(flat)]
        p = TensorProxy(trace.add_name(name), shape=shape, dtype=value.dtype, device=value.device,
                        requires_grad=value.requires_grad)
        if value.requires_grad and value.is_leaf:
            p._origin = "input-leaf"
        flat.append(p)
        return p
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(proxify(trace, v, f"{name}_{i}", flat, sizes) for i, v in enumerate(value))
    if isinstance(value, tuple):  # namedtuple
        return type(value)(*(proxify(trace, v, f"{name}_{f}", flat, sizes) for f, v in zip(value._fields, value)))
    if isinstance(value, dict):
        return {k: proxify(trace, v, f"{name}_{k}", flat, sizes) for k, v in value.items()}
    return value


class _Capture:
    """Turns real tensors that reach a symbol while tracing (closures, globals) into extra trace inputs."""

    def __init__(self, trace: Trace, spec: InputSpec):
        self.trace, self.spec = trace, spec
        self.by_id: dict[int, TensorProxy] = {}

    def __call__(self, x):
        if isinstance(x, torch.Tensor):
            p = self.by_id.get(id(x))
            if p is None:
                p = TensorProxy(self.trace.add_name("captured"), shape=x.shape, dtype=x.dtype, device=x.device,
                                requires_grad=x.requires_grad)
                self.by_id[id(x)] = p
                self.spec.captured.append(x)
                self.spec.tensor_proxies.append(p)
                self.trace.args.append(p)
            return p
        if type(x) in (tuple, list):
            return type(x)(self(v) for v in x)
        return x


def _has_proxy(x: Any) -> bool:
    if isinstance(x, Proxy):
        return True
    if isinstance(x, (tuple, list)):
        return any(_has_proxy(v) for v in x)
    if isinstance(x, dict):
        return any(_has_proxy(v) for v in x.values())
    return False


_FULMEN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# fulmen's own layers; code elsewhere in the package (fulmen/bench models, examples) counts as user code
_INTERNAL = tuple(os.path.join(_FULMEN_DIR, d) for d in ("core", "torch", "prims", "clang.py", "transforms",
                                                         "executors", "frontend"))


def _called_by_fulmen() -> bool:
    """Whether the torch call being intercepted comes from fulmen's own code rather than the user's."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not is_library_file(filename) or filename.startswith(_FULMEN_DIR):
            return filename.startswith(_INTERNAL)
        frame = frame.f_back
    return False


class _UserTorchCalls(TorchFunctionMode):
    """Routes torch calls that have no proxy argument (``torch.rand(3)``, ``torch.arange(n)``) made by user
    code to the torch language, so they run on every call instead of being computed once while tracing."""

    def __init__(self, trace: Trace):
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        trc = get_tracectx()
        if trc is self.trace and len(trc.scopes) == 1:  # user code, not a meta or a decomposition
            fn = langctx.torch_functions.get(func)
            if fn is not None and not _has_proxy((args, kwargs)) and not _called_by_fulmen():
                return fn(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _compiling():
    """``torch.compiler.is_compiling()`` is true while fulmen traces, as under Dynamo: libraries (transformers'
    mask and MoE code) then skip data-dependent checks and take their compile-friendly paths."""
    if not hasattr(torch.compiler, "_is_compiling_flag"):  # a private flag; torch releases without it trace as-is
        yield
        return
    saved = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = saved


def trace_program(fn: Callable, args: tuple, kwargs: dict, *, arg_names: list[str] | None = None,
                  fn_name: str = "computation",
                  state: list[tuple[str, torch.Tensor]] | None = None,
                  sizes: list | None = None) -> tuple[Trace, InputSpec]:
    """Trace ``fn(*args, **kwargs)``: tensors become proxies, every torch call becomes a bound symbol.

    ``state`` (a module's parameters and buffers, by name) becomes the first inputs; ``fn`` then receives
    the list of their proxies as its first argument. ``sizes`` gives the shape of each tensor input in flat
    order (state first), with ``torch.SymInt`` for dynamic dimensions (``fulmen.frontend.dynamic``).
    """
    trace = Trace(fn_name)
    spec = InputSpec()
    names = arg_names or _arg_names(fn, args, kwargs)
    proxy_args = []
    flat = spec.tensor_proxies
    if state is not None:
        proxy_args.append([proxify(trace, t, name, flat, sizes) for name, t in state])
    for i, a in enumerate(args):
        proxy_args.append(proxify(trace, a, names[i] if i < len(names) else f"t_{i}", flat, sizes))
    proxy_kwargs = {k: proxify(trace, v, sanitize_name(k), flat, sizes) for k, v in kwargs.items()}
    if sizes is not None and len(flat) != len(sizes):
        raise RuntimeError(f"symbolic sizes: found {len(flat)} tensor inputs, expected {len(sizes)}")
    trace.args = list(spec.tensor_proxies)
    trace.capture = _Capture(trace, spec)
    trace.autocast = current_policies()
    with tracectx(trace), _UserTorchCalls(trace), _compiling():
        result = fn(*proxy_args, **proxy_kwargs)
        result = trace.capture(result) if isinstance(result, torch.Tensor) else result
        result = _resolve_outputs(result)
        _write_back_mutated_inputs(trace)
    trace.capture = None
    trace.autocast = []
    trace.output = result
    trace.provenance = None
    return trace, spec


def _resolve_outputs(x):
    if isinstance(x, TensorProxy):
        return latest(x)
    if isinstance(x, (tuple, list)) and not hasattr(x, "_fields"):
        return type(x)(_resolve_outputs(v) for v in x)
    if isinstance(x, tuple):
        return type(x)(*(_resolve_outputs(v) for v in x))
    if isinstance(x, dict):
        return type(x)((k, _resolve_outputs(v)) for k, v in x.items())
    if isinstance(x, torch.Tensor):
        raise TypeError("the function returned a tensor it did not compute from its inputs; fulmen.jit expects "
                        "returned tensors to come from the traced computation")
    if _hides_proxies(x):
        raise TypeError(
            f"the function returned a {type(x).__name__} object that holds traced tensors inside its attributes; "
            "fulmen.jit can return tensors in tuples, lists, dicts and pytree-registered containers only (the "
            "object would hold placeholders instead of tensors). Return the tensors themselves, register the class "
            "with torch.utils._pytree, or for Hugging Face models pass use_cache=False.")
    return x


def _hides_proxies(x: Any, depth: int = 0) -> bool:
    """Whether an opaque object keeps proxies in its attributes (a few levels deep)."""
    if isinstance(x, Proxy):
        return True
    if depth > 3 or isinstance(x, (str, bytes, int, float, complex, bool, type(None), torch.Tensor, type)):
        return False
    if isinstance(x, (tuple, list, set)):
        return any(_hides_proxies(v, depth + 1) for v in x)
    if isinstance(x, dict):
        return any(_hides_proxies(v, depth + 1) for v in x.values())
    attrs = getattr(x, "__dict__", None)
    return isinstance(attrs, dict) and any(_hides_proxies(v, depth + 1) for v in attrs.values())


def _write_back_mutated_inputs(trace: Trace) -> None:
    """Inputs changed in place get their new value copied into the caller's tensor, as eager would."""
    if not trace.has_mutations:
        return
    changed = [(latest(p), p) for p in trace.args if latest(p) is not p]
    # symbols read the latest value of a mutated proxy; copy_ must name the caller's tensor itself
    trace.has_mutations = False
    try:
        for new, p in changed:
            prims.copy_(new, p)
    finally:
        trace.has_mutations = True
