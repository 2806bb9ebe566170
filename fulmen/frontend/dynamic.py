"""Automatic dynamic sizes: one compilation serves every size of the dimensions that change between calls.

When a call misses the cache only because some tensor dimensions changed size (same ranks, dtypes, devices,
requires_grad, same non-tensor arguments), those dimensions are marked dynamic and the program is traced once
more with ``torch.SymInt`` sizes from a ``ShapeEnv`` (``torch.fx.experimental.symbolic_shapes``). Every
comparison a meta makes on them is recorded by the ShapeEnv as a guard; the cache entry keeps the guards as
one compiled Python function of the call's tensors, and a later call whose key differs only in those
dimensions reuses the entry when the guards hold. Sizes 0 and 1 are never made symbolic (as in torch, they
specialize: broadcasting and squeezing depend on them).

Python ints among the arguments get the same treatment (``int_slots``): an int argument, or one inside a container
or an object the key walks (a sliding-window cache's ``cumulative_length``), whose value changes between calls is
traced as a ``torch.SymInt`` of the same ShapeEnv. Whatever the traced code does with it either stays symbolic
(arithmetic, slicing, sizes) or is recorded as a guard (a comparison, ``range``, ``int()``), so the entry serves every
value its guards accept. As for sizes, only values of at least 2 become symbolic, and bools never do. The program
reads an int symbol from a *carrier*: an input tensor of shape ``(n,)`` and no storage of its own that the prologue
makes from the call's int (``int_carrier``), so that generated code binds it as it binds sizes (``s3 =
n.shape[0]``).

A key (``fulmen.frontend.cache``) holds each tensor as ``(torch.Size, dtype, device, requires_grad)`` (and its
strides when it is not contiguous); the helpers below walk keys, so they see tensors in the order of the flat input
list.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from fulmen.core import symbolic
from fulmen.core.unbacked import is_unbacked_symbol
from fulmen.core.utils import compiler_import_lock
from fulmen.frontend.cache import OBJECT, is_tensor_key, tensor_keys

log = logging.getLogger("fulmen")


def key_sizes(key: Any) -> list[torch.Size]:
    """The sizes of the tensors a key describes, in flat-input order."""
    return [k[0] for k in tensor_keys(key)]


def strided_inputs(key: Any) -> frozenset[int]:
    """Flat positions of the tensors keyed with their strides (non-contiguous): their sizes stay exact, as the
    strides the trace gives them are exact."""
    return frozenset(i for i, k in enumerate(tensor_keys(key)) if len(k) == 5)


def erase_sizes(key: Any, dims: dict[int, frozenset] | None, counter: list | None = None) -> Any:
    """The key with the sizes of ``dims`` (flat tensor index -> dims) replaced by None; with ``dims=None``
    every size is erased and only the rank is kept (what must match for sizes to be made dynamic)."""
    counter = counter if counter is not None else [0]
    if is_tensor_key(key):
        i = counter[0]
        counter[0] += 1
        shape = key[0]
        if dims is None:
            return (len(shape), *key[1:])
        erased = dims.get(i)
        if not erased:
            return key
        return (tuple(None if d in erased else s for d, s in enumerate(shape)), *key[1:])
    if type(key) is tuple:
        return tuple(erase_sizes(v, dims, counter) for v in key)
    return key


# ---- ints: the int values a key holds where tracing reads them from the arguments ----
def _map_ints(key: Any, fn: Callable[[tuple], Any]) -> Any:
    """``key`` (the key of one argument, ``fulmen.frontend.cache.value_key``) with each ``(int, value)`` part that
    stands for an int the traced code reads from the argument replaced by ``fn(part)``, in the order the key's walk
    met them: items of tuples, lists and dicts (their values, not their keys) and members of objects. Values keyed
    by their contents (a set, a config keyed by identity, a ``torch.Size``) are not walked: tracing reads them as
    they are."""
    if type(key) is not tuple or is_tensor_key(key):
        return key
    if len(key) == 2 and key[0] is int and type(key[1]) is int:
        return fn(key)
    if len(key) == 4 and key[0] == OBJECT:
        return (*key[:3], tuple([_map_ints(k, fn) for k in key[3]]))
    if len(key) == 2 and isinstance(key[0], type) and type(key[1]) is tuple and key[0] is not torch.Size:
        if issubclass(key[0], dict):
            return (key[0], tuple([(k, _map_ints(v, fn)) for k, v in key[1]]))
        if issubclass(key[0], (tuple, list)):
            return (key[0], tuple([_map_ints(v, fn) for v in key[1]]))
    return key


def map_call_ints(call_key: tuple, fn: Callable[[tuple], Any]) -> tuple:
    """``_map_ints`` over a call's key (``fulmen.frontend.cache.args_key``): the positional arguments, then the
    keyword arguments' values."""
    out = []
    for a in call_key:
        if type(a) is tuple and a[:1] == ("kwargs",):
            out.append(("kwargs", *[(k, _map_ints(v, fn)) for k, v in a[1:]]))
        else:
            out.append(_map_ints(a, fn))
    return tuple(out)


def _int_paths(key: Any, path: str, out: list[str]) -> None:
    """The paths (``cache.layers[0].cumulative_length``) of the ints ``_map_ints`` walks, in the same order."""
    if type(key) is not tuple or is_tensor_key(key):
        return
    if len(key) == 2 and key[0] is int and type(key[1]) is int:
        out.append(path)
    elif len(key) == 4 and key[0] == OBJECT:
        for name, k in zip(key[2], key[3]):
            _int_paths(k, f"{path}.{name}", out)
    elif len(key) == 2 and isinstance(key[0], type) and type(key[1]) is tuple and key[0] is not torch.Size:
        if issubclass(key[0], dict):
            for k, v in key[1]:
                _int_paths(v, f"{path}[{k!r}]", out)
        elif issubclass(key[0], (tuple, list)):
            for i, v in enumerate(key[1]):
                _int_paths(v, f"{path}[{i}]", out)


def int_paths(call_key: tuple, arg_names: list[str]) -> list[str]:
    """Where each int of a call's key is, in slot order, for messages: ``n``, ``past_key_values.layers[0].x``."""
    out: list[str] = []
    for i, a in enumerate(call_key):
        if type(a) is tuple and a[:1] == ("kwargs",):
            for k, v in a[1:]:
                _int_paths(v, k, out)
        else:
            _int_paths(a, arg_names[i] if i < len(arg_names) else f"argument {i}", out)
    return out


def call_ints(call_key: tuple) -> list[int]:
    """The int values of a call's key, in slot order (``map_call_ints``)."""
    values: list[int] = []
    map_call_ints(call_key, lambda k: values.append(k[1]) or k)
    return values


def erase_ints(call_key: tuple, slots: frozenset[int] | None) -> tuple:
    """A call's key with the values of the int ``slots`` (all of them for None) replaced by None."""
    counter = itertools.count()

    def erase(k: tuple) -> tuple:
        i = next(counter)
        return (int, None) if slots is None or i in slots else k

    return map_call_ints(call_key, erase)


@functools.lru_cache(maxsize=1024)
def int_carrier(n: int) -> torch.Tensor:
    """The input through which a program reads the symbolic int ``n``: a tensor of shape ``(n,)`` that owns no
    memory (a broadcast view of one byte); nothing in the program reads or writes its elements, so one carrier
    per value serves every call (kept: making a view costs more than looking one up)."""
    return _CARRIER_BASE.expand(n)


_CARRIER_BASE = torch.zeros(1, dtype=torch.uint8)


@dataclasses.dataclass
class SizeHistory:
    """The sizes and int values first seen for one key structure, and the dims and int slots seen with another
    value since."""

    sizes: list[torch.Size]
    ints: list[int] = dataclasses.field(default_factory=list)
    changed: dict[int, set] = dataclasses.field(default_factory=dict)
    changed_ints: set[int] = dataclasses.field(default_factory=set)
    names: list[str] | None = None  # the inputs' names in the first trace, for messages
    failed: bool = False  # compiling with dynamic sizes failed once: exact sizes from then on
    ints_failed: bool = False  # compiling with symbolic ints failed once: exact ints from then on
    #: (ints, sizes, raw trace, InputSpec) of the structure's last exact compilation, which a trace with symbolic
    #: sizes or ints is checked against (``fulmen.frontend.same_program``)
    exact: tuple | None = None

    def update(self, sizes: list[torch.Size], ints: list[int] = ()) -> list[tuple]:
        """Mark the dims and int slots that differ from the first values; returns a note for each newly marked one:
        ``(flat index, dim, old, new)`` for a size, ``(None, slot, old, new)`` for an int."""
        notes = []
        for i, (old, new) in enumerate(zip(self.sizes, sizes)):
            for d, (a, b) in enumerate(zip(old, new)):
                if a != b and d not in self.changed.get(i, ()):
                    self.changed.setdefault(i, set()).add(d)
                    notes.append((i, d, a, b))
        for slot, (a, b) in enumerate(zip(self.ints, ints)):
            if a != b and slot not in self.changed_ints:
                self.changed_ints.add(slot)
                notes.append((None, slot, a, b))
        return notes

    def give_up(self, fn_name: str, error: Exception, ints: bool) -> None:
        """Compiling with symbolic sizes or ints failed: exact from now on for this structure of arguments, the ints
        only when some were symbolic (code that needs a plain int: ``torch.tensor(n)``, ``x[:, n]``), logged."""
        if ints:
            self.ints_failed = True
        else:
            self.failed = True
        log.warning("fulmen: compiling %s with %s failed (%s: %s); compiling for the exact %s instead, and for "
                    "every new %s of these arguments from now on", fn_name, "symbolic ints" if ints else
                    "dynamic sizes", type(error).__name__, str(error).split("\n")[0][:300],
                    "ints" if ints else "sizes", "int value" if ints else "size")


def symbolic_dims(changed: dict[int, set], sizes: list[torch.Size],
                  exact: frozenset[int] = frozenset()) -> dict[int, frozenset]:
    """The dims to make symbolic for these sizes: changed ones whose size is not 0 or 1 (those specialize), of
    tensors not in ``exact`` (non-contiguous ones: ``strided_inputs``)."""
    out = {}
    for i, ds in changed.items():
        if i in exact:
            continue
        keep = frozenset(d for d in ds if sizes[i][d] > 1)
        if keep:
            out[i] = keep
    return out


def symbolic_ints(changed: set[int], ints: list[int]) -> frozenset[int]:
    """The int slots to make symbolic for these values: changed ones whose value is at least 2 (0 and 1 specialize,
    as sizes do; a negative value stays exact, as a carrier's size cannot hold it)."""
    return frozenset(i for i in changed if i < len(ints) and ints[i] >= 2)


def _source_class():
    from torch._guards import GuardSource, Source

    @dataclasses.dataclass(frozen=True)
    class SizeSource(Source):
        """Dimension ``dim`` of flat input ``index`` (what a symbol is bound from)."""

        index: int
        dim: int

        @property
        def name(self) -> str:
            return f"flat[{self.index}].shape[{self.dim}]"

        @property
        def guard_source(self):
            return GuardSource.LOCAL

    @dataclasses.dataclass(frozen=True)
    class IntSource(Source):
        """The int in slot ``slot`` of the call's arguments (``map_call_ints``)."""

        slot: int

        @property
        def name(self) -> str:
            return f"ints[{self.slot}]"

        @property
        def guard_source(self):
            return GuardSource.LOCAL

    return SizeSource, IntSource


_SizeSource = _IntSource = None


class SymbolicSizes:
    """A ShapeEnv and the symbols of one dynamic compilation: ``sizes[i]`` is the (partly symbolic) shape to
    give flat input ``i``, ``ints[slot]`` the SymInt to give the int in ``slot`` (``map_call_ints``);
    ``guard(flat, ints)`` says whether a later call's sizes and ints satisfy what tracing assumed."""

    def __init__(self, sizes: list[torch.Size], dims: dict[int, frozenset], ints: list[int] = (),
                 int_slots: frozenset[int] = frozenset()):
        global _SizeSource, _IntSource
        symbolic.in_use = True
        with compiler_import_lock:
            from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

        if _SizeSource is None:
            _SizeSource, _IntSource = _source_class()
        # duck_shape=False: two dims that happen to have the same size get two symbols; a meta that needs them
        # equal records that as a guard.
        self.env = ShapeEnv(duck_shape=False)
        self.dims = dims
        self.symbols: list[tuple[Any, int, int]] = []  # (sympy symbol, flat index, dim)
        self.sizes: list[torch.Size] = []
        for i, shape in enumerate(sizes):
            ds = dims.get(i)
            if not ds:
                self.sizes.append(shape)
                continue
            new = list(shape)
            for d in sorted(ds):
                source = _SizeSource(i, d)
                sym = self.env.create_symbol(int(shape[d]), source, dynamic_dim=DimDynamic.DYNAMIC)
                new[d] = self.env.create_symintnode(sym, hint=int(shape[d]), source=source)
                self.symbols.append((sym, i, d))
            self.sizes.append(torch.Size(new))
        self.int_slots = int_slots
        self.int_symbols: list[tuple[Any, int]] = []  # (sympy symbol, slot)
        self.ints: dict[int, torch.SymInt] = {}
        for slot in sorted(int_slots):
            # an int is a size to the ShapeEnv: at least 2 (0 and 1 specialize), which the guards check
            source = _IntSource(slot)
            sym = self.env.create_symbol(int(ints[slot]), source, dynamic_dim=DimDynamic.DYNAMIC)
            self.ints[slot] = self.env.create_symintnode(sym, hint=int(ints[slot]), source=source)
            self.int_symbols.append((sym, slot))
        self._guard: Callable | None = None
        self._conditions: list[tuple[str, Callable]] = []
        self._n_guards = -1

    def _build(self) -> None:
        from torch.utils._sympy.printers import PythonPrinter

        printer = PythonPrinter()
        env = self.env
        binds = [f"{sym} = flat[{i}].shape[{d}]" for sym, i, d in self.symbols]
        binds += [f"{sym} = ints[{slot}]" for sym, slot in self.int_symbols]
        conds: list[str] = []
        for sym in [s for s, *_ in self.symbols] + [s for s, _ in self.int_symbols]:
            vr = env.var_to_range.get(sym)
            if vr is None:
                continue
            if vr.lower.is_Integer:
                conds.append(f"{int(vr.lower)} <= {sym}")
            if vr.upper.is_Integer:
                conds.append(f"{sym} <= {int(vr.upper)}")
        for g in env.guards:
            conds.append(printer.doprint(g.expr))
        for asserts in getattr(env, "deferred_runtime_asserts", {}).values():
            # what an op's meta assumed about a data-dependent size (u0 <= numel) is not a fact of the inputs'
            # sizes: the op checks it when it runs
            conds.extend(printer.doprint(ra.expr) for ra in asserts
                         if not any(is_unbacked_symbol(f) for f in ra.expr.free_symbols))
        namespace = {"math": math, "torch": torch}
        body = "\n".join("    " + b for b in binds) or "    pass"
        test = " and ".join(f"({c})" for c in conds) or "True"
        exec(f"def guard(flat, ints):\n{body}\n    return bool({test})\n", namespace)
        self._guard = namespace["guard"]
        self._conditions = []
        for c in conds:
            ns = {"math": math, "torch": torch}
            exec(f"def cond(flat, ints):\n{body}\n    return bool({c})\n", ns)
            self._conditions.append((c, ns["cond"]))
        self._n_guards = len(env.guards)
        self.source = test

    def guard(self, flat: list[torch.Tensor], ints: list[int] = ()) -> bool:
        # Rebuilt when something compared the symbols after compilation (the guards only ever grow).
        if self._guard is None or self._n_guards != len(self.env.guards):
            self._build()
        try:
            return self._guard(flat, ints)
        except Exception:  # a size the guards cannot evaluate (e.g. a division by zero): not a match
            return False

    def explain(self, flat: list[torch.Tensor], ints: list[int] = ()) -> str:
        """The first guard the sizes of ``flat`` and the ints ``ints`` fail, with the symbols' values."""
        if self._guard is None:
            self._build()
        values = ", ".join([f"{sym}={flat[i].shape[d]}" for sym, i, d in self.symbols]
                           + [f"{sym}={ints[slot] if slot < len(ints) else '?'}" for sym, slot in self.int_symbols])
        for text, cond in self._conditions:
            try:
                ok = cond(flat, ints)
            except Exception:
                ok = False
            if not ok:
                return f"{text} (with {values})"
        return f"no guard failed (with {values})"

    def guard_source(self) -> str:
        """The guards as one Python condition over the symbols."""
        if self._guard is None or self._n_guards != len(self.env.guards):
            self._build()
        return self.source


def describe_change(note: tuple, n_state: int, names: list[str] | None = None) -> str:
    """``argument 0 (idx) dim 1 changed 32 -> 48`` (arguments counted among the tensor inputs); ``int
    cache.layers[0].seen changed 6 -> 7`` for an int (a note with its path: ``int_paths``)."""
    i, d, a, b, *where = note
    if i is None:
        return f"int {where[0] if where else d} changed {a} -> {b}"
    what = f"argument {i - n_state}" if i >= n_state else f"parameter/buffer {i}"
    if names is not None and i < len(names):
        what += f" ({names[i]})"
    return f"{what} dim {d} changed {a} -> {b}"


class IntInputs:
    """While tracing: numbers the ints of the arguments in slot order (``map_call_ints``: the order ``proxify``
    and ``fulmen.frontend.objects.ObjectSwaps`` meet them) and hands out the symbolic ones in their place. A plain int
    given for a slot replaces the argument's value (an exact trace at other values: ``fulmen.frontend.same_program``)
    and has no carrier."""

    def __init__(self, symbols: dict[int, torch.SymInt | int] | None = None):
        symbols = symbols or {}
        self.symbols = {slot: s for slot, s in symbols.items() if type(s) is not int}
        self.values = {slot: v for slot, v in symbols.items() if type(v) is int}
        self.count = 0
        self.names: dict[int, str] = {}  # symbolic slot -> the name of the argument or member it was met as

    def __call__(self, value: int, name: str) -> int | torch.SymInt:
        slot = self.count
        self.count += 1
        sym = self.symbols.get(slot)
        if sym is None:
            return self.values.get(slot, value)
        self.names[slot] = name
        return sym
