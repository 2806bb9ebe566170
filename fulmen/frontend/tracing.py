"""Running a user function on proxies to get its computation trace."""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode

from fulmen import prims
from fulmen.core import langctx
from fulmen.core.codeutils import sanitize_name
from fulmen.core.draws import callable_draws
from fulmen.core.proxies import (
    Proxy,
    TensorProxy,
    _user_location,
    call_with_out,
    has_proxy,
    is_proxy,
    latest,
)
from fulmen.core.shared_patch import SharedPatch
from fulmen.core.symbol import Symbol
from fulmen.core.symbolic import size_hint
from fulmen.core.trace import Trace, get_tracectx
from fulmen.core.tracer import Tracer, record, resolve_latest, tracing
from fulmen.core.unbacked import GuardOnDataDependentSymNode, data_dependent_guard
from fulmen.core.utils import RunsEagerly  # noqa: F401 (where the callers import it from)
from fulmen.frontend import checkpointing
from fulmen.frontend.cache import is_holder, overrides_torch
from fulmen.frontend.dynamic import IntInputs, int_carrier
from fulmen.frontend.escapes import PythonStateWatch
from fulmen.frontend.global_guard import GlobalGuard, ReadRecorder, build_guard
from fulmen.frontend.higher_order import routing_higher_order_ops
from fulmen.frontend.module_writes import ModuleWrites, check_no_proxies_left
from fulmen.frontend.objects import ObjectResults, ObjectSwaps
from fulmen.frontend.replay import Replays
from fulmen.frontend.rng_calls import recording_rng_calls
from fulmen.frontend.split_points import ValueReader
from fulmen.frontend.symbolic_text import text_specializes
from fulmen.frontend.trace_constants import call_on_captured, mixes_real_tensors, reads_captured_tensors
from fulmen.frontend.training_state import GRAD_ATTRIBUTE, grad_access, grads_at_call_time, recording_optimizer_steps
from fulmen.frontend.user_frames import called_by_fulmen as _called_by_fulmen
from fulmen.frontend.user_frames import user_entry
from fulmen.torch.argument_writes import computes_tensors
from fulmen.torch.collectives import nn_functional_traceable
from fulmen.torch.fallback import opaque_symbol, writes_arguments
from fulmen.torch.fallback import record as fallback_record
from fulmen.torch.inplace import view_input_as_its_memory
from fulmen.torch.kernel_layouts import flag_names_read
from fulmen.torch.numpy_values import numpy_data, numpy_scalar
from fulmen.torch.shape import set_strides
from fulmen.torch.views import set_inference
from fulmen.transforms.autocast import current_policies


@dataclass
class InputSpec:
    """How the flat tensor inputs of a trace are found in a call's arguments."""

    tensor_proxies: list[TensorProxy] = field(default_factory=list)
    captured: list = field(default_factory=list)  # closure/global tensors (or a GradOf), passed after the args
    guard: GlobalGuard | None = None  # the globals and closure variables the traced code read
    # module attributes the program assigns (fulmen.frontend.module_writes): it returns (result, their values)
    attributes: tuple[tuple[torch.nn.Module, str], ...] = ()
    # objects the program updates or returns (fulmen.frontend.objects): it returns (result, their tensors)
    objects: ObjectResults | None = None
    # (module identity, name) of the module attributes the traced code wrote (fulmen.frontend.module_writes)
    written: frozenset = frozenset()
    # the tensor values the traced Python read, in order, and where (fulmen.frontend.split_points): the branch
    values: tuple = ()
    value_lines: tuple[str, ...] = ()
    # (tensor, its .grad, where) for each .grad the traced code read of a tensor that is not an input (an optimizer's
    # parameters), while tracing: the guard checks them (fulmen.frontend.training_state)
    grad_reads: list[tuple[torch.Tensor, Any, str]] = field(default_factory=list)
    # the optimizers whose step() ran while tracing: the program holds their hyperparameters' values (lr, betas)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)


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


_UNSUPPORTED = {
    "nested": "pass its components (t.unbind()) or a padded tensor (t.to_padded_tensor(0.0)) instead",
    "quantized": "pass the dequantized tensor (t.dequantize()) instead",
    # a proxy stands for a strided tensor: sparse operands would be traced as dense ones, and results eager returns
    # sparse (s * 2, s + s) would come back dense, or a fused region would read the sparse storage as dense
    "sparse": "pass the dense tensor (t.to_dense()) instead, or keep the sparse operations outside the jitted "
              "function",
    "mkldnn": "pass the dense tensor (t.to_dense()) instead",
    # a DTensor's operations run through DTensor's own dispatch (sharding propagation, collectives), which fulmen's
    # traced tensors do not stand for; FSDP2 hands a block's forward plain (all-gathered) parameters
    "distributed (DTensor)": "for FSDP2, apply fulmen.jit to each block before fully_shard (model.layers[i] = "
               "fulmen.jit(model.layers[i]), then fully_shard(model.layers[i]) and fully_shard(model)); for tensor "
               "parallelism, apply fulmen.jit to the module holding the DTensor parameters (parallelize_module, "
               "then fulmen.jit(model)), which traces its DTensor program whole, or use torch.compile(model, "
               "backend=\"fulmen\")",
}


def _is_dtensor(t: torch.Tensor) -> bool:
    # no DTensor exists unless its module was imported: checking costs nothing for programs that never use one
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _unsupported_kind(t: torch.Tensor) -> str | None:
    if t.is_nested:
        return "nested"
    if t.layout is not torch.strided:  # sparse COO, CSR, CSC, BSR, BSC (and mkldnn)
        return "sparse" if t.layout is not torch._mkldnn else "mkldnn"
    if t.is_quantized:
        return "quantized"
    if _is_dtensor(t):
        return "distributed (DTensor)"
    if overrides_torch(t) and not isinstance(t, Proxy):  # eager runs its operations through the class's code
        return f"{type(t).__qualname__} (a torch.Tensor subclass with its own __torch_function__ or __torch_dispatch__)"
    return None


def unsupported_tensor_error(what: str, kind: str) -> NotImplementedError:
    way_out = _UNSUPPORTED.get(kind, "pass a plain tensor (t.as_subclass(torch.Tensor)) instead")
    return NotImplementedError(
        f"fulmen.jit: {what} is a {kind} tensor, which fulmen does not compile. Call the function without "
        f"fulmen.jit for such inputs, or {way_out}.")


def check_supported_tensors(fn: Callable, args: tuple, kwargs: dict) -> None:
    """Raise a NotImplementedError naming the first argument of ``fn`` that is (or holds) a tensor kind fulmen does
    not compile (nested, sparse, quantized); the call path asks when computing a cache key failed."""
    try:
        names = _arg_names(fn, args, kwargs)
    except Exception:  # names only improve the message
        names = []
    items = [(f"argument {names[i]}" if i < len(names) else f"argument {i}", a) for i, a in enumerate(args)]
    items += [(f"argument {k}", v) for k, v in kwargs.items()]
    while items:
        what, value = items.pop(0)
        if isinstance(value, torch.Tensor):
            kind = _unsupported_kind(value)
            if kind is not None:
                raise unsupported_tensor_error(what, kind)
        elif isinstance(value, (tuple, list)):
            items[:0] = [(f"{what}[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, dict):
            items[:0] = [(f"{what}[{k!r}]", v) for k, v in value.items()]


def proxify(trace: Trace, value: Any, name: str, flat: list[TensorProxy], sizes: list | None = None,
            objects: ObjectSwaps | None = None, proxies: dict[int, TensorProxy] | None = None,
            ints: IntInputs | None = None) -> Any:
    """Replace every tensor in ``value`` (tuples, lists, dicts) by a named TensorProxy input; ``sizes`` (by flat
    position) overrides the tensors' shapes with symbolic ones. ``objects`` swaps proxies into the instances of user
    classes met (``fulmen.frontend.objects``), in the order the cache key walks them. ``proxies`` (tensor id -> its
    proxy) gives a tensor met again its first proxy, as the cache key does (``fulmen.frontend.cache.same_tensors``).
    ``ints`` numbers the ints met and puts the symbolic ones in their place (``fulmen.frontend.dynamic``)."""
    if type(value) is int:
        return ints(value, name) if ints is not None else value
    if isinstance(value, torch.Tensor):
        if proxies is not None:
            p = proxies.get(id(value))
            if p is not None:
                return p
        kind = _unsupported_kind(value)
        if kind is not None:
            raise unsupported_tensor_error(f"argument {name}", kind)
        shape = value.shape if sizes is None else sizes[len(flat)]
        p = TensorProxy(trace.add_name(name), shape=shape, dtype=value.dtype, device=value.device,
                        requires_grad=value.requires_grad)
        if not value.is_contiguous():  # keyed with its strides (never with dynamic sizes): eager's copy-or-view
            set_strides(p, value.stride())
        if value.is_inference():  # keyed too
            set_inference(p)
        p.mark_input(leaf=value.requires_grad and value.is_leaf, param=isinstance(value, torch.nn.Parameter))
        flat.append(p)
        if proxies is not None:
            proxies[id(value)] = p
        return p
    if type(value) is torch.Size:  # keyed by its contents, as a value: its ints are not the arguments' ints
        return value
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(proxify(trace, v, f"{name}_{i}", flat, sizes, objects, proxies, ints)
                           for i, v in enumerate(value))
    if isinstance(value, tuple):  # namedtuple
        return type(value)(*(proxify(trace, v, f"{name}_{f}", flat, sizes, objects, proxies, ints)
                             for f, v in zip(value._fields, value)))
    if isinstance(value, dict):
        items = {k: proxify(trace, v, f"{name}_{k}", flat, sizes, objects, proxies, ints) for k, v in value.items()}
        if type(value) is dict:
            return items
        try:  # a dict subclass keeps its class (a ModelOutput: encoder_outputs[0] works)
            copied = copy.copy(value)
            for k, v in items.items():
                copied[k] = v
        except Exception:  # one that cannot be copied or written: its items in a dict, as before
            return items
        return copied
    if objects is not None and is_holder(value):
        return objects.enter(value, name)
    return value


def _real_tensors(value: Any, out: list[torch.Tensor], met: set[int] | None) -> None:
    """The tensors in ``value`` in the order ``proxify`` makes them inputs, each once (``met``: their ids) unless
    ``met`` is None."""
    if isinstance(value, torch.Tensor):
        if met is None or id(value) not in met:
            if met is not None:
                met.add(id(value))
            out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _real_tensors(v, out, met)
    elif isinstance(value, dict):
        for v in value.values():
            _real_tensors(v, out, met)


class _Capture:
    """Turns real tensors that reach a symbol while tracing (closures, globals) into extra trace inputs."""

    def __init__(self, trace: Trace, spec: InputSpec):
        self.trace, self.spec = trace, spec
        self.by_id: dict[int, TensorProxy] = {}

    def __call__(self, x):
        kind = type(x)
        if kind is tuple or kind is list:  # a symbol's arguments, shapes: rebuilt only when a tensor is inside
            for v in x:
                if type(v) not in _PLAIN:
                    return kind(self(v) for v in x)
            return x if kind is tuple else x.copy()  # a list is copied: the caller may change theirs later
        if kind is TensorProxy:
            return x
        if isinstance(x, torch.Tensor):
            p = self.by_id.get(id(x))
            if p is None:
                kind = _unsupported_kind(x)
                if kind is not None:
                    raise unsupported_tensor_error("a tensor the function reads from a global or closure variable",
                                                   kind)
                p = TensorProxy(self.trace.add_name("captured"), shape=x.shape, dtype=x.dtype, device=x.device,
                                requires_grad=x.requires_grad)
                if not x.is_contiguous():
                    set_strides(p, x.stride())
                if x.is_inference():
                    set_inference(p)
                p.mark_input(leaf=False, param=isinstance(x, torch.nn.Parameter))
                self.by_id[id(x)] = p
                self.spec.captured.append(x)
                self.spec.tensor_proxies.append(p)
                self.trace.args.append(p)
            return latest(p)  # its value now, after in-place updates
        return numpy_scalar(x)  # a NumPy scalar: the Python number torch reads it as


#: Values that hold no tensor: ``_Capture`` passes tuples and lists of them through as they are.
_PLAIN = frozenset((TensorProxy, int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size))

_DATA_ARGUMENT = frozenset((torch.as_tensor, torch.tensor, torch.asarray))
_functorch_active = torch._C._are_functorch_transforms_active


def _transform_inside(func: Callable) -> NotImplementedError:
    # vmap wraps the proxies in its batched tensors, whose operations fulmen's symbols would take for plain tensors
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    return NotImplementedError(
        f"a torch.func transform (vmap, jacrev, jvp, ...) runs {name} inside a function fulmen.jit compiles, which "
        f"fulmen does not trace.\n  at {_user_location()}\nApply the transform outside the compiled function "
        "(torch.func.vmap(fulmen.jit(f)) runs f eagerly, logged), or write the batched computation with the batch "
        "dimension explicit (broadcasting, torch.bmm, einsum).")


class _UserTorchCalls(TorchFunctionMode):
    """Routes torch calls that have no proxy argument (``torch.rand(3)``, ``torch.arange(n)``) made by user
    code to the torch language, so they run on every call instead of being computed once while tracing."""

    def __init__(self, trace: Trace, spec: InputSpec):
        super().__init__()
        self.trace, self.spec = trace, spec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        trc = get_tracectx()
        if trc is self.trace and len(trc.scopes) == 1:  # user code, not a meta or a decomposition
            if _functorch_active():  # tracing starts outside torch.func transforms (JittedFunction._find)
                raise _transform_inside(func)
            if getattr(func, "__self__", None) is GRAD_ATTRIBUTE and args and not isinstance(args[0], TensorProxy):
                return grad_access(func, args, kwargs, self.spec.grad_reads, _called_by_fulmen())
            fn = langctx.torch_functions.get(func)
            if has_proxy((args, kwargs)):
                if fn is not None and func in _DATA_ARGUMENT:
                    # torch parses their data as a sequence, never dispatching on a proxy
                    return fn(*args, **kwargs)
                if mixes_real_tensors(args, kwargs) and not _called_by_fulmen():
                    return call_on_captured(func, args, kwargs)
                if types == (TensorProxy,):  # what func(*args) would reach through torch's dispatch, at once
                    return TensorProxy.__torch_function__(func, types, args, kwargs)
            elif (fn is not None or callable_draws(func) or writes_arguments(func)
                  or computes_tensors(func)) and not _called_by_fulmen():
                if func in _DATA_ARGUMENT and args:  # torch.tensor(np_array): the array as a tensor sharing its memory
                    args = (numpy_data(args[0]), *args[1:])
                # a random op with no rule (torch.randperm) is an opaque op that draws on every call, not a
                # constant drawn once while tracing; one that writes a global tensor (torch._foreach_lerp_ of an
                # EMA) writes it on every call, and one that reads them (torch._foreach_norm of the gradients in
                # clip_grad_norm_) reads them on every call; an aten factory (aten.empty_strided) makes a fresh tensor
                if fn is None:
                    draws_only = callable_draws(func) and not writes_arguments(func)  # init.uniform_(W): writes W
                    fn = opaque_symbol(func) if draws_only else fallback_record(func)
                if kwargs.get("out") is not None:  # torch.zeros(3, out=buffer): written in place, as eager
                    return call_with_out(fn, func, args, kwargs)
                return fn(*args, **kwargs)
            elif reads_captured_tensors(func, args, kwargs) and not _called_by_fulmen():  # F.softmin(global)
                return call_on_captured(func, args, kwargs)
        return func(*args, **kwargs)


_flag_lock = threading.Lock()
_flag_users = 0  # traces in progress, in every thread, that set torch.compiler's flag
_flag_saved = False


@contextlib.contextmanager
def _compiling():
    """``torch.compiler.is_compiling()`` is true while fulmen traces, as under Dynamo: libraries (transformers'
    mask and MoE code) then skip data-dependent checks and take their compile-friendly paths. The flag is one for
    the process: the first trace to start sets it and the last to end puts back what was there, so traces in
    several threads neither clear it under one another nor leave it set."""
    global _flag_users, _flag_saved
    if not hasattr(torch.compiler, "_is_compiling_flag"):  # a private flag; torch releases without it trace as-is
        yield
        return
    with _flag_lock:
        if _flag_users == 0:
            _flag_saved = torch.compiler._is_compiling_flag
        _flag_users += 1
        torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        with _flag_lock:
            _flag_users -= 1
            if _flag_users == 0:
                torch.compiler._is_compiling_flag = _flag_saved


_cache_users = 0  # traces in progress, in every thread, with torch.nn.utils.parametrize's cache turned off
_cache_saved = 0


@contextlib.contextmanager
def _parametrizations_uncached():
    """Parametrized weights are computed at each access while fulmen traces, as under ``torch.jit.trace``, even
    inside ``torch.nn.utils.parametrize.cached()``: its cache is a dict for the process, so the trace would either
    leave proxies in it for eager code to find after the trace, or read a real tensor computed before the trace and
    bake it into the program, stale once the weights change. The values are the same either way. The counter is
    the process's: the first trace to start saves it and the last to end puts it back (``_compiling``)."""
    global _cache_users, _cache_saved
    with _flag_lock:
        if _cache_users == 0:
            _cache_saved = parametrize._cache_enabled
        _cache_users += 1
        parametrize._cache_enabled = 0
    try:
        yield
    finally:
        with _flag_lock:
            _cache_users -= 1
            if _cache_users == 0:
                parametrize._cache_enabled = _cache_saved


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


class _AutocastPolicies:
    """The autocast policies in force while user code runs, read again at each outermost call: ``torch.autocast``
    entered or left inside the traced function applies from there on, as in eager. (Generated code runs with
    autocast disabled for the devices it was on for at the call, so the recorded casts are the only ones.)"""

    def __init__(self):
        self._state: tuple | None = None
        self._policies: list = []

    def __iter__(self):
        if _any_autocast is not None and not _any_autocast():  # the common case: one C call
            return iter(())
        state = (torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda"),
                 torch.get_autocast_dtype("cpu"), torch.get_autocast_dtype("cuda"))
        if state != self._state:
            self._state, self._policies = state, current_policies()
        return iter(self._policies)


class UserTracer(Tracer):
    """The tracer of a user's program (``fulmen.core.tracer``): real tensors that reach a symbol (closures,
    globals) become inputs of the trace at every depth; at a call the user's code makes (the outermost scope) it
    also records the user frames on the stack for the global guard, applies the autocast policies in force, and
    copies an earlier identical call's decomposition (``fulmen.frontend.replay``). Python that reads a tensor's
    value gets it from the call's tensors when ``reader`` is given (``fulmen.frontend.split_points``)."""

    captures_tensors = True

    def __init__(self, trace: Trace, spec: InputSpec, *, reader: ValueReader | None = None,
                 on_user_call: Callable[[], None] | None = None, replay: bool = True):
        super().__init__(trace)
        self.captured = _Capture(trace, spec)
        self._reader = reader
        self._on_user_call = on_user_call
        self._autocast = _AutocastPolicies()
        self._replays = Replays(trace) if replay else None  # off: every call runs its decomposition
        self._inference = torch.is_inference_mode_enabled()  # the call's, part of its key

    def process_symbol(self, sym: Symbol, args: tuple, kwargs: dict) -> Any:
        trace = self.trace
        if trace.has_mutations:
            args, kwargs = resolve_latest(args), {k: resolve_latest(v) for k, v in kwargs.items()}
        capture = self.captured
        args, kwargs = capture(args), {k: capture(v) for k, v in kwargs.items()}
        if len(trace.scopes) == 1:
            return self._user_call(sym, args, kwargs)
        if sym.normalize is not None:
            args, kwargs = sym.normalize(args, kwargs)
        return record(trace, sym, args, kwargs).output

    def _user_call(self, sym: Symbol, args: tuple, kwargs: dict) -> Any:
        """A call the user's code made (not one inside a decomposition)."""
        if self._on_user_call is not None:
            self._on_user_call()
        if torch.is_inference_mode_enabled() is not self._inference:
            raise _inference_mode_entered(self._inference)
        # eager autocast casts at the outermost call only; the policies follow torch.autocast entered or left
        # inside the traced function
        for policy in self._autocast:
            if policy.runs_as_composite(sym.id):  # eager casts the operations it calls, each by its own policy
                return sym.meta(*args, **kwargs)
            args, kwargs = policy.cast(sym.id, args, kwargs)
        if sym.normalize is not None:
            args, kwargs = sym.normalize(args, kwargs)
        call = self._replays.lookup(sym, args, kwargs) if self._replays is not None else None
        if call is not None and call.bsym is not None:
            self.trace.scopes[-1].append(call.bsym)
            return call.bsym.output
        bsym = record(self.trace, sym, args, kwargs)
        if call is not None:
            call.remember(bsym)
        return bsym.output

    def capture(self, x: Any) -> Any:
        return self.captured(x)

    def read_value(self, kind: str, proxy: TensorProxy, what: str) -> Any:
        proxy = latest(proxy)  # `n.add_(1); float(n)` reads the value after the update, as eager does
        if self._reader is None:
            return super().read_value(kind, proxy, what)
        return self._reader(kind, proxy, what)

    @contextlib.contextmanager
    def branch(self) -> Iterator[None]:
        replays, self._replays = self._replays, None  # a call made in one branch is not the value of a later one
        try:
            yield
        finally:
            self._replays = replays


_original_apply = torch.autograd.Function.__dict__["apply"]
_ReentrantCheckpoint = getattr(torch.utils.checkpoint, "CheckpointFunction", None)


def _apply(cls, *args, **kwargs):  # named "apply" below: Dynamo recognizes Function.apply by name
    """``torch.autograd.Function.apply`` while some thread traces. On this thread's proxies the call is recorded as
    one opaque symbol that keeps the Function's backward; anything else (other threads, real or fake tensors,
    the recorded call itself) runs as PyTorch's apply."""
    if _apply_patch.here and has_proxy((args, kwargs)):
        from fulmen.torch.fallback import autograd_function_symbol

        rule = langctx.autograd_functions.get(f"{cls.__module__}.{cls.__qualname__}")
        if rule is not None:  # a Function the torch language has its own symbols for
            return rule(*args, **kwargs)

        if cls is _ReentrantCheckpoint:
            # apply(run_function, preserve_rng_state, *args): its backward recomputes run_function under autograd,
            # so tracing the call itself gives the same gradients (its forward runs under no_grad, and reads module
            # parameters it is not passed); recorded as a checkpointed region, which the backward recomputes
            with checkpointing.region(preserve_rng_state=args[1]):
                return args[0](*args[2:])

        autocast = tuple((p.device_type, p.dtype) for p in current_policies())
        return autograd_function_symbol(cls, autocast)(*args, **kwargs)
    return _original_apply.__func__(cls, *args, **kwargs)


_apply.__name__ = "apply"


def _install_apply() -> None:
    torch.autograd.Function.apply = classmethod(_apply)


def _uninstall_apply() -> None:
    torch.autograd.Function.apply = _original_apply


_apply_patch = SharedPatch(_install_apply, _uninstall_apply)


@contextlib.contextmanager
def _recording_autograd_functions():
    """PyTorch's C++ apply would run ``forward`` on proxies (inlining it and losing the custom backward):
    ``Function.apply`` is wrapped while any thread traces, and the wrapper acts only for the tracing thread."""
    with _apply_patch.in_this_thread():
        yield


def _guard_what_was_read(trace: Trace, spec: InputSpec, recorder: ReadRecorder, own, bound_arguments, swaps,
                         real: list) -> None:
    """``spec.guard``: a check of what the user's code read while traced (``fulmen.frontend.global_guard``)."""
    names = [p.name for p in trace.args[len(trace.args) - len(spec.captured):]]
    checked, grads, owners = grads_at_call_time(spec.grad_reads, names, spec.captured, real)
    spec.guard = build_guard(recorder, checked, own, bound_arguments, [h.obj for h in swaps.holders],
                             flag_names_read(trace), grads, spec.optimizers, owners)


@contextlib.contextmanager
def _while_tracing(tracer: UserTracer, trace: Trace, spec: InputSpec) -> Iterator[ModuleWrites]:
    """The patches and recorders the user's function runs under while ``trace_program`` traces it."""
    with tracing(tracer), _UserTorchCalls(trace, spec), _compiling(), _parametrizations_uncached(), \
            _recording_autograd_functions(), nn_functional_traceable(), routing_higher_order_ops(), \
            recording_rng_calls(), recording_optimizer_steps(trace, spec.optimizers), text_specializes(), \
            ModuleWrites() as writes:
        yield writes


def trace_program(fn: Callable, args: tuple, kwargs: dict, *, arg_names: list[str] | None = None,
                  fn_name: str = "computation", state: list[tuple[str, torch.Tensor]] | None = None,
                  sizes: list | None = None, guard_reads: Callable | None = None,
                  own: Sequence[torch.nn.Module] = (), split_points: bool = False,
                  replay: bool = True, same_tensors: bool = True, ints: dict | None = None) -> tuple[Trace, InputSpec]:
    """Trace ``fn(*args, **kwargs)``: tensors become proxies, every torch call becomes a bound symbol.

    ``state`` (a module's parameters and buffers, by name) becomes the first inputs; ``fn`` then receives
    the list of their proxies as its first argument. ``sizes`` gives the shape of each tensor input in flat
    order (state first), with ``torch.SymInt`` for dynamic dimensions (``fulmen.frontend.dynamic``).
    ``guard_reads`` (the user's function) asks for ``spec.guard``: a check of the globals and closure variables the
    user's code read (``fulmen.frontend.global_guard``). ``own``: the jitted module's tree, whose parameters and
    buffers are inputs (writes to other modules: ``fulmen.frontend.module_writes``). With ``split_points``, Python
    that reads a tensor's value gets it from the call's tensors, guarded (``fulmen.frontend.split_points``; the
    caller runs the branch a guard picks); without, it raises ``DataDependentError``. ``same_tensors``: a tensor
    object passed more than once is one input (``fulmen.frontend.cache.same_tensors``); without, one per position.
    ``ints`` (slot -> SymInt): symbolic ints of the arguments, each read from an input (``fulmen.frontend.dynamic``)."""
    trace = Trace(fn_name)
    spec = InputSpec()
    names = arg_names or _arg_names(fn, args, kwargs)
    proxy_args, proxy_kwargs, swaps = _proxify_inputs(trace, spec, args, kwargs, names, state, sizes, same_tensors,
                                                      IntInputs(ints))
    real = _real_inputs(args, kwargs, state, same_tensors, trace.args[len(spec.tensor_proxies):])
    reader = ValueReader(trace, lambda: real + spec.captured)
    recorder = ReadRecorder(guard_reads, sys._getframe()) if guard_reads is not None else None
    tracer = UserTracer(trace, spec, reader=reader if split_points else None, on_user_call=recorder, replay=replay)
    inputs = proxy_args[1:] if state is not None else proxy_args
    watch = PythonStateWatch((fn, guard_reads) if guard_reads is not None else (fn,), inputs, proxy_kwargs, names,
                             own, spec.optimizers)
    try:
        with _while_tracing(tracer, trace, spec) as writes:
            for p in spec.tensor_proxies:
                view_input_as_its_memory(p)
            result = _call_user(fn, proxy_args, proxy_kwargs, swaps)
            result, spec.objects = swaps.settle(result)
            result = tracer.capture(result) if isinstance(result, torch.Tensor) and not is_proxy(result) else result
            real_state = {id(p): t for p, (_, t) in zip(proxy_args[0], state)} if state is not None else None
            attributes = writes.settle(frozenset(map(id, own)), tracer.captured.by_id,
                                       recorder.codes if recorder is not None else (), real_state)
            check_no_proxies_left(own)
            watch.check(recorder.codes if recorder is not None else {})
            spec.written = writes.written()
            if attributes:  # the program also returns them; every call assigns them (module_writes.assigning)
                spec.attributes = tuple((mod, name) for mod, name, _ in attributes)
                result = (result, [value for *_, value in attributes])
            result = _resolve_outputs(result)
            result = _write_back_mutated_inputs(trace, result)
    except BaseException as e:  # the caller's objects keep none of the proxies stored
        watch.drop_escaped(recorder.codes if recorder is not None else {})
        # a meta asked a question about a data-dependent size
        raise data_dependent_guard(None, e) if isinstance(e, GuardOnDataDependentSymNode) else e
    finally:
        watch.clear_grown_caches()
        if recorder is not None:
            recorder.close()
    if recorder is not None:
        _guard_what_was_read(trace, spec, recorder, own, _bound_arguments(guard_reads, args, kwargs), swaps, real)
    spec.values, spec.value_lines = tuple(reader.values), tuple(reader.where)
    trace.output, trace.provenance = result, None
    return trace, spec


def _inference_mode_entered(outer: bool) -> RunsEagerly:
    # eager's values made under the mode are inference tensors (is_inference(); eager refuses to save them for
    # backward or update them in place outside the mode); a program runs all its operations under the caller's mode
    return RunsEagerly(
        f"the function enters torch.inference_mode({not outer}) (a torch call under it at {_user_location()}); "
        "its values are inference tensors only in eager, so such calls run eagerly (not compiled). Use "
        "torch.no_grad() inside the function, or call it under torch.inference_mode(), to run compiled.")


def _real_inputs(args: tuple, kwargs: dict, state, same_tensors: bool, carriers: list[TensorProxy]) -> list:
    """The call's values of the trace's inputs before the captured ones: the module's state, the arguments' tensors
    (each once with ``same_tensors``), the carriers of the symbolic ints."""
    real = [t for _, t in state] if state is not None else []
    _real_tensors((args, kwargs), real, set(map(id, real)) if same_tensors else None)
    return real + [int_carrier(size_hint(p.shape[0])) for p in carriers]


@user_entry
def _call_user(fn: Callable, args: tuple, kwargs: dict, swaps) -> Any:
    """``fn(*args, **kwargs)`` on proxies; on an error the caller's objects are put back as they were, and a
    function that leaves grad mode changed for its caller is refused (grad mode restored)."""
    grad_mode = torch.is_grad_enabled()
    try:
        result = fn(*args, **kwargs)
        if torch.is_grad_enabled() is not grad_mode:
            torch.set_grad_enabled(grad_mode)
            raise _grad_mode_left_changed(fn, grad_mode)
    except BaseException:
        swaps.restore()
        raise
    return result


def _grad_mode_left_changed(fn: Callable, grad_mode: bool) -> NotImplementedError:
    # eager leaves the new mode for the caller; a compiled program, run on later calls, would not change it
    return NotImplementedError(
        f"{getattr(fn, '__qualname__', type(fn).__name__)} turns grad mode {'off' if grad_mode else 'on'} for its "
        "caller (torch.set_grad_enabled called as a function, not as a `with` block), which a compiled program "
        "cannot repeat on later calls. Use `with torch.set_grad_enabled(...):` (or torch.no_grad()) inside the "
        "function, or set the mode before calling it.")


def _int_carriers(trace: Trace, ints: IntInputs | None) -> list[TensorProxy]:
    """One input per symbolic int, of shape ``(n,)``, from which the program binds the int's symbol
    (``fulmen.frontend.dynamic.int_carrier``), in slot order."""
    if ints is None:
        return []
    if len(ints.names) != len(ints.symbols):
        raise RuntimeError(f"symbolic ints: found {len(ints.names)} of the {len(ints.symbols)} ints expected")
    carriers = []
    for slot in sorted(ints.symbols):
        p = TensorProxy(trace.add_name(ints.names[slot]), shape=torch.Size([ints.symbols[slot]]), dtype=torch.uint8,
                        device=torch.device("cpu"), requires_grad=False)
        p.mark_input(leaf=False, param=False)
        carriers.append(p)
    return carriers


def _proxify_inputs(trace: Trace, spec: InputSpec, args: tuple, kwargs: dict, names: list[str],
                    state: list[tuple[str, torch.Tensor]] | None, sizes: list | None,
                    same_tensors: bool = True, ints: IntInputs | None = None) -> tuple[list, dict, ObjectSwaps]:
    """The arguments ``fn`` is traced with (``state`` first when given), their tensors made named inputs in
    ``spec.tensor_proxies`` and, with the carriers of the symbolic ``ints``, the trace's first arguments; the user
    objects swapped (``fulmen.frontend.objects``) are put back on failure."""
    proxy_args = []
    flat = spec.tensor_proxies
    if state is not None:
        proxy_args.append([proxify(trace, t, name, flat, sizes) for name, t in state])
    # a tensor passed again gets its first proxy (the key's SAME), a module's own tensor (m(m.weight)) its proxy
    proxies: dict[int, TensorProxy] | None = {} if same_tensors else None
    if proxies is not None and state is not None:
        proxies.update((id(t), p) for (_, t), p in zip(state, proxy_args[0]))
    swaps = ObjectSwaps(lambda t, name: proxify(trace, t, name, flat, sizes, proxies=proxies), ints)
    try:
        for i, a in enumerate(args):
            name = names[i] if i < len(names) else f"t_{i}"
            proxy_args.append(proxify(trace, a, name, flat, sizes, swaps, proxies, ints))
        proxy_kwargs = {k: proxify(trace, v, sanitize_name(k), flat, sizes, swaps, proxies, ints)
                        for k, v in kwargs.items()}
        if sizes is not None and len(flat) != len(sizes):
            raise RuntimeError(f"symbolic sizes: found {len(flat)} tensor inputs, expected {len(sizes)}")
        trace.args = list(flat) + _int_carriers(trace, ints)  # the carriers of symbolic ints after the tensors
    except BaseException:
        swaps.restore()  # the caller's objects as they were
        raise
    return proxy_args, proxy_kwargs, swaps


def _bound_arguments(fn: Callable, args: tuple, kwargs: dict) -> dict | None:
    """``fn``'s arguments by parameter name (None where its signature cannot say)."""
    try:
        return dict(inspect.signature(fn).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return None


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
            f"the function returned a {type(x).__name__} object that holds traced tensors inside its attributes, "
            "which fulmen cannot rebuild on every call (it rebuilds instances of Python classes: dataclasses, "
            "Hugging Face caches and outputs; fulmen.frontend.objects). Return the tensors themselves, or register "
            "the class with torch.utils._pytree.")
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


def _write_back_mutated_inputs(trace: Trace, result: Any) -> Any:
    """Inputs changed in place get their new value copied into the caller's tensor, as eager would; where the
    result returns such a value (``return a.add_(1)``) it returns the caller's tensor itself, as eager does
    (unless autograd records the value: then it stays the value computed)."""
    if not trace.has_mutations:
        return result
    changed = [(latest(p), p) for p in trace.args if latest(p) is not p]
    returned = {id(new): p for new, p in changed if not new.requires_grad and not p.requires_grad}
    if returned:
        result = torch.utils._pytree.tree_map(
            lambda x: returned.get(id(x), x) if isinstance(x, TensorProxy) else x, result)
    # symbols read the latest value of a mutated proxy; copy_ must name the caller's tensor itself
    trace.has_mutations = False
    try:
        written = {id(p): prims.copy_(new, p) for new, p in changed}
        result = _views_of_written_inputs(result, changed, written)
    finally:
        trace.has_mutations = True
    return result


def _views_of_written_inputs(result: Any, changed: list, written: dict[int, TensorProxy]) -> Any:
    """Returned views of inputs that were written (``x.add_(1); return x[0]``) made again from the caller's tensor
    after the write, so that, as in eager, the result shares its memory (unless autograd records the value)."""
    owner = {}  # id of each value an input held -> the input
    for _, p in changed:
        v = p
        while v is not None:
            owner[id(v)] = p
            v = v.replaced_by

    def remade(x):
        if not isinstance(x, TensorProxy) or x.view_of is None or x.requires_grad:
            return x
        steps, v = [], x
        while id(v) not in owner and v.view_of is not None:
            v, remake = v.view_of
            steps.append(remake)
        p = owner.get(id(v))
        if p is None or p.requires_grad:
            return x
        view = written[id(p)]
        for remake in reversed(steps):
            view = remake(view)
        return view

    return torch.utils._pytree.tree_map(remade, result)
