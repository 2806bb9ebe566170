"""A region's aten graph, captured on fake tensors without changing anything the process's other threads see.

Inductor compiles an aten-level FX graph. ``make_fx`` makes one by running the region's Python on fake tensors
under a dispatch mode that records each aten call into a graph (``ProxyTorchDispatchMode``), with Inductor's
decompositions applied. It starts that run through ``torch.fx.Tracer.trace``, which, for as long as the run
lasts, replaces ``torch.nn.Module.__call__`` and ``__getattr__`` (and every ``torch.fx.wrap``'d function) for the
whole process and sets FX's process-wide "symbolic tracing" flag. fulmen lowers regions on a background thread:
the user's code on the main thread would meet FX's wrappers, and Dynamo tracing it breaks ("Guard failed on the
same frame it was created") or recompiles on every call and falls back to eager.

For a dispatch-level trace those patches do nothing: the recording tracer's ``call_module`` calls ``forward`` and
its ``getattr`` returns the attribute, and the function it runs receives fake tensors, never FX proxies, so a
wrapped function calls the original. ``_DispatchGraphTracer`` is make_fx's tracer with a ``trace`` that builds the
same graph (the same placeholders, nodes and output) without them. Everything else a capture uses is per thread:
dispatch and function modes, the fake mode, the Python dispatcher switch, the autocast cache switch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any

import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    PythonKeyTracer,
    TorchFunctionMetadataMode,
    disable_autocast_cache,
    dispatch_trace,
    fake_signature,
    wrap_key,
)


class _DispatchGraphTracer(PythonKeyTracer):
    """make_fx's recording tracer, whose ``trace`` patches nothing and leaves FX's symbolic-tracing flag alone."""

    def trace(self, root: Callable, concrete_args: tuple | None = None) -> fx.Graph:  # type: ignore[override]
        self.root = torch.nn.Module()
        self.graph = fx.Graph(tracer_cls=type(self))
        self.tensor_attrs = {}
        code = getattr(root, "__code__", None)
        if code is not None:
            self.graph._co_fields = {"co_name": code.co_name, "co_filename": code.co_filename,
                                     "co_firstlineno": code.co_firstlineno}
        fn, args = self.create_args_for_root(root, False, concrete_args)
        out = fn(*args)
        ann = inspect.get_annotations(inspect.unwrap(fn))
        self.create_node("output", "output", (self.create_arg(out),), {}, type_expr=ann.get("return", None))
        return self.graph


def aten_graph(fn: Callable, example: list[torch.Tensor], decompositions: Mapping) -> fx.GraphModule:
    """The aten graph of ``fn(*example)``, traced on fake tensors like ``example`` with ``decompositions``
    applied: the graph ``make_fx(fn, decompositions, tracing_mode="fake")(*example)`` makes."""
    import torch._functorch.config as functorch_config
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with functorch_config.patch(fake_tensor_allow_unsafe_data_ptr_access=False):  # a per-thread setting
        fake_mode = FakeTensorMode(allow_fallback_kernels=True, shape_env=ShapeEnv(), static_shapes=True)
    fakes = [fake_mode.from_tensor(a, source=ConstantSource(f"input{i}")) for i, a in enumerate(example)]
    return _trace(fn, fake_mode, fakes, decompositions, "fake")


def symbolic_aten_graph(fn: Callable, example: list[torch.Tensor], decompositions: Mapping,
                        dims: frozenset[tuple[int, int]]) -> tuple[fx.GraphModule, Any, list]:
    """``aten_graph`` with the sizes at ``dims`` (input, dim) symbolic: the graph, its fake mode (whose shape
    environment holds the guards) and the fake inputs to compile it for."""
    import torch._functorch.config as functorch_config
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from fulmen.executors.inductor_dynamic import symbolic_fakes

    with functorch_config.patch(fake_tensor_allow_unsafe_data_ptr_access=False):
        fake_mode = FakeTensorMode(allow_fallback_kernels=True, shape_env=ShapeEnv())
    fakes = symbolic_fakes(fake_mode, example, dims)
    return _trace(fn, fake_mode, fakes, decompositions, "symbolic"), fake_mode, fakes


def _trace(fn: Callable, fake_mode, fakes: list, decompositions: Mapping, mode: str) -> fx.GraphModule:
    table = dict(decompositions)
    table.setdefault(torch.ops.aten.sym_numel.default, torch._decomp.decompositions.sym_numel)  # as make_fx does
    tracer = _DispatchGraphTracer()
    unwrapped = inspect.unwrap(fn)
    if not hasattr(unwrapped, "__code__") or unwrapped.__code__.co_flags & inspect.CO_VARARGS:
        fn = fake_signature(fn, len(fakes))  # placeholders arg0, arg1, ... as make_fx names them
    placeholders = tuple(torch.fx._symbolic_trace.PH for _ in fakes)
    with ExitStack() as stack:
        stack.enter_context(fake_mode)
        # Composite operations decompose by PyTorch's Python rules, as under AOTAutograd (torch.compile): matmul's
        # C++ rule folds a 3-D input into one mm only if its strides pass a check that fake views of size-1 dims
        # can fail where the real tensors pass (attention's output at decode), giving a bmm Inductor unrolls
        # into a loop; the Python rule skips size-1 dims. A per-thread switch.
        stack.enter_context(enable_python_dispatcher())
        stack.enter_context(TorchFunctionMetadataMode(tracer))  # the torch call behind each node, in its meta
        stack.enter_context(ProxyTorchDispatchMode(tracer, mode, decomposition_table=table))
        # a cast's cached result would enter the graph as an untracked constant
        stack.enter_context(disable_autocast_cache())
        return dispatch_trace(wrap_key(fn, fakes, tracer, False), tracer=tracer, concrete_args=placeholders)
