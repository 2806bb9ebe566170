"""The module wrapper ``fulmen.jit(module)`` returns.

It shares the original module's parameter, buffer and submodule dictionaries, so ``parameters()``,
``state_dict()``, ``load_state_dict()``, ``to()`` and optimizers see exactly the original's tensors under
the original names. Calling it traces the original ``forward`` with parameters and buffers swapped for
proxies (``module._parameters`` entries are replaced for the duration of tracing).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from fulmen.core.codeutils import sanitize_name
from fulmen.core.proxies import TensorProxy, has_proxy
from fulmen.core.trace import get_tracectx
from fulmen.core.tracer import get_tracer
from fulmen.executors import MetaMismatch
from fulmen.executors.base import Executor
from fulmen.executors.inductor_compile import call_leaving_a_core
from fulmen.frontend import dtensor_program, fsdp2, module_guard, tree_guard
from fulmen.frontend.cache import (
    aliases_written_input,
    args_key,
    global_state_key,
    passes_a_read_tensor,
    saved_tensors_hooks,
    state_key,
)
from fulmen.frontend.distributed_wrappers import refuse_traced_wrappers
from fulmen.frontend.jit import _READ_TENSOR, JittedFunction
from fulmen.frontend.key_changes import changed_value
from fulmen.frontend.split_points import ValueChanged
from fulmen.frontend.tracing import _arg_names, check_supported_tensors, trace_program
from fulmen.frontend.user_frames import run_user_code

log = logging.getLogger("fulmen")


class _Swaps:
    """While a module is traced, proxies stand in its parameter and buffer dictionaries, which every thread reads.

    ``lock`` is held for as long (and while a module's cache entry is filled, which may trace); ``active`` counts
    the swaps in force and ``seq`` each start and end of one: a call that read a module's tensors lock-free uses
    what it read only when no swap was in force at the start and ``seq`` did not move meanwhile."""

    lock = threading.RLock()
    active = 0
    seq = 0


class _ModuleState:
    """Where every parameter and buffer lives: (module, dict name, key), tied tensors counted once.

    ``version`` names the module tree's structure (``module_guard.snapshot``): a small int, part of the cache
    key, the same for the same structure (toggling between two structures reuses both compilations). It is
    looked at again only when ``check`` (``module_guard.watch``) says the tree may have changed.
    """

    def __init__(self, root: nn.Module):
        self.root = root
        self.check = tree_guard.never  # the first call takes the snapshot
        self.snapshot: tuple | None = None
        self.version = -1
        self.lazy = False  # a parameter or buffer is not initialized yet (a lazy module before its first call)
        self._versions: dict[tuple, int] = {}
        self.snapshots: list[tuple] = []  # by version, to say what changed
        # the ids of the parameters and buffers while their dicts keep them (``ids``); prologues read it
        self.known_ids: frozenset[int] | None = None
        self.refresh()

    def revalidate(self) -> None:
        """The check failed: take the snapshot again; a different one re-keys and refreshes the slots."""
        self.known_ids = None  # a slot may hold another tensor of the same structure
        snapshot, check = module_guard.watch(self.root, self.check)
        if snapshot != self.snapshot:
            self.snapshot = snapshot
            version = self._versions.get(snapshot)
            if version is None:
                version = self._versions[snapshot] = len(self.snapshots)
                self.snapshots.append(snapshot)
            self.version = version
            self.refresh()
        self.check = check

    def invalidate(self) -> None:
        """The next call takes the snapshot again (the check is built anew: what it kept may no longer hold)."""
        self.check = tree_guard.never
        self.known_ids = None

    def ids(self, tensors: Sequence[torch.Tensor]) -> frozenset[int]:
        """The ids of the parameters and buffers ``tensors`` (``tensors()``), kept while ``check`` passes: every
        write to their dictionaries fails it, but fulmen's own (``rebind``), which forgets them. The cache key and
        the prologue tell by them an argument that is one of the module's tensors (``m(m.weight)``)."""
        ids = self.known_ids
        if ids is None:
            ids = self.known_ids = frozenset(map(id, tensors))
        return ids

    def refresh(self) -> None:
        self.known_ids = None
        slots, unique, first_slot, names = [], [], {}, []
        for mod_name, mod in self.root.named_modules(remove_duplicate=False):
            for dict_name in ("_parameters", "_buffers"):
                for key, t in getattr(mod, dict_name).items():
                    if t is None:
                        continue
                    qualified = f"{mod_name}.{key}" if mod_name else key
                    if id(t) not in first_slot:
                        first_slot[id(t)] = len(names)
                        names.append(sanitize_name(qualified.replace(".", "_")))
                        unique.append((mod, dict_name, key, first_slot[id(t)]))
                    slots.append((mod, dict_name, key, first_slot[id(t)]))
        self.slots = slots
        self.names = names
        self.unique_slots = unique
        self.lazy = any(nn.parameter.is_lazy(getattr(m, d)[k]) for m, d, k, _ in unique)

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(mod, dict_name)[key] for mod, dict_name, key, _ in self.unique_slots]

    @contextlib.contextmanager
    def swapped(self, proxies: Sequence) -> Iterator[None]:
        with _Swaps.lock:
            saved = [(mod, dict_name, key, getattr(mod, dict_name)[key]) for mod, dict_name, key, _ in self.slots]
            _Swaps.seq += 1
            _Swaps.active += 1
            try:
                for mod, dict_name, key, index in self.slots:
                    getattr(mod, dict_name)[key] = proxies[index]
                yield
            finally:
                for mod, dict_name, key, t in saved:
                    getattr(mod, dict_name)[key] = t
                _Swaps.active -= 1
                _Swaps.seq += 1

    def reassigned_buffers(self, proxies: Sequence) -> list[tuple[int, Any]]:
        """While tracing, after ``forward`` ran on ``proxies``: (slot, new value) for every buffer ``forward``
        assigned (``self.last = x * 2``). Other changes to the tensor slots cannot be compiled: raise."""
        known = {(id(mod), dict_name, key) for mod, dict_name, key, _ in self.slots}
        for name, mod in self.root.named_modules():
            for dict_name in ("_parameters", "_buffers"):
                for key, t in list(getattr(mod, dict_name).items()):
                    if t is not None and (id(mod), dict_name, key) not in known:
                        del getattr(mod, dict_name)[key]  # a proxy must not stay in the module
                        raise NotImplementedError(
                            f"{type(mod).__name__}.forward registered a new {dict_name[1:-1]} {key!r} on "
                            f"{name or 'the module'}; fulmen.jit compiles modules whose parameters and buffers "
                            "exist before the call. Register it in __init__ (it may start as an empty tensor).")
        changed = []
        for i, (mod, dict_name, key, index) in enumerate(self.slots):
            value = getattr(mod, dict_name).get(key)
            if value is proxies[index]:
                continue
            if dict_name == "_parameters" or not isinstance(value, TensorProxy | torch.Tensor):
                what = "parameter" if dict_name == "_parameters" else "buffer"
                raise NotImplementedError(
                    f"{type(mod).__name__}.forward set the {what} {key!r} to {type(value).__name__}; fulmen.jit "
                    "can compile a forward that assigns a new tensor to a buffer, not one that replaces a parameter "
                    "or sets a buffer to a non-tensor. Update the tensor in place (self.x.copy_(...)) instead.")
            changed.append((i, value))
        return changed

    def rebind(self, rebinds: tuple[tuple[int, bool], ...], result) -> Any:
        """After a call whose program returns ``(result, new buffer values)``: assign them, as eager did."""
        out, values = result
        self.known_ids = None
        for (i, tied), t in zip(rebinds, values):
            mod, dict_name, key, _ = self.slots[i]
            tree_guard.write_owned(getattr(mod, dict_name), key, t)
            if tied:  # the slot no longer shares its tensor with the other slots it shared it with
                self.invalidate()
        return out

    def keep_version(self, written: frozenset) -> None:
        """After a trace: where the tree differs from the snapshot the program was keyed on only in attributes the
        traced code wrote itself (``written``: program outputs, which snapshots leave out; a lazy GraphModule's
        generated code; a value left as set, with a warning), the new snapshot names the same structure, so it
        keeps the version. A change made meanwhile by another thread does not."""
        snapshot = module_guard.snapshot(self.root)
        if snapshot != self.snapshot and self.snapshot is not None and module_guard.differs_only_in(
                self.snapshot, snapshot, written):
            self._versions[snapshot] = self.version
            self.snapshot = snapshot


class _ModuleProgram(JittedFunction):
    """The JittedFunction behind a JittedModule: the module's state is its first inputs.

    With ``body``, the program is the module's ``forward`` alone, installed as that attribute by the caller: the
    module's ``__call__`` and its hooks (FSDP2's all-gather and reshard) run around it with PyTorch, and eager
    fallbacks call the class's ``forward``, not the module."""

    def __init__(self, module: nn.Module, executors, body: bool = False, **options):
        super().__init__(module.forward, executors, **options)
        self._init_args = (module, executors)
        self.module = module
        self.state = _ModuleState(module)
        self._run_module = self.fn if body else module

    _prologue_of_module = True  # its prologue is prologue(version, params, args, kwargs)

    def __call__(self, *args, **kwargs):
        state = self.state
        seq = _Swaps.seq
        if _Swaps.active or not state.check():
            tensors = self._tensors_serialized()
            if _Swaps.active and tensors is not None and has_proxy(tensors):  # inside a trace that swapped them in
                return self._run_module(*args, **kwargs)
        else:
            tensors = state.tensors()
            if _Swaps.seq != seq:  # a module was being traced meanwhile: what was read may be its proxies
                tensors = self._tensors_serialized()
        if tensors is None:
            return self._materialize(args, kwargs)
        self._stats.calls += 1
        entry = self._last_entry
        flat = entry.check(state.version, tensors, args, kwargs) if entry is not None else None
        # saved-tensor hooks are not in the key: _find runs such a call eagerly when its program records a backward
        if flat is None or (entry.differentiates and saved_tensors_hooks() is not None):
            key_flat: list[torch.Tensor] = []
            try:
                key = ((state.version, state_key(tensors, key_flat),
                        args_key(args, kwargs, key_flat, state=state.ids(tensors))), global_state_key())
            except RuntimeError:  # a nested tensor has no shape to key on
                check_supported_tensors(self.module.forward, args, kwargs)
                raise
            entry, flat = self._find(key, args, kwargs, key_flat, (state.version, tensors, args, kwargs))
            if entry is None:  # called on an outer fulmen trace's proxies, or a value past RECOMPILE_LIMIT
                return self._run_module(*args, **kwargs)
        else:
            self._stats.cache_hits += 1
        if entry.written and aliases_written_input(flat, entry.written, len(state.unique_slots)):
            return self._run_eagerly(args, kwargs)
        if entry.read_tensors and passes_a_read_tensor(flat, entry.read_tensors, len(state.unique_slots),
                                                       len(entry.spec.captured)):
            return self._run_eagerly(args, kwargs, _READ_TENSOR)
        try:
            return call_leaving_a_core(entry.run, flat)  # a flag read, unless regions are compiling
        except (MetaMismatch, ValueChanged) as e:
            return self._program_stopped(e, entry, args, kwargs)

    def _call_key(self, args, kwargs) -> tuple[Any, list[torch.Tensor], tuple]:
        state = self.state
        tensors = state.tensors()
        flat: list[torch.Tensor] = []
        key = ((state.version, state_key(tensors, flat), args_key(args, kwargs, flat, state=state.ids(tensors))),
               global_state_key())
        return key, flat, (state.version, tensors, args, kwargs)

    def _tensors_serialized(self) -> list[torch.Tensor] | None:
        """The module's parameters and buffers, read while no thread has proxies in modules' dictionaries (this
        thread's own trace may: the lock is reentrant), after revalidating the module tree when a watched module
        changed; None for a lazy module's first call."""
        state = self.state
        with _Swaps.lock:
            if not state.check():  # something in the tree may have changed: is it different?
                with self._lock:
                    state.revalidate()
                if state.lazy:
                    return None
            return state.tensors()

    def _materialize(self, args, kwargs):
        """A lazy module (``nn.LazyLinear``) learns its parameters' shapes on its first call: run that one eagerly,
        as PyTorch would, and compile from the next call on."""
        log.info("fulmen: %s has uninitialized (lazy) parameters; its first call runs eagerly to initialize them",
                 type(self.module).__name__)
        try:
            return self._run_module(*args, **kwargs)
        finally:
            self.state.invalidate()  # initializing replaced parameters and changed classes: take a new snapshot

    def _n_state(self) -> int:
        return len(self.state.unique_slots)

    def _state_names(self) -> list[str]:
        return self.state.names

    def _state_ids(self):
        return self.state

    def _changed_value(self, old, new):
        if old is None or old[1] != new[1] or old[0][:2] != new[0][:2]:  # global state, structure, parameters
            return None
        return changed_value(old[0][2], new[0][2])

    # filling a cache entry traces, which swaps proxies in: under the swap lock first, then the program's own
    # (the order tracing takes them in), so that no thread holds one while waiting for the other
    def _miss(self, key, args, kwargs, flat, inputs):
        with _Swaps.lock:
            return super()._miss(key, args, kwargs, flat, inputs)

    def _globals_changed(self, key, entry, args, kwargs, flat, inputs):
        with _Swaps.lock:
            return super()._globals_changed(key, entry, args, kwargs, flat, inputs)

    def _call_eagerly(self, *args, **kwargs):
        # through the module's __call__, as eager calls it: its own hooks and the global ones run there
        return self._run_module(*args, **kwargs)

    def _describe_key_change(self, old, new, names=()) -> str:
        if old is not None and old[1] == new[1]:  # same global state: (structure, state tensors, arguments)
            (old_version, old_state, old_args), (new_version, new_state, new_args) = old[0], new[0]
            if old_version != new_version:
                snapshots = self.state.snapshots
                return module_guard.describe_change(snapshots[old_version], snapshots[new_version])
            if old_state != new_state:
                return "a parameter or buffer changed shape, dtype, device or requires_grad"
            old, new = (old_args, old[1]), (new_args, new[1])
        return super()._describe_key_change(old, new, names)

    def _call_part(self, key) -> tuple:
        return key[0][2]  # ((version, parameter keys, call key), global state)

    def _with_call_part(self, key, call: tuple):
        return ((*key[0][:2], call), *key[1:])

    def _trace(self, args, kwargs, sizes=None, ints=None):
        # the slots are those the call's key was computed from (revalidate refreshed them when the tree changed)
        state = self.state
        module_guard.check_no_backward_hooks(self.module)
        own = list(self.module.modules())
        refuse_traced_wrappers(own)
        named = list(zip(state.names, state.tensors()))
        module, run_module = self.module, self._run_module
        self._traced_rebinds = ()
        counts: dict[int, int] = {}
        for *_, index in state.slots:
            counts[index] = counts.get(index, 0) + 1

        def forward(state_proxies, *a, **k):
            with state.swapped(state_proxies):
                out = run_user_code(run_module, *a, **k)
                reassigned = state.reassigned_buffers(state_proxies)
            if not reassigned:
                return out
            # the program also returns the buffers' new values; the call assigns them (_ModuleState.rebind)
            capture = get_tracer().capture
            self._traced_rebinds = tuple((i, counts[state.slots[i][3]] > 1) for i, _ in reassigned)
            return out, [capture(v) for _, v in reassigned]

        forward_fn = self.fn if run_module is self.fn else module.forward
        names = _arg_names(forward_fn, args, kwargs)
        return trace_program(forward, args, kwargs, state=named, fn_name="computation", arg_names=names,
                             sizes=sizes, guard_reads=forward_fn if self._guard_reads else None,
                             own=own, split_points=self._split_points, replay=self.options.replay, ints=ints)

    def _build_entry(self, key, args, kwargs, symbolic):
        entry = super()._build_entry(key, args, kwargs, symbolic)  # assigns the module attributes on every call
        rebinds = self._traced_rebinds
        state = self.state
        if rebinds:  # the program returns (result, new buffer values): every call assigns them, as eager did
            for i, _ in rebinds:
                tree_guard.mark_owned(state.slots[i][0], "_buffers")
            entry.plan.rebind = lambda out: state.rebind(rebinds, out)
            self._set_program(entry, entry.program)
        if entry.spec.written:
            state.keep_version(entry.spec.written)
        state.invalidate()  # tracing swapped the tensors in and out, and may have made dicts fulmen's to write
        # the module's tensor attributes that are no parameter or buffer (``self.mask = torch.ones(3)``) are read
        # like globals, and watched by identity: an argument among them (``m(m.mask)``) runs eagerly too
        entry.read_tensors |= frozenset(
            id(v) for mod in module_guard.tree_modules(self.module) for v in vars(mod).values()
            if isinstance(v, torch.Tensor))
        return entry


class _Router(module_guard.StandIn):
    """Stands in the original module's ``__dict__`` as its ``forward`` while one of its methods runs through the
    wrapper (``fulmen.jit(model).generate(...)``): a call runs the compiled program. Inside a trace (the program
    traces the module's call), or when forward hooks are registered (``nn.Module.__call__`` ran them already, and
    the program would run them again), it is the forward eager would call: the user's own ``forward`` on the
    instance where there is one, else the class's. Its signature is that forward's (Hugging Face's ``generate``
    inspects it to choose the arguments it passes).

    The write of ``forward`` and its removal are the module guard's own (``tree_guard.swap_owned``), and snapshots
    record the forward it stands for, so routing changes nothing a check looks at; a user's write of ``forward``
    (before, between or during routed calls) is still seen."""

    def __init__(self, program: _ModuleProgram):
        self.program = program
        self.lock = threading.Lock()
        self.depth = 0  # routed method calls in progress (in any thread)
        self.saved = tree_guard.MISSING_KEY  # what the module's __dict__ held as "forward" before
        self.__signature__ = inspect.signature(self.target())
        tree_guard.mark_swapped(program.module, "__dict__")  # checks built from now on learn each swap's version

    def stands_for(self) -> Any:
        return self.saved

    def target(self) -> Callable:
        """The forward an eager call of the module would run."""
        saved, module = self.saved, self.program.module
        return type(module).forward.__get__(module) if saved is tree_guard.MISSING_KEY else saved

    def __call__(self, *args, **kwargs):
        module = self.program.module
        if get_tracectx() is not None:
            return self.target()(*args, **kwargs)
        if _has_forward_hooks(module):
            if not getattr(self, "_warned_hooks", False):
                self._warned_hooks = True
                log.warning("fulmen: %s has forward hooks: the forward calls its own methods make (generate) run "
                            "eagerly, since the compiled program would run the hooks a second time. Call the jitted "
                            "module itself to run compiled.", type(module).__name__)
            return self.target()(*args, **kwargs)
        return self.program(*args, **kwargs)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        attrs = self.program.module.__dict__
        with self.lock:
            if self.depth == 0:
                self.saved = tree_guard.swap_owned(attrs, "forward", self)
                self.__signature__ = inspect.signature(self.target())
            self.depth += 1
        try:
            yield
        finally:
            with self.lock:
                self.depth -= 1
                if self.depth == 0:
                    tree_guard.swap_owned(attrs, "forward", self.saved)
                    self.saved = tree_guard.MISSING_KEY


def _has_forward_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or _torch_module._global_forward_hooks
                or _torch_module._global_forward_pre_hooks)


# program -> its router (kept outside the program, which holds no lock of its own for it)
_routers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_routers_lock = threading.Lock()


def _routed(method: types.MethodType, program: _ModuleProgram):
    """``method`` (bound to the original module) run with the module's forward calls routed to ``program``."""
    with _routers_lock:
        router = _routers.get(program)
        if router is None:
            router = _routers[program] = _Router(program)

    @functools.wraps(method)
    def run_routed(*args, **kwargs):
        with router.installed():
            return method(*args, **kwargs)

    return run_routed


_GLOBAL_HOOK_TABLES = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
                       "_global_forward_hooks_with_kwargs", "_global_backward_pre_hooks", "_global_backward_hooks")


def _call_impl_without_global_hooks():
    """``nn.Module._call_impl`` reading empty global hook tables: the wrapper runs the hooks registered on it, and
    not the global ones (``register_module_forward_hook``), which the call of the original module inside it runs,
    once per module call as in eager (traced into the program, or eagerly when the call runs eagerly). The
    function is ``_call_impl``'s own code over a copy of its module's globals, so PyTorch's hook semantics
    (kwargs hooks, always-called hooks, backward hooks) stay PyTorch's; the global tables are dictionaries edited in
    place, so a copy of the namespace keeps seeing every other name."""
    impl = nn.Module._call_impl
    namespace = {**vars(_torch_module), **{name: {} for name in _GLOBAL_HOOK_TABLES}}
    return types.FunctionType(impl.__code__, namespace, impl.__name__, impl.__defaults__, impl.__closure__)


def _program_for(module: nn.Module, executors, options: dict):
    """What a JittedModule's forward calls: the module's compiled program; for a module sharded by FSDP2, a call of
    the module itself, with each innermost unit's ``forward`` compiled (``fulmen.frontend.fsdp2``); for a module
    holding DTensors (tensor parallelism), its DTensor program traced whole (``fulmen.frontend.dtensor_program``)."""
    fsdp_module = fsdp2.fsdp_module_class(module)
    if fsdp_module is None:
        if dtensor_program.dtensor_state(module) is not None:  # tensor parallelism: DTensor parameters
            return dtensor_program.DTensorProgram(module, executors, options)
        return _ModuleProgram(module, executors, **options)
    from fulmen.frontend import fsdp2_2d, fsdp2_program  # they build on _ModuleProgram, defined here

    if fsdp2_2d.is_two_d(module, fsdp_module):  # FSDP2 over tensor parallelism: the DTensor program, FSDP's in it
        return fsdp2_2d.whole_program(module, fsdp_module, executors, options)
    program = fsdp2_program.whole_program(module, fsdp_module, executors, options)
    if program is not None:  # FSDP2's default policies: the whole model traced, its collectives in the trace
        return program
    units = fsdp2.innermost_units(module)
    for unit in units:
        # a unit that fulmen.jit compiled before (a jitted block that fully_shard wrapped, or an earlier call) stays
        if not isinstance(unit, JittedModule) and not isinstance(unit.__dict__.get("forward"), _ModuleProgram):
            unit.forward = _ModuleProgram(unit, executors, body=True, **options)
    return fsdp2.ShardedModelCall(module)


_STATE_DICT_HOOK_DICTS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                          "_load_state_dict_post_hooks")


class JittedModule(nn.Module):
    """``fulmen.jit(module)``: behaves as the module (same parameters, buffers, state_dict, train/eval)."""

    def __init__(self, module: nn.Module, executors: Sequence[Executor | str] | None = None, **options):
        super().__init__()
        # Share the original's dictionaries: one set of tensors, the original's names.
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._modules = module._modules
        self._non_persistent_buffers_set = module._non_persistent_buffers_set
        # ... and its state_dict hooks (spectral_norm's version entry, checkpoint_wrapper's key prefix, a user's),
        # which state_dict() and load_state_dict() of the wrapper run as the original's would
        for hooks in _STATE_DICT_HOOK_DICTS:
            setattr(self, hooks, getattr(module, hooks))
        object.__setattr__(self, "_fulmen_module", module)
        object.__setattr__(self, "_fulmen_jitted", _program_for(module, executors, options))

    def __setstate__(self, state: dict) -> None:
        # unpickled (torch.load, copy.deepcopy): the state holds the original module and a program that compiles
        # again (_ModuleProgram pickles as its module and options)
        super().__setstate__(state)

    @property
    def original_module(self) -> nn.Module:
        return self._fulmen_module

    # The original's class may save and load more than its tensors (get_extra_state, a lazy module's uninitialized
    # parameters, a version of its own that its _load_from_state_dict reads): state_dict() and load_state_dict()
    # go through its methods.
    @property
    def _version(self) -> int:
        return getattr(self.__dict__.get("_fulmen_module"), "_version", nn.Module._version)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        self._fulmen_module._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        self._fulmen_module._load_from_state_dict(*args, **kwargs)

    # `training` is the original's: `model.eval()` on the original shows here too
    @property
    def training(self) -> bool:
        return self._fulmen_module.training

    @training.setter
    def training(self, mode: bool) -> None:
        module = self.__dict__.get("_fulmen_module")
        if module is not None:  # nn.Module.__init__ sets it before there is an original
            module.training = mode

    def forward(self, *args, **kwargs):
        return self._fulmen_jitted(*args, **kwargs)

    _call_with_own_hooks = _call_impl_without_global_hooks()

    def _call_impl(self, *args, **kwargs):
        # nn.Module.__call__ lands here; the global hooks are the original module's to run (see
        # _call_impl_without_global_hooks), so without hooks of its own the wrapper is just its forward
        if self._forward_hooks or self._forward_pre_hooks or self._backward_hooks or self._backward_pre_hooks:
            return self._call_with_own_hooks(*args, **kwargs)
        return self.forward(*args, **kwargs)

    def train(self, mode: bool = True):
        self._fulmen_module.train(mode)
        return self

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            value = getattr(self._fulmen_module, name)
        if (isinstance(value, types.MethodType) and value.__self__ is self._fulmen_module
                and isinstance(self._fulmen_jitted, _ModuleProgram)):
            # a method of the model's own class (generate): its calls of self(...) and self.forward(...) run the
            # compiled program, as they would if the method were called on this wrapper (an FSDP2 model's calls
            # reach its units' compiled forwards without routing)
            return _routed(value, self._fulmen_jitted)
        return value

    # Writes go where reads come from: the original module (which its forward reads). The wrapper keeps only
    # what nn.Module's own machinery put in its __dict__ (its hooks, the shared dictionaries), and its own class:
    # a wrapper that swaps the class (FSDP2's ``fully_shard`` makes it an ``FSDPJittedModule``) swaps this one's.
    def __setattr__(self, name: str, value) -> None:
        if (name in self.__dict__ or "_fulmen_module" not in self.__dict__ or name.startswith("_fulmen_")
                or name == "__class__"):
            super().__setattr__(name, value)
        else:
            setattr(self._fulmen_module, name, value)

    def __delattr__(self, name: str) -> None:
        if name in self.__dict__:
            super().__delattr__(name)
        else:
            delattr(self._fulmen_module, name)

    # containers (Sequential, ModuleList, ModuleDict): as the original
    def __getitem__(self, index):
        return self._fulmen_module[index]

    def __setitem__(self, index, value) -> None:
        self._fulmen_module[index] = value

    def __delitem__(self, index) -> None:
        del self._fulmen_module[index]

    def __len__(self) -> int:
        return len(self._fulmen_module)

    def __iter__(self):
        return iter(self._fulmen_module)

    def __contains__(self, item) -> bool:
        return item in self._fulmen_module

    def __bool__(self) -> bool:  # defined, or `if jmodel:` would call __len__ on modules that have none
        return bool(self._fulmen_module)

    def __repr__(self) -> str:
        return f"fulmen.jit({self._fulmen_module!r})"
