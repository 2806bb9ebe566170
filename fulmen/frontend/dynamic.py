"""Automatic dynamic sizes: one compilation serves every size of the dimensions that change between calls.

When a call misses the cache only because some tensor dimensions changed size (same ranks, dtypes, devices,
requires_grad, same non-tensor arguments), those dimensions are marked dynamic and the program is traced once
more with ``torch.SymInt`` sizes from a ``ShapeEnv`` (``torch.fx.experimental.symbolic_shapes``). Every
comparison a meta makes on them is recorded by the ShapeEnv as a guard; the cache entry keeps the guards as
one compiled Python function of the call's tensors, and a later call whose key differs only in those
dimensions reuses the entry when the guards hold. Sizes 0 and 1 are never made symbolic (as in torch, they
specialize: broadcasting and squeezing depend on them).

A key (``fulmen.frontend.cache``) holds each tensor as ``(torch.Size, dtype, device, requires_grad)`` (and its
strides when it is not contiguous); the helpers below walk keys, so they see tensors in the order of the flat input
list.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from fulmen.core import symbolic
from fulmen.core.unbacked import is_unbacked_symbol
from fulmen.core.utils import compiler_import_lock
from fulmen.frontend.cache import is_tensor_key, tensor_keys


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


@dataclasses.dataclass
class SizeHistory:
    """The sizes first seen for one key structure, and the dims seen with another size since."""

    sizes: list[torch.Size]
    changed: dict[int, set] = dataclasses.field(default_factory=dict)
    names: list[str] | None = None  # the inputs' names in the first trace, for messages
    failed: bool = False  # compiling with dynamic sizes failed once: exact sizes from then on

    def update(self, sizes: list[torch.Size]) -> list[str]:
        """Mark the dims that differ from the first sizes; returns a description of each newly marked one."""
        notes = []
        for i, (old, new) in enumerate(zip(self.sizes, sizes)):
            for d, (a, b) in enumerate(zip(old, new)):
                if a != b and d not in self.changed.get(i, ()):
                    self.changed.setdefault(i, set()).add(d)
                    notes.append((i, d, a, b))
        return notes


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

    return SizeSource


_SizeSource = None


class SymbolicSizes:
    """A ShapeEnv and the symbols of one dynamic compilation: ``sizes[i]`` is the (partly symbolic) shape to
    give flat input ``i``; ``guard(flat)`` says whether a later call's sizes satisfy what tracing assumed."""

    def __init__(self, sizes: list[torch.Size], dims: dict[int, frozenset]):
        global _SizeSource
        symbolic.in_use = True
        with compiler_import_lock:
            from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

        if _SizeSource is None:
            _SizeSource = _source_class()
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
        self._guard: Callable | None = None
        self._conditions: list[tuple[str, Callable]] = []
        self._n_guards = -1

    def _build(self) -> None:
        from torch.utils._sympy.printers import PythonPrinter

        printer = PythonPrinter()
        env = self.env
        binds = [f"{sym} = flat[{i}].shape[{d}]" for sym, i, d in self.symbols]
        conds: list[str] = []
        for sym, _, _ in self.symbols:
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
        exec(f"def guard(flat):\n{body}\n    return bool({test})\n", namespace)
        self._guard = namespace["guard"]
        self._conditions = []
        for c in conds:
            ns = {"math": math, "torch": torch}
            exec(f"def cond(flat):\n{body}\n    return bool({c})\n", ns)
            self._conditions.append((c, ns["cond"]))
        self._n_guards = len(env.guards)
        self.source = test

    def guard(self, flat: list[torch.Tensor]) -> bool:
        # Rebuilt when something compared the symbols after compilation (the guards only ever grow).
        if self._guard is None or self._n_guards != len(self.env.guards):
            self._build()
        try:
            return self._guard(flat)
        except Exception:  # a size the guards cannot evaluate (e.g. a division by zero): not a match
            return False

    def explain(self, flat: list[torch.Tensor]) -> str:
        """The first guard the sizes of ``flat`` fail, with the symbols' values."""
        if self._guard is None:
            self._build()
        values = ", ".join(f"{sym}={flat[i].shape[d]}" for sym, i, d in self.symbols)
        for text, cond in self._conditions:
            try:
                ok = cond(flat)
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
    """``argument 0 (idx) dim 1 changed 32 -> 48`` (arguments counted among the tensor inputs)."""
    i, d, a, b = note
    what = f"argument {i - n_state}" if i >= n_state else f"parameter/buffer {i}"
    if names is not None and i < len(names):
        what += f" ({names[i]})"
    return f"{what} dim {d} changed {a} -> {b}"
