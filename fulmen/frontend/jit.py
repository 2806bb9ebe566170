"""``fulmen.jit``: trace on first call, compile, cache by what the program depends on, call fast after."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fulmen.core.options import JitOptions
from fulmen.core.proxies import has_proxy
from fulmen.core.trace import Trace, get_tracectx
from fulmen.core.unbacked import has_unbacked
from fulmen.core.utils import compiler_import_lock
from fulmen.executors import MetaMismatch, torchex
from fulmen.executors.base import Executor, resolve_executors
from fulmen.executors.inductor_compile import call_leaving_a_core, compile_mode_set
from fulmen.frontend import warm_start
from fulmen.frontend.cache import (
    aliases_written_input,
    args_key,
    functorch_active,
    global_state_key,
    holds_objects,
    lazy_view_inputs,
    passes_a_read_tensor,
    read_tensor_ids,
    saved_tensors_hooks,
    user_modes_active,
    written_inputs,
)
from fulmen.frontend.compile import CompiledProgram, PipelineRun, compile_inference, computation_steps
from fulmen.frontend.dynamic import (
    SizeHistory,
    SymbolicSizes,
    call_ints,
    describe_change,
    erase_ints,
    erase_sizes,
    int_paths,
    key_sizes,
    strided_inputs,
    symbolic_dims,
    symbolic_ints,
)
from fulmen.frontend.global_guard import GlobalGuard
from fulmen.frontend.key_changes import argument_name, changed_value, describe_key_change
from fulmen.frontend.leaves import makes_leaves
from fulmen.frontend.module_writes import assigner
from fulmen.frontend.prologue import Prologue, build_prologue
from fulmen.frontend.runner import RunPlan, compose
from fulmen.frontend.same_program import check_symbolic_trace
from fulmen.frontend.split_points import MAX_BRANCHES, ValueChanged, same_value
from fulmen.frontend.stats import CompileStats, get_stats
from fulmen.frontend.tracing import InputSpec, RunsEagerly, _arg_names, check_supported_tensors, trace_program
from fulmen.transforms.autocast import current_policies

__all__ = ["CacheEntry", "CompileStats", "JittedFunction", "get_stats"]

log = logging.getLogger("fulmen")
_READ_TENSOR = "is called with a tensor it also reads from a global or closure variable"  # why it runs eagerly

#: How many distinct compilations of one function before fulmen warns (once) that recompiles repeat.
RECOMPILE_WARNING_THRESHOLD = 8
#: How many recompilations one argument's changing non-tensor value may cause (as torch.compile's recompile_limit);
#: after that, calls with a new value of it run eagerly (logged once), and the values compiled stay compiled.
RECOMPILE_LIMIT = 8
#: How many compiled programs one function keeps; beyond that the least recently used is dropped (and compiled
#: again if a call needs it).
MAX_CACHE_ENTRIES = 256
# Recompile reasons kept in the statistics (the latest).
_MAX_REASONS = 64
# Programs kept per key for other values of the globals the code read (compiled before, reused when they return).
_MAX_GLOBAL_VARIANTS = 8
# Concrete keys that a dynamic entry served are added to the dictionary (so they hit without guard work) up to
# this many keys per function.
_MAX_ALIASES = 4096

@dataclass
class CacheEntry:
    program: CompiledProgram | None  # set by _set_program, with run
    spec: InputSpec
    computation_trace: Trace
    prologue: Prologue | None = None  # the check a call must pass to reuse the program (set by _compile)
    check: Callable | None = None  # prologue.check: the flat inputs, or None
    key: Any = None  # the key it was compiled for
    n_guards: int = 0  # how many size guards its prologue checks (symbolic entries)
    symbolic: SymbolicSizes | None = None  # set for an entry compiled with dynamic sizes
    pattern: Any = None  # its key with the dynamic sizes erased
    written: frozenset[int] = frozenset()  # positions of the inputs the program writes to
    globals_guard: GlobalGuard | None = None  # the globals and closure variables the traced code read
    # the programs of one call signature that differ in the tensor values their Python read (split points,
    # fulmen.frontend.split_points); shared by all of them
    branches: list[CacheEntry] | None = None
    plan: RunPlan = field(default_factory=RunPlan)  # what the call around the program does (fulmen.frontend.runner)
    run: Callable | None = None  # the program's run composed with the plan: what a call runs
    differentiates: bool = False  # its program records a backward (an autograd.Function holding saved tensors)
    read_tensors: frozenset[int] = frozenset()  # ids of the tensors its code read from globals (read_tensor_ids)


class JittedFunction:
    """A function compiled by ``fulmen.jit``; call it like the original."""

    def __init__(self, fn: Callable, executors: Sequence[Executor | str] | None = None, *,
                 options: JitOptions | None = None, **kwargs):
        if not callable(fn):
            raise TypeError(f"fulmen.jit expects a function or an nn.Module, but got {type(fn).__name__}")
        #: everything fulmen.jit was asked for (fulmen.core.options), validated
        self.options = options = JitOptions.build(options, **kwargs)
        # what pickling keeps (__reduce__): the function and the options, never compiled programs
        self._init_args = (fn, executors)
        self.fn = fn
        # add_torch_executor=False keeps exactly the executors given (the seeds' fulmen.compile form);
        # a symbol none of them can run then fails with "Could not find executor for bound symbol ...".
        self.executors = resolve_executors(executors, add_always=options.add_torch_executor)
        self._cache: dict[Any, CacheEntry] = {}
        self._dynamic_entries: list[CacheEntry] = []
        self._histories: dict[Any, SizeHistory] = {}
        self._compilations = 0
        self._stats = CompileStats()
        self._last_key = None  # the key of the last compilation
        self._last_entry: CacheEntry | None = None  # the entry the last call ran: its prologue is tried first
        self._compiled: dict[Any, None] = {}  # keys of the compiled entries, least recently used first
        self._recompiles: dict[Any, int] = {}  # argument position or keyword -> recompiles its value caused
        self._warned_recompiles = False
        self._stats_entry: CacheEntry | None = None  # the compilation the statistics describe
        self._variants: dict[Any, list[CacheEntry]] = {}  # key -> entries compiled for other global values
        self._eager_keys: dict[Any, None] = {}  # keys whose calls run eagerly (``RunsEagerly``), oldest first
        self._guard_reads = True  # check the globals and closures the code read (the Dynamo backend: Dynamo does)
        # read tensor values Python needs at split points (the Dynamo backend: Dynamo breaks the graph there, and a
        # value its graph reads with .item() changes on every call, so the graph runs eagerly instead)
        self._split_points = True
        # one tensor object passed as two arguments is traced as one tensor, as eager code sees it (``x is y``); the
        # functional autodiff APIs (fulmen.frontend.functional) differentiate by position, as torch.func does
        self._same_tensors = True
        # held while a cache entry is filled (a miss traces and compiles): two threads that miss at once compile once;
        # the hit path never takes it
        self._lock = threading.RLock()
        functools.update_wrapper(self, fn, updated=())

    def __reduce__(self):
        """Pickling (``pickle``, ``torch.save``, ``copy.deepcopy``) keeps the function and the options: compiled
        programs hold generated code, locks and kernels, which belong to this process. The copy compiles again at
        its first call."""
        return _rebuild, (type(self), self._init_args, {"options": self.options}), {"_guard_reads": self._guard_reads}

    @property
    def dynamic(self) -> bool | None:
        return self.options.dynamic

    @property
    def compile_mode(self) -> str | None:
        return self.options.compile

    @property
    def cuda_graphs(self) -> bool:
        return self.options.cuda_graphs

    @property
    def disable_torch_autograd(self) -> bool:
        return self.options.disable_torch_autograd

    # ---- the call path (keep it short: it runs on every call) ----
    def __call__(self, *args, **kwargs):
        stats = self._stats
        stats.calls += 1
        entry = self._last_entry
        flat = entry.check(args, kwargs) if entry is not None else None  # the prologue of the last entry run
        # saved-tensor hooks are not in the key: _find runs such a call eagerly when its program records a backward
        if flat is None or (entry.differentiates and saved_tensors_hooks() is not None):
            key_flat: list[torch.Tensor] = []
            try:
                key = (args_key(args, kwargs, key_flat, self._same_tensors), global_state_key())
            except RuntimeError:  # a nested tensor has no shape to key on
                check_supported_tensors(self.fn, args, kwargs)
                raise
            entry, flat = self._find(key, args, kwargs, key_flat, (args, kwargs))
            if entry is None:  # called on an outer fulmen trace's proxies, or a value past RECOMPILE_LIMIT
                return self.fn(*args, **kwargs)
        else:
            stats.cache_hits += 1
        if entry.written and aliases_written_input(flat, entry.written, self._n_state()):
            return self._run_eagerly(args, kwargs)
        if entry.read_tensors and passes_a_read_tensor(flat, entry.read_tensors, self._n_state(),
                                                       len(entry.spec.captured)):
            return self._run_eagerly(args, kwargs, _READ_TENSOR)
        try:
            return call_leaving_a_core(entry.run, flat)  # a flag read, unless regions are compiling
        except (MetaMismatch, ValueChanged) as e:
            return self._program_stopped(e, entry, args, kwargs)

    def _program_stopped(self, stop: MetaMismatch | ValueChanged, entry: CacheEntry, args, kwargs):
        """A program that stopped before its end: an implementation returned other metadata than its meta declared
        (compile again), or a value the traced Python read differs (another branch's program)."""
        if isinstance(stop, MetaMismatch):
            return self._compile_again(entry, stop, args, kwargs)
        return self._value_changed(stop, entry, args, kwargs)

    def _compile_again(self, entry: CacheEntry, error: MetaMismatch, args, kwargs):
        """The program's first call found an implementation returning other metadata than its symbol's meta
        declared (recorded by ``checked_implementation``, which warned): drop the program, and repeat the call
        on one traced with the metadata returned."""
        with self._lock:
            for key in [k for k, e in self._cache.items() if e is entry]:
                del self._cache[key]
                self._compiled.pop(key, None)
                self._variants.pop(key, None)
            self._dynamic_entries = [e for e in self._dynamic_entries if e is not entry]
            if self._last_entry is entry:
                self._last_entry = None
            self._next_reason = f"{error} (compiled again with the metadata it returned)"
        try:
            return self(*args, **kwargs)
        finally:
            self.__dict__.pop("_next_reason", None)  # read by the compilation that call made

    def _call_key(self, args, kwargs) -> tuple[Any, list[torch.Tensor], tuple]:
        """(the call's cache key, its flat tensors, the arguments its prologue takes)."""
        flat: list[torch.Tensor] = []
        return (args_key(args, kwargs, flat, self._same_tensors), global_state_key()), flat, (args, kwargs)

    def _value_changed(self, changed: ValueChanged, entry: CacheEntry, args, kwargs):
        """Run the program of the branch the call's values take (``fulmen.frontend.split_points``): one compiled
        before for the same values read up to the split point that changed, or a new compilation."""
        counted = [True]  # the call counted as a cache hit until it turns out to need a new compilation
        while True:
            with self._lock:
                other = self._branch_for(changed, entry, args, kwargs, counted)
            if other is None:
                return self._call_eagerly(*args, **kwargs)
            key, _, inputs = self._call_key(args, kwargs)
            flat = other.check(*inputs)
            if flat is None:  # a branch compiled for this call rejects it: run eagerly rather than guess
                return self._call_eagerly(*args, **kwargs)
            self._last_entry = entry = other
            try:
                return call_leaving_a_core(other.run, flat)
            except ValueChanged as e:
                changed = e

    def _branch_for(self, changed: ValueChanged, entry: CacheEntry, args, kwargs, counted: list[bool]
                    ) -> CacheEntry | None:
        i, values = changed.index, entry.spec.values
        branches = entry.branches if entry.branches is not None else [entry]
        entry.branches = branches
        for other in branches:
            seen = other.spec.values
            if len(seen) > i and all(same_value(a, b) for a, b in zip(seen[:i], values[:i])) and same_value(
                    seen[i], changed.value):
                return other
        if len(branches) >= MAX_BRANCHES:
            if not getattr(self, "_warned_branches", False):
                self._warned_branches = True
                log.warning("fulmen: %s has compiled %d branches for the tensor values its Python reads (the latest "
                            "at %s); calls that need another branch run eagerly (not compiled) from now on. Keep "
                            "values that change on every call in tensors (torch.where) rather than in Python.",
                            _display_name(self.fn), len(branches), entry.spec.value_lines[i])
            return None
        if counted[0]:
            counted[0] = False
            self._stats.cache_hits -= 1
        key, flat, _ = self._call_key(args, kwargs)
        reason = (f"split point {i} ({entry.spec.value_lines[i]}) read {changed.value!r}; the program was traced with "
                  f"{values[i]!r}")
        other = self._compile(key, args, kwargs, flat, reason=reason)
        other.branches = branches
        branches.append(other)
        return other

    def _find(self, key, args, kwargs, flat: list[torch.Tensor], inputs: tuple) -> tuple[CacheEntry | None, list]:
        """The entry for a call whose key is ``key`` and the flat inputs its prologue returned (``inputs``: the
        prologue's arguments); (None, []) when the call runs the original function instead (``_miss``)."""
        if get_tracectx() is not None and has_proxy((args, kwargs, flat)):
            return None, []  # inside another trace, on its proxies (a proxy is a Tensor: its key may equal one's)
        if functorch_active():
            self._functorch_eagerly()
            return None, []
        if user_modes_active():
            self._modes_eagerly()
            return None, []
        entry = self._cache.get(key)
        if entry is not None:
            checked = entry.check(*inputs)
            if checked is not None:
                if entry.differentiates and saved_tensors_hooks() is not None:
                    return self._saved_tensors_hooks_eagerly()
                self._stats.cache_hits += 1
                self._last_entry = entry
                compiled = self._compiled
                if entry.key in compiled:  # least recently used is dropped first (MAX_CACHE_ENTRIES)
                    del compiled[entry.key]
                    compiled[entry.key] = None
                return entry, checked
            entry = self._globals_changed(key, entry, args, kwargs, flat, inputs)
        else:
            entry = self._miss(key, args, kwargs, flat, inputs)
            if entry is None:
                return None, []
        checked = entry.check(*inputs)
        if checked is None:  # a program's prologue rejects the call it was just compiled or chosen for: a bug
            log.warning("fulmen: %s: the prologue of the program compiled for this call rejects it; running the "
                        "function eagerly. Please report this with the prologue:\n%s", _display_name(self.fn),
                        entry.prologue)
            return None, []
        if entry.differentiates and saved_tensors_hooks() is not None:
            return self._saved_tensors_hooks_eagerly()
        self._last_entry = entry
        return entry, checked

    def _saved_tensors_hooks_eagerly(self) -> tuple[None, list]:
        """The call runs under ``torch.autograd.graph.saved_tensors_hooks`` (``save_on_cpu``, activation
        compression): eager applies them to what each of its operations saves, and a compiled program saves other
        tensors, so a hook that changes values would give other gradients. Such calls run eagerly."""
        if not getattr(self, "_warned_saved_hooks", False):
            self._warned_saved_hooks = True
            log.warning("fulmen: %s is called under torch.autograd.graph.saved_tensors_hooks (or save_on_cpu); "
                        "calls that record a backward there run eagerly (not compiled), so that the hooks see the "
                        "tensors eager saves. Call it outside the hooks' context to run compiled.",
                        _display_name(self.fn))
        return None, []

    def _run_eagerly(self, args, kwargs, why: str = "writes to an input that shares memory with another input"):
        """The call's inputs share memory and the program writes to one of them (``f(x, x)``, ``f(x, x[1:])``), or an
        argument is a tensor the code also reads from a global or closure (``f(W)``: ``x is W`` in eager): it was
        traced as two tensors, so the function runs eagerly instead; other calls of the program run compiled."""
        warned = self.__dict__.setdefault("_warned_eagerly", set())
        if why not in warned:
            warned.add(why)
            log.warning("fulmen: %s %s; such calls run eagerly (not compiled). Pass separate tensors (e.g. "
                        "x.clone()) to run compiled.", _display_name(self.fn), why)
        return self._call_eagerly(*args, **kwargs)

    def _functorch_eagerly(self) -> None:
        if not getattr(self, "_warned_functorch", False):
            self._warned_functorch = True
            log.warning("fulmen: %s is called inside a torch.func transform (grad, vmap, jacrev, ...); such calls "
                        "run the function eagerly (not compiled): the compiled program's autograd.Function and "
                        "kernels do not take functorch's wrapped tensors.", _display_name(self.fn))

    def _modes_eagerly(self) -> None:
        if not getattr(self, "_warned_modes", False):
            self._warned_modes = True
            log.warning("fulmen: %s is called under a TorchFunctionMode or TorchDispatchMode; such calls run the "
                        "function eagerly (not compiled), so that the mode sees every operation as in eager (fused "
                        "kernels never reach it).", _display_name(self.fn))

    def _call_eagerly(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    #: How many tensors at the start of the flat inputs are a module's parameters and buffers (never dynamic).
    def _n_state(self) -> int:
        return 0

    def _needs_grad(self, trace: Trace, flat_proxies) -> bool:
        """Whether the program is differentiated: an input requires grad and grad mode is on, at the call or in
        some part of the function (``torch.enable_grad()`` inside a function called under ``torch.no_grad()``;
        each operation records the mode it ran under)."""
        if self.disable_torch_autograd or not any(p.requires_grad for p in flat_proxies):
            return False
        return torch.is_grad_enabled() or any(not b.no_grad and b.flat_proxy_outs for b in trace.bound_symbols)

    def _trace(self, args, kwargs, sizes=None, ints=None) -> tuple[Trace, InputSpec]:
        return trace_program(self.fn, args, kwargs, sizes=sizes, guard_reads=self.fn if self._guard_reads else None,
                             split_points=self._split_points, replay=self.options.replay,
                             same_tensors=self._same_tensors, ints=ints)

    def _globals_changed(self, key, entry: CacheEntry, args, kwargs, flat, inputs: tuple) -> CacheEntry:
        """The key matched but the entry's prologue failed: a global or closure variable the program's code read
        has another value now. A program compiled for the current values, or a new compilation."""
        with self._lock:
            current = self._cache.get(key)
            if current is not entry and current is not None and current.check(*inputs) is not None:
                return current  # another thread found or compiled the program for the current values meanwhile
            return self._globals_changed_locked(key, entry, args, kwargs, flat, inputs)

    def _globals_changed_locked(self, key, entry: CacheEntry, args, kwargs, flat, inputs: tuple) -> CacheEntry:
        variants = self._variants.setdefault(key, [])
        variants.append(entry)
        for other in variants:
            if other.check(*inputs) is not None:
                variants.remove(other)
                self._cache[key] = other
                self._stats.cache_hits += 1
                return other
        if len(variants) > _MAX_GLOBAL_VARIANTS:
            del variants[0]
        guard = entry.globals_guard
        reason = guard.explain() if guard is not None and not guard.check() else "a check of its prologue failed"
        return self._compile(key, args, kwargs, flat, reason=reason)

    # ---- a key not in the cache: a dynamic entry whose guards hold, or a compilation ----
    def _miss(self, key, args, kwargs, flat: list[torch.Tensor], inputs: tuple) -> CacheEntry | None:
        """The entry for a key not in the cache; None when the original function runs instead: a call inside
        another fulmen trace (a jitted function or module called by one being traced), which then runs on the
        proxies, or a new value of an argument that already caused RECOMPILE_LIMIT recompilations."""
        if get_tracectx() is not None and has_proxy((args, kwargs, flat)):
            return None
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:  # another thread filled it while this one waited
                self._stats.cache_hits += 1
                return entry
            return self._miss_locked(key, args, kwargs, flat, inputs)

    def _miss_locked(self, key, args, kwargs, flat: list[torch.Tensor], inputs: tuple) -> CacheEntry | None:
        failed = None
        for entry in self._dynamic_entries:
            if self._pattern(key, entry.symbolic) != entry.pattern:
                continue
            if len(entry.symbolic.env.guards) != entry.n_guards:  # sizes compared after compilation: more guards
                self._set_prologue(entry, entry.key, args, kwargs)
            if entry.check(*inputs) is not None:
                self._stats.cache_hits += 1
                if len(self._cache) < _MAX_ALIASES:
                    self._cache[key] = entry  # these exact sizes hit the dictionary from now on
                return entry
            if entry.globals_guard is None or entry.globals_guard.check():
                failed = entry
        guard_failure = None
        if failed is not None:
            guard_failure = ("the guards of the entry compiled with dynamic sizes failed: "
                             + failed.symbolic.explain(flat, call_ints(self._call_part(key))))
        changed = self._changed_value(self._last_key, key)
        if changed is not None and self._recompiles.get(changed, 0) >= RECOMPILE_LIMIT:
            self._warn_recompile_limit(changed, key, args, kwargs)
            return None
        if key in self._eager_keys:
            return None
        try:
            return self._compile(key, args, kwargs, flat, guard_failure)
        except RunsEagerly as e:  # this key's calls run the function eagerly from now on
            self._eager_keys[key] = None
            if len(self._eager_keys) > MAX_CACHE_ENTRIES:
                del self._eager_keys[next(iter(self._eager_keys))]
            self._stats.recompile_reasons.append(str(e))
            log.log(logging.INFO if self._eager_keys.keys() - {key} else logging.WARNING, "fulmen: %s: %s",
                    _display_name(self.fn), e)
            return None

    def _changed_value(self, old, new) -> int | str | None:
        """The argument (position, or keyword) whose non-tensor value differs between two keys that agree
        everywhere else; None when they differ in anything else."""
        if old is None or old[1] != new[1]:
            return None
        return changed_value(old[0], new[0])

    def _warn_recompile_limit(self, changed: int | str, key, args, kwargs) -> None:
        warned = self.__dict__.setdefault("_warned_limit", set())
        if changed in warned:
            return
        warned.add(changed)
        name = argument_name(self.fn, args, kwargs, changed)
        log.warning("fulmen: %s has been recompiled %d times because the value of its argument %s changed, and "
                    "compiled code is specialized on that value; from now on a call with a new value of it runs "
                    "eagerly (not compiled), and the values compiled so far still run compiled. Pass the value as "
                    "a tensor (torch.tensor(value)) so that one compilation serves every value.",
                    _display_name(self.fn), self._recompiles[changed], name)

    def _call_part(self, key) -> tuple:
        """The part of a cache key that describes the call's arguments (``args_key``)."""
        return key[0]

    def _with_call_part(self, key, call: tuple) -> Any:
        return (call, *key[1:])

    def _structure(self, key) -> Any:
        """The key with every size and int of the arguments erased: what calls that may share a program with
        dynamic sizes and ints have in common (their ``SizeHistory``)."""
        return erase_sizes(self._with_call_part(key, erase_ints(self._call_part(key), None)), None)

    def _pattern(self, key, symbolic: SymbolicSizes) -> Any:
        """The key with the sizes and ints ``symbolic`` made dynamic erased."""
        call = self._call_part(key)
        if symbolic.int_slots:
            key = self._with_call_part(key, erase_ints(call, symbolic.int_slots))
        return erase_sizes(key, symbolic.dims)

    def _dynamic_dims(self, key, sizes, ints, args=(), kwargs=None
                      ) -> tuple[dict[int, frozenset], frozenset[int], list[str]]:
        """The dims and int slots to make symbolic for this call, and a note for each newly seen changing."""
        if self.dynamic is False:
            return {}, frozenset(), []
        structure = self._structure(key)
        history = self._histories.get(structure)
        if history is None:
            if len(self._histories) >= MAX_CACHE_ENTRIES:  # bounded as the cache is: forget the oldest structure
                del self._histories[next(iter(self._histories))]
            history = self._histories[structure] = SizeHistory(list(sizes), list(ints))
            if self.dynamic:
                n_state = self._n_state()
                history.changed = {i: set(range(len(s))) for i, s in enumerate(sizes) if i >= n_state}
            elif self._marked_dims or self._marked_ints:
                history.changed = {i: {d for d in ds if d < len(sizes[i])}
                                   for i, ds in self._marked_dims.items() if i < len(sizes)}
                history.changed_ints = {slot for slot in self._marked_ints if slot < len(ints)}
            else:
                return {}, frozenset(), []
        notes = self._name_ints(history.update(sizes, ints), key, args, kwargs or {})
        if history.failed:
            return {}, frozenset(), []
        names = history.names
        exact = strided_inputs(key)
        texts = [describe_change(n, self._n_state(), names)
                 + (": kept exact (a non-contiguous tensor)" if n[0] in exact else ": marked dynamic") for n in notes]
        int_slots = frozenset() if history.ints_failed else symbolic_ints(history.changed_ints, ints)
        return symbolic_dims(history.changed, sizes, exact), int_slots, texts

    def _name_ints(self, notes: list[tuple], key, args, kwargs) -> list[tuple]:
        """The notes of ints (``SizeHistory.update``) with where each int is in the arguments."""
        if not any(n[0] is None for n in notes):
            return notes
        paths = int_paths(self._call_part(key), _arg_names(self.fn, args, kwargs))
        return [(*n, paths[n[1]]) if n[0] is None and n[1] < len(paths) else n for n in notes]

    def _carried_dims(self, key, args, kwargs, sizes, ints) -> tuple[dict[int, frozenset], frozenset[int], list[str]]:
        """A structure seen for the first time whose program rebinds tensors of the objects passed in to tensors of
        other sizes (a KV cache one token longer), or their ints to other values (its length): the next call will
        bring those sizes and values, so they are dynamic from this compilation on, with the sizes of the other
        inputs that differ from the last compilation's (the attention mask that grows with the cache). Traces once
        more to find out (``fulmen.frontend.objects``)."""
        none = {}, frozenset(), []
        history = self._histories.get(self._structure(key))
        last = self._stats_entry
        if history is None or history.changed or history.changed_ints or history.failed or history.ints_failed \
                or last is None or last.spec.objects is None or not last.spec.objects.effects:
            return none  # only after a program that stored tensors in objects passed in
        trace, spec = self._trace(args, kwargs)
        if spec.objects is None or not (spec.objects.rebound or spec.objects.rebound_ints):
            return none
        index = {p.name: i for i, p in enumerate(trace.args)}
        notes = []
        for name, old, new in spec.objects.rebound:
            i = index.get(name)
            if i is not None and len(old) == len(new):
                notes += [(i, d, a, b) for d, (a, b) in enumerate(zip(old, new)) if a != b]
        int_notes = self._name_ints([(None, slot, a, b) for slot, a, b in spec.objects.rebound_ints], key, args,
                                    kwargs)
        if not notes and not int_notes:
            return none
        if notes:
            before = {p.name: tuple(p.shape) for p in last.computation_trace.args}
            for i, p in enumerate(trace.args[:len(sizes)]):
                old = before.get(p.name)
                if old is not None and len(old) == len(sizes[i]):
                    notes += [(i, d, a, b) for d, (a, b) in enumerate(zip(old, sizes[i])) if a != b]
        for i, d, *_ in notes:
            history.changed.setdefault(i, set()).add(d)
        history.changed_ints.update(slot for _, slot, *_ in int_notes)
        history.exact = (ints, sizes, trace, spec)  # this call's exact trace, to check the symbolic one against
        names = history.names = [p.name for p in trace.args]
        texts = [describe_change(n, self._n_state(), names) + ": marked dynamic (state carried between calls)"
                 for n in notes + int_notes]
        return (symbolic_dims(history.changed, sizes, strided_inputs(key)),
                symbolic_ints(history.changed_ints, ints), texts)

    def _compile(self, key, args, kwargs, flat: list[torch.Tensor] | None = None,
                 guard_failure: str | None = None, reason: str | None = None) -> CacheEntry:
        stats = self._stats
        stats.cache_misses += 1
        sizes, ints = key_sizes(key), call_ints(self._call_part(key))
        dims, int_slots, notes = ({}, frozenset(), []) if flat is None else self._dynamic_dims(key, sizes, ints, args,
                                                                                               kwargs)
        if not dims and not int_slots and flat is not None and self.dynamic is None and self._compilations \
                and holds_objects(key):
            dims, int_slots, notes = self._carried_dims(key, args, kwargs, sizes, ints)
        if self._compilations:
            reason = reason or self.__dict__.pop("_next_reason", None) or self._describe_key_change(
                self._last_key, key, _arg_names(self.fn, args, kwargs))
            if notes:
                reason = "; ".join(notes)
            elif guard_failure:
                reason = f"{reason} ({guard_failure})"
            stats.recompile_reasons.append(reason)
            del stats.recompile_reasons[:-_MAX_REASONS]  # the latest ones, bounded as the cache is
            log.info("fulmen: recompiling %s: %s", getattr(self.fn, "__name__", self.fn), reason)
            changed = self._changed_value(self._last_key, key) if flat is not None else None
            if changed is not None:  # RECOMPILE_LIMIT: _miss counts these
                self._recompiles[changed] = self._recompiles.get(changed, 0) + 1
            elif self._compilations >= RECOMPILE_WARNING_THRESHOLD and not self._warned_recompiles:
                self._warned_recompiles = True
                log.warning("fulmen: %s has been compiled %d times; the latest recompile was caused by %s. Each "
                            "distinct key compiles once (see docs/recompilation.md); up to %d programs are kept.",
                            getattr(self.fn, "__name__", self.fn), self._compilations + 1,
                            stats.last_recompile_reason, MAX_CACHE_ENTRIES)
        self._compilations += 1
        entry = None
        if dims or int_slots:
            try:
                entry = self._compile_symbolic(key, args, kwargs, flat, sizes, dims, ints, int_slots)
            except Exception as e:  # never a crash because of dynamic sizes: compile for the exact sizes instead
                if self.options.raise_on_dynamic_failure:
                    raise
                self._dynamic_failed(key, e, bool(int_slots))
        if entry is None:
            entry = self._build(key, args, kwargs)
            history = self._histories.get(self._structure(key)) if self.dynamic is not False else None
            if history is not None and history.names is None:
                history.names = [p.name for p in entry.computation_trace.args]
            if history is not None and entry.program.steps[:1] == ["trace"]:
                history.exact = (ints, sizes, entry.program.traces[0], entry.spec)
        self._set_prologue(entry, key, args, kwargs, flat)
        self._remember(key, entry)
        self._last_key = key
        return entry

    def _dynamic_failed(self, key, error: Exception, ints: bool) -> None:
        self._histories[self._structure(key)].give_up(getattr(self.fn, "__name__", self.fn), error, ints)

    _prologue_of_module = False
    #: Dims symbolic from the first call (flat tensor index -> dims), as if already seen changing size: the Dynamo
    #: backend sets them to the dims Dynamo made dynamic, so that its dynamic graph compiles once, not twice.
    _marked_dims: dict[int, frozenset] = {}
    #: Int slots (``fulmen.frontend.dynamic.map_call_ints``) symbolic from the first call, likewise: the Dynamo
    #: backend sets them to the graph's SymInt inputs that no tensor's size gives.
    _marked_ints: frozenset[int] = frozenset()

    def _state_names(self) -> list[str]:
        """The names of a module's parameters and buffers, in the order of the flat inputs."""
        return []

    def _state_ids(self) -> Any:
        """A module's: what knows the ids of its parameters and buffers (``build_prologue``'s ``state_ids``)."""
        return None

    def _set_prologue(self, entry: CacheEntry, key, args, kwargs, flat: list[torch.Tensor] | None = None) -> None:
        """Generate the entry's prologue: the check, printed by ``last_prologue_traces``, that a call must pass.
        ``flat``: the tensors ``key`` was computed from, which its one C++ check of the tensors compares with (a
        prologue generated again keeps the first one's)."""
        names = _arg_names(self.fn, args, kwargs)
        entry.key = key
        fast = entry.prologue.fast if entry.prologue is not None else None
        entry.prologue = build_prologue(key, names, module=self._prologue_of_module, param_names=self._state_names(),
                                        symbolic=entry.symbolic, guard=entry.globals_guard,
                                        captured=entry.spec.captured,
                                        holders=entry.spec.objects.holders if entry.spec.objects is not None else (),
                                        examples=flat, fast=fast, distinct=self._same_tensors,
                                        state_ids=self._state_ids())
        entry.check = entry.prologue.check
        entry.n_guards = len(entry.symbolic.env.guards) if entry.symbolic is not None else 0
        if entry is self._stats_entry:
            self._stats.last_prologue_traces = [entry.prologue]

    def _remember(self, key, entry: CacheEntry) -> None:
        """Cache a compiled entry, dropping the least recently used beyond MAX_CACHE_ENTRIES (with the keys that
        alias it). A call that reuses the entry of the call before it does not reorder them; any other reuse looks
        the entry up by key (``_find``), which marks it used."""
        self._cache[key] = entry
        self._compiled.pop(key, None)
        self._compiled[key] = None
        if len(self._compiled) <= MAX_CACHE_ENTRIES:
            return
        oldest = next(iter(self._compiled))
        del self._compiled[oldest]
        dropped = self._cache.pop(oldest, None)
        self._variants.pop(oldest, None)
        if dropped is not None:
            for k in [k for k, e in self._cache.items() if e is dropped]:
                del self._cache[k]
            self._dynamic_entries = [e for e in self._dynamic_entries if e is not dropped]
            if self._last_entry is dropped:
                self._last_entry = None
        if not getattr(self, "_warned_eviction", False):
            self._warned_eviction = True
            log.warning("fulmen: %s has more than %d compiled programs; the least recently used are dropped from now "
                        "on (a call that needs one again compiles it again)", _display_name(self.fn), MAX_CACHE_ENTRIES)

    def _describe_key_change(self, old, new, names: list[str] = ()) -> str:
        return describe_key_change(old, new, names)

    def _compile_symbolic(self, key, args, kwargs, flat, sizes, dims, ints, int_slots) -> CacheEntry:
        # A ShapeEnv imports parts of Dynamo, AOTAutograd and torch.export as it goes, which the background
        # compiler imports too: under the lock it imports them under, or one thread can meet the other's
        # half-imported module (an ImportError).
        with compiler_import_lock:
            symbolic = SymbolicSizes(sizes, dims, ints, int_slots)
            entry = self._build(key, args, kwargs, symbolic)
            if entry.program.runtime is not None:
                # the backward is otherwise compiled when it first runs: fail here, where exact sizes can take over
                entry.program.backward_traces()
            holds = symbolic.guard(flat, ints)  # also builds the guard function, which may import more
        if not holds:
            raise RuntimeError("the guards recorded while tracing do not hold for the sizes traced")
        if not self._marked_dims and not self._marked_ints:  # Python asking a SymInt's type: an exact trace's program?
            check_symbolic_trace(self._histories[self._structure(key)], symbolic, entry, (ints, sizes),
                                 lambda sizes=None, ints=None: self._trace(args, kwargs, sizes=sizes, ints=ints)
                                 if ints else self._trace(args, kwargs, sizes=sizes))  # exactly, or at other values
        entry.symbolic = symbolic
        entry.pattern = self._pattern(key, symbolic)
        self._dynamic_entries.append(entry)
        return entry

    def _build(self, key, args, kwargs, symbolic: SymbolicSizes | None = None) -> CacheEntry:
        """Trace and compile for one key (for symbolic sizes when ``symbolic`` is given)."""
        with compile_mode_set(self.compile_mode):
            return self._build_entry(key, args, kwargs, symbolic)

    def _build_entry(self, key, args, kwargs, symbolic: SymbolicSizes | None) -> CacheEntry:
        stats = self._stats
        start = time.perf_counter()
        autocast_devices = tuple(p.device_type for p in current_policies())
        if symbolic is not None and symbolic.ints:
            trace, spec = self._trace(args, kwargs, sizes=symbolic.sizes, ints=symbolic.ints)
        else:  # (a subclass's _trace may take no ints: fsdp2_program's)
            trace, spec = self._trace(args, kwargs, sizes=symbolic.sizes if symbolic is not None else None)
        traced = time.perf_counter()
        leaves = makes_leaves(trace)  # then the program runs under PyTorch autograd (fulmen.frontend.leaves)
        run = PipelineRun([torchex.ex] if leaves else self.executors, self.options)
        trace = computation_steps(trace, run)  # the executors' and the user's steps, before autodiff
        graph_name = self._graph_name(trace, spec, symbolic)
        entry = CacheEntry(program=None, spec=spec, computation_trace=trace, written=written_inputs(trace),
                           globals_guard=spec.guard, read_tensors=read_tensor_ids(spec))
        needs_grad = entry.differentiates = not leaves and self._needs_grad(trace, spec.tensor_proxies)
        if needs_grad:
            program = self._training_program(trace, run, graph_name, symbolic, entry)
        else:
            program = compile_inference(trace, run, cuda_graphs=graph_name)
        entry.plan = RunPlan(autocast_devices=autocast_devices, restores_rng=bool(spec.values),
                             lazy_views=tuple(lazy_view_inputs(key)), written=entry.written,
                             attributes=assigner(spec.attributes) if spec.attributes else None, objects=spec.objects,
                             enables_grad=needs_grad and not torch.is_grad_enabled())
        self._set_program(entry, program)
        done = time.perf_counter()
        stats.last_trace_time_ms = (traced - start) * 1e3
        stats._last_compile_time_ms = (done - start) * 1e3
        self._record(entry)
        stats._settle = program.settle  # set while the first call runs on PyTorch autograd
        self._stats_entry = entry
        return entry

    def _set_program(self, entry: CacheEntry, program: CompiledProgram) -> None:
        """The entry runs ``program``, with what its plan asks for around it (``fulmen.frontend.runner``)."""
        entry.program = program
        entry.run = compose(program.run, entry.plan)

    def _graph_name(self, trace: Trace, spec: InputSpec, symbolic: SymbolicSizes | None) -> str | None:
        """The name CUDA-graph logs give the program when it replays as CUDA graphs; None when it does not."""
        graph_name = _display_name(self.fn) if self.cuda_graphs else None
        if graph_name and symbolic is not None:
            log.warning("fulmen: %s runs without CUDA graphs: its sizes are dynamic (pass dynamic=False to compile "
                        "for exact sizes)", graph_name)
            return None
        if graph_name and (spec.values or any(has_unbacked(b.flat_proxy_outs) for b in trace.bound_symbols)):
            # a replayed graph runs no Python (a split point's check) and fixes every size (a data-dependent one)
            log.warning("fulmen: %s runs without CUDA graphs: it has data-dependent sizes or split points",
                        graph_name)
            return None
        return graph_name

    def _training_program(self, trace: Trace, run: PipelineRun, graph_name: str | None,
                          symbolic: SymbolicSizes | None, entry: CacheEntry) -> CompiledProgram:
        from fulmen.frontend.training import compile_training

        if symbolic is None and warm_start.applies(trace, self.executors, self.options):
            self._stats._deferred += 1
            return warm_start.deferred_training(
                trace, self.options, lambda: compile_training(trace, run, cuda_graphs=graph_name),
                on_ready=lambda real: self._on_compiled(entry, real))
        return compile_training(trace, run, cuda_graphs=graph_name)

    def _record(self, entry: CacheEntry) -> None:
        stats, program = self._stats, entry.program
        stats._phase_times_ms = {"trace": stats.last_trace_time_ms, **program.timings_ms}
        stats._last_traces, stats._last_steps = list(program.traces), list(program.steps)
        stats._backward_traces = program.backward_traces
        runtime = program.runtime
        stats._backward_steps = runtime.last_steps if runtime is not None else None

    def _on_compiled(self, entry: CacheEntry, real: CompiledProgram) -> None:
        """A program whose first call ran on PyTorch autograd is compiled: the entry runs it from now on (in the
        first program's place, which stays as it was), and the statistics show it if it is still the last
        compilation."""
        self._set_program(entry, real)
        stats = self._stats
        stats._deferred -= 1
        if self._stats_entry is entry:
            stats._last_compile_time_ms += sum(real.timings_ms.values())
            stats._settle = None
            self._record(entry)


def _rebuild(cls: type, args: tuple, options: dict) -> JittedFunction:
    return cls(*args, **options)


def _display_name(fn) -> str:
    owner = getattr(fn, "__self__", None)  # a module's bound forward: name the module
    if isinstance(owner, torch.nn.Module):
        return type(owner).__name__
    return getattr(fn, "__qualname__", None) or type(fn).__name__
