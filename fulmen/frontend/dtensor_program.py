"""Modules holding DTensors (tensor parallelism: ``parallelize_module``) under ``fulmen.jit``: the DTensor program is
traced into operations on local tensors and functional collectives, and fulmen compiles those.

A ``DTensor`` runs through DTensor's own dispatch: sharding propagation picks the local kernel and the collectives a
redistribution needs, and DTensor's autograd decides the backward's collectives (the backward of a replicated input
all-reduces its partial gradient). fulmen's traced tensors cannot stand for a DTensor, so the module is traced the
way ``torch.compile`` traces one after Dynamo: AOTAutograd (``aot_function``) runs the module with its parameters
and inputs as fake DTensors, desugars each into its local tensor (the placements and mesh are static facts of the
program) and records what DTensor's dispatch ran: aten operations on local tensors and ``_c10d_functional``
collectives, for the forward and, through DTensor's autograd, for the backward. Each of the two graphs is then
compiled by ``fulmen.jit`` (fulmen's executors and fusion), where the collectives are traced operations
(``fulmen.torch.collectives``): the printed traces show the all-reduces and all-gathers. AOTAutograd's
``autograd.Function`` joins the two programs and wraps the gradients back into DTensors, so the parameters, their
``.grad``, the optimizer and the ``state_dict`` stay the user's DTensors.

The traced program is specialized, like any trace, on what the module's Python read; the cache key here holds what
a later call must match: the arguments' structure, non-tensor values and tensor metadata (a DTensor's placements
and mesh too), the parameters', buffers' and tensor attributes' (inputs of the program too), which of them are the
same tensor, fulmen's global state (grad mode, autocast, default dtype and device), each submodule's class, plain
attributes (``training``, flags, sizes), ``forward`` set on the instance and hooks, and the global module hooks;
and, as for ``fulmen.jit``'s own tracing, the globals, closure variables and attribute chains the module's
Python code read while AOTAutograd ran it (``fulmen.frontend.global_guard``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils._pytree import tree_flatten

from fulmen.core.trace import Trace
from fulmen.frontend import tree_guard
from fulmen.frontend.aten_graph import TorchCalls
from fulmen.frontend.attribute_lookup import is_user_file
from fulmen.frontend.cache import global_state_key
from fulmen.frontend.global_guard import GlobalGuard, ReadRecorder, build_guard
from fulmen.frontend.stats import CompileStats

log = logging.getLogger("fulmen")

_PLAIN_ATTRIBUTES = (bool, int, float, str, type(None))


def _dtensor_class() -> type | None:
    # no DTensor exists unless its module was imported: checking costs nothing for programs that never use one
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def dtensor_state(module: nn.Module) -> str | None:
    """The name of the first parameter or buffer of ``module`` that is a DTensor, or None."""
    dtensor = _dtensor_class()
    if dtensor is None:
        return None
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        if isinstance(t, dtensor):
            return name
    return None


def _describe(value: Any, dtensor: type) -> Any:
    """What a later call must match of one argument leaf: a tensor's metadata (a DTensor's placements, mesh and
    local strides too), a plain value itself."""
    if isinstance(value, dtensor):
        local = value._local_tensor
        return (
            "dtensor",
            value.shape,
            value.dtype,
            value.requires_grad,
            value.placements,
            value.device_mesh,
            local.shape,
            local.stride(),
            local.device,
        )
    if isinstance(value, torch.Tensor):
        return ("tensor", type(value), value.shape, value.stride(), value.dtype, value.device, value.requires_grad)
    if type(value) is float:  # 0.0 and -0.0 compare equal, but a program traced with one is not the other's
        return (float, repr(value))
    try:
        hash(value)
    except TypeError:
        raise NotImplementedError(
            f"fulmen.jit of a module holding DTensors: an argument of type {type(value).__name__} is neither a "
            "tensor nor a hashable value, so a later call could not be checked against the traced program; pass "
            "tensors and plain values (numbers, strings, tuples)"
        ) from None
    return (type(value), value)


class _Same:
    """Compares and hashes by identity (a hook or a ``forward`` set on the instance), holding the object so that its
    id is not reused while a traced program's key holds it."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _module_scan(module: nn.Module) -> tuple[dict[str, torch.Tensor], tuple]:
    """One pass over the submodules: their tensor attributes that are neither parameters nor buffers (named by their
    path: inputs of the program like the parameters), and the facts a later call must match: each submodule's class,
    plain attributes (``training``, flags, sizes the forward may branch on), ``forward`` set on the instance, and
    hooks (the global ones too). torch's code (``nn.Sequential``, ``Module.__call__``) calls submodules and hooks
    without the user's code reading them, so the recorded reads do not cover a swapped submodule or hook."""
    attributes, facts, prefixes = {}, [], None
    for m in module.modules():
        plain = []
        for name, value in m.__dict__.items():
            if type(value) in _PLAIN_ATTRIBUTES:
                plain.append((name, value))
            elif isinstance(value, torch.Tensor):  # rare: the submodules' paths are looked up only then
                prefixes = prefixes or {id(sub): path for path, sub in module.named_modules()}
                attributes[f"{prefixes[id(m)]}.{name}" if prefixes[id(m)] else name] = value
        hooks = ()
        if m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks:
            kinds = (m._forward_pre_hooks, m._forward_hooks, m._backward_pre_hooks, m._backward_hooks)
            hooks = tuple(tuple(map(_Same, d.values())) for d in kinds)
        forward = m.__dict__.get("forward")
        facts.append((type(m), tuple(plain), forward if forward is None else _Same(forward), hooks))
    return attributes, (*facts, _global_hooks())


def _global_hooks() -> tuple:
    """The hooks ``nn.modules.module.register_module_forward_hook`` and its siblings set on every module."""
    kinds = (
        "_global_forward_pre_hooks",
        "_global_forward_hooks",
        "_global_backward_pre_hooks",
        "_global_backward_hooks",
    )
    return tuple(tuple(_Same(h) for h in getattr(nn_module, kind, {}).values()) for kind in kinds)


@dataclass
class _Compiled:
    """One traced program: AOTAutograd's callable and fulmen's programs for its graphs, by kind."""

    call: Callable
    graphs: dict[str, Any] = field(default_factory=dict)  # "forward" | "backward" | "inference" -> JittedFunction
    guard: GlobalGuard | None = None  # the globals and attributes the module's Python read while traced
    stop_recording: Callable | None = None  # ends the recording of user code (the first compilation calls it)


@dataclass
class DTensorStats(CompileStats):
    """``fulmen.compile_stats`` of a module holding DTensors: the counters of the traced programs, and the traces
    fulmen made of the last one's graphs (the forward, or the inference graph when nothing needed gradients; the
    backward)."""

    _program: _Compiled | None = None

    def _graph_traces(self, kinds: tuple[str, ...], attribute: str) -> list:
        graphs = self._program.graphs if self._program is not None else {}
        for kind in kinds:
            if kind in graphs:
                return list(getattr(graphs[kind]._stats, attribute))
        return []

    @property
    def last_traces(self) -> list[Trace]:
        return self._graph_traces(("forward", "inference"), "last_traces")

    @property
    def last_trace_steps(self) -> list[str]:
        return self._graph_traces(("forward", "inference"), "last_trace_steps")

    @property
    def last_backward_traces(self) -> list[Trace]:
        """The traces of the backward graph (AOTAutograd differentiated the DTensor program; fulmen compiled the
        graph), empty until a backward ran."""
        return self._graph_traces(("backward",), "last_traces")

    @property
    def last_backward_trace_steps(self) -> list[str]:
        return self._graph_traces(("backward",), "last_trace_steps")


class DTensorProgram:
    """What ``fulmen.jit(module)`` calls for a module holding DTensor parameters or buffers (see the module doc)."""

    def __init__(self, module: nn.Module, executors, options: dict):
        self.module = module
        self.executors = executors
        self.options = options
        self._cache: dict[Any, list[_Compiled]] = {}
        # the last _module_scan, reused while the tree's dictionaries and classes are unchanged (tree_guard)
        self._scan: tuple[dict[str, torch.Tensor], tuple] | None = None
        self._scan_holds: Callable[[], bool] = tree_guard.never
        self._stats = DTensorStats()
        log.info(
            "fulmen: %s holds DTensors (%s): fulmen compiles its DTensor program traced into local tensors and "
            "functional collectives",
            type(module).__name__,
            dtensor_state(module),
        )

    def __reduce__(self):
        """Pickling (``copy.deepcopy``, ``torch.save`` of the jitted module) keeps the module and the options: the
        traced programs hold compiled code of this process and trace again in the copy."""
        return DTensorProgram, (self.module, self.executors, self.options)

    def _state(self) -> tuple[dict[str, torch.Tensor], tuple]:
        """The tensors the program takes besides the arguments: the parameters, the buffers and the submodules'
        tensor attributes that are neither (a mask or a table set as ``self.mask = torch...``): passed as inputs like
        the parameters, so a later call sees their current values instead of the ones traced; and the submodules'
        facts (``_module_scan``). The scan reads only what the tree's dictionaries and classes hold, so it is taken
        again only when ``tree_guard``'s check of them fails (the check is built before the scan reads the tree)."""
        if not self._scan_holds():
            holds = tree_guard.build(list(self.module.modules()), self._scan_holds)
            self._scan, self._scan_holds = _module_scan(self.module), holds
        attributes, facts = self._scan
        state = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers()), **attributes}
        return state, facts

    def _key(self, state: dict, facts: tuple, args: tuple, kwargs: dict) -> tuple:
        dtensor = _dtensor_class()
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [*leaves, *state.values()]
        # which arguments are the same tensor: AOTAutograd's program is specialized on that
        first = {}
        same = tuple(first.setdefault(id(v), i) for i, v in enumerate(tensors) if isinstance(v, torch.Tensor))
        return (spec, global_state_key(), tuple(state), tuple(_describe(v, dtensor) for v in tensors), same, facts)

    def __call__(self, *args, **kwargs):
        state, facts = self._state()
        key = self._key(state, facts, args, kwargs)
        stats = self._stats
        stats.calls += 1
        variants = self._cache.get(key, ())
        for program in variants:  # programs traced with other values of the globals the module's Python read
            if program.guard is None or program.guard.check():
                stats.cache_hits += 1
                stats._program = program
                return program.call(list(state.values()), args, kwargs)
        stats.cache_misses += 1
        if variants:
            stats.recompile_reasons.append(variants[-1].guard.explain())
        elif self._cache:
            stats.recompile_reasons.append(
                "the arguments, parameters or module attributes differ from every traced program's"
            )
        return self._trace_and_call(key, state, args, kwargs)

    def _trace_and_call(self, key: tuple, state: dict, args: tuple, kwargs: dict):
        program = self._trace(list(state))
        self._stats._program = program
        recorder = ReadRecorder(self.module.forward, sys._getframe())
        try:
            with _recording_user_code(recorder, program):  # AOTAutograd runs the module's Python in this first call
                out = program.call(list(state.values()), args, kwargs)
        except NotImplementedError as e:
            if "sharding" in str(e):  # DTensor's dispatch has no rule for an operation
                raise _no_sharding_rule(self.module, e) from e
            raise
        except _DATA_DEPENDENT as e:
            raise _reads_values(self.module, e) from e
        except Exception as e:
            if _raised_by_tracing(e):
                raise _not_traceable(self.module, e) from e
            raise
        program.guard = build_guard(recorder, [])
        self._cache.setdefault(key, []).append(program)
        return out

    def _trace(self, names: list[str]) -> _Compiled:
        from torch._functorch.aot_autograd import aot_function

        module = self.module

        def run(state: list, args: tuple, kwargs: dict):
            bound = dict(zip(names, state))
            out = self._run_module(bound, args, kwargs)
            # functional_call restores the module's tensors after the call and leaves in ``bound`` what the forward
            # assigned to them: the traced program cannot carry such an assignment to the user's module
            rebound = [name for name, t in zip(names, state) if bound[name] is not t]
            if rebound:
                raise _assigns_state(module, rebound)
            return out

        program = _Compiled(call=None)
        program.call = aot_function(
            run,
            self._compiler(program, "forward"),
            self._compiler(program, "backward"),
            partition_fn=self._partition,
            inference_compiler=self._compiler(program, "inference"),
        )
        return program

    def _run_module(self, bound: dict, args: tuple, kwargs: dict):
        """The module's forward with its tensors bound to the program's inputs, as AOTAutograd traces it (FSDP2 on
        tensor parallelism adds its all-gathers around each unit here: ``fulmen.frontend.fsdp2_2d``)."""
        return torch.func.functional_call(self.module, bound, args, kwargs)

    def _partition(self, joint: torch.fx.GraphModule, joint_inputs, **kwargs):
        """Splits AOTAutograd's joint graph into the forward and the backward (what the backward reads from the
        forward is saved), as ``aot_function`` does by default; ``fulmen.frontend.fsdp2_2d`` tags FSDP2's gathers
        to be recomputed in the backward first."""
        from torch._functorch.partitioners import default_partition

        return default_partition(joint, joint_inputs, **kwargs)

    def _compiler(self, program: _Compiled, kind: str) -> Callable:
        from torch._functorch.aot_autograd import make_boxed_func

        from fulmen.frontend.jit import JittedFunction

        def compile_graph(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            if program.stop_recording is not None:  # the module's Python has run: what follows is not the user's
                program.stop_recording()

            def run_graph(*args):  # runs while fulmen traces: fulmen's own symbols where an aten op has a torch form
                return TorchCalls(gm).run(*args)

            run_graph.__name__ = f"dtensor_{kind}"
            jitted = program.graphs[kind] = JittedFunction(run_graph, self.executors, **self.options)
            jitted._guard_reads = False  # the graph reads no globals; the module's Python ran when AOTAutograd traced
            jitted._split_points = False
            return make_boxed_func(jitted)

        return compile_graph


# code Python and torch generate (dataclass and namedtuple methods, FX graphs' code) is not the user's
_GENERATED = ("<string>", "<eval_with_key>")


@contextlib.contextmanager
def _recording_user_code(recorder: ReadRecorder, program: _Compiled) -> Iterator[None]:
    """``recorder`` told of every call of user code while AOTAutograd runs the module's Python (this thread), so
    what that code read becomes the program's guard (``fulmen.frontend.global_guard``). The recording stops at the
    first graph compilation (``program.stop_recording``): by then the module's Python has run, and what follows
    (fulmen compiling and running the graphs) is not the user's."""

    def profile(frame, event, arg):
        if event == "call":
            filename = frame.f_code.co_filename
            if is_user_file(filename) and not filename.startswith(_GENERATED):
                recorder()

    previous = sys.getprofile()
    stopped = []

    def stop() -> None:
        if not stopped:
            stopped.append(True)
            sys.setprofile(previous)

    program.stop_recording = stop
    sys.setprofile(profile)
    try:
        yield
    finally:
        stop()
        program.stop_recording = None
        recorder.close()


def _data_dependent_errors() -> tuple[type, ...]:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode


_DATA_DEPENDENT = _data_dependent_errors()


def _reads_values(module: nn.Module, e: Exception) -> NotImplementedError:
    """The module's Python needed a tensor's value (``if x.sum() > 0``, ``.item()``) while AOTAutograd traced it on
    fake tensors, which have none."""
    return NotImplementedError(
        f"fulmen.jit({type(module).__name__}): the module's forward needs a tensor's value while its DTensor program "
        f"is traced ({type(e).__name__}: {str(e).splitlines()[0]}), which a traced program cannot depend on. Use "
        'torch.compile(model, backend="fulmen"), which breaks the graph there, or run the module without fulmen.jit.'
    )


_TRACING_PACKAGES = tuple(f"{os.sep}torch{os.sep}{p}{os.sep}" for p in ("_functorch", "fx", "_subclasses", "_guards"))


def _raised_by_tracing(e: Exception) -> bool:
    """Whether ``e`` comes from AOTAutograd's own machinery (a limitation of its tracing), not from the module."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and any(p in tb.tb_frame.f_code.co_filename for p in _TRACING_PACKAGES)


def _not_traceable(module: nn.Module, e: Exception) -> NotImplementedError:
    return NotImplementedError(
        f"fulmen.jit({type(module).__name__}): AOTAutograd could not trace the module's DTensor program "
        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Use torch.compile(model, "
        'backend="fulmen"), which leaves the DTensor parts to PyTorch, or run the module without fulmen.jit.'
    )


def _assigns_state(module: nn.Module, names: list[str]) -> NotImplementedError:
    """The forward assigned a new tensor to a parameter, buffer or tensor attribute (``self.cache = torch.cat(...)``):
    AOTAutograd's program returns its outputs but cannot rebind the user's module attribute."""
    return NotImplementedError(
        f"fulmen.jit({type(module).__name__}): the module's forward assigns a new tensor to {', '.join(names)}, "
        "which the DTensor program cannot carry out on the module. Update the tensor in place instead "
        "(self.x.copy_(...), self.x += 1), or run the module without fulmen.jit."
    )


def _no_sharding_rule(module: nn.Module, e: NotImplementedError) -> NotImplementedError:
    """DTensor's refusal of an operation it has no sharding rule for, naming the module and what works instead."""
    return NotImplementedError(
        f"fulmen.jit({type(module).__name__}): DTensor has no sharding rule for an operation of the module's "
        f"forward ({str(e).splitlines()[0]}), so its DTensor program cannot be traced. Run the module without "
        "fulmen.jit, or compute that operation on local tensors (dtensor.to_local()) or on replicated ones."
    )
