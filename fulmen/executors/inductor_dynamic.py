"""One Inductor kernel for a region whose input sizes vary: the sizes that changed are symbols in its compilation.

A fused region keeps one kernel per input layout it has seen (``FusedRegion``). Where a size changes from call to
call, as a key/value cache grows by one position per decoded token, that would be one compilation per call. Once a
region has seen two layouts that differ only in some sizes, it compiles one more kernel with those sizes symbolic,
as ``torch.compile`` does after a recompilation ("automatic dynamic"): its example inputs are fake tensors whose
varying sizes are symbols of a shape environment, Inductor's generated code reads them from its inputs, and
what Inductor assumed about them while it compiled (the guards it recorded: two sizes equal, a size at most some
bound) is checked before each new layout runs it.

``LayoutCheck`` holds everything the compiled kernel relies on about its inputs: the sizes that are constants,
which sizes are the same symbol, the strides as expressions of the symbols (a cache's strides grow with its
length), that each symbol is at least 2 (a shape environment specializes sizes 0 and 1), and the guards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter, itemgetter, methodcaller

import sympy
import torch

__all__ = ["LayoutCheck", "check_output_strides", "layout_key", "symbolic_fakes", "symbolic_layout", "varying_dims"]

_SHAPE, _STRIDE, _STRIDE_OF = attrgetter("shape"), methodcaller("stride"), itemgetter(1)


def layout_key(args: Sequence[torch.Tensor]) -> tuple:
    """``((shape, stride), ...)`` of a region's inputs, what selects its kernel. Built by C accessors (``map`` of
    ``attrgetter``/``methodcaller``, ``zip``): a region runs it on every call its steady check misses, so it calls
    no Python function per input."""
    return tuple(zip(map(_SHAPE, args), map(_STRIDE, args)))


def varying_dims(old: tuple, new: tuple) -> frozenset[tuple[int, int]] | None:
    """The (input, dim) whose size differs between two layouts ``((shape, stride), ...)`` of a region's inputs;
    ``None`` where they differ otherwise (another rank)."""
    if len(old) != len(new):
        return None
    dims = set()
    for i, ((old_shape, _), (new_shape, _)) in enumerate(zip(old, new)):
        if len(old_shape) != len(new_shape):
            return None
        dims.update((i, d) for d, (a, b) in enumerate(zip(old_shape, new_shape)) if a != b)
    return frozenset(dims)


def symbolic_layout(old: tuple, new: tuple, dims: frozenset[tuple[int, int]], args: Sequence[torch.Tensor]) -> tuple:
    """What selects a kernel compiled with the sizes at ``dims`` symbolic, from the two layouts (``layout_key``) whose
    sizes differ there and the call's inputs: each input's sizes with None at ``dims``, its strides where they are the
    same in both layouts (a constant-size input's, transposed or sliced, and a cache's inner ones) and, where they
    changed with the sizes, the dim's place in the order of its strides; then dtype and device. Regions with the same
    code share the kernel only where their strides agree so: a kernel compiled for other strides of a constant-size
    input would fit none of this region's calls."""
    out = []
    for i, a in enumerate(args):
        (_, old_strides), (_, strides) = old[i], new[i]
        order = sorted(range(len(strides)), key=lambda d: (strides[d], d))
        rank = {d: k for k, d in enumerate(order)}
        out.append(
            (
                tuple(None if (i, d) in dims else n for d, n in enumerate(a.shape)),
                tuple(s if s == t else ("order", rank[d]) for d, (s, t) in enumerate(zip(strides, old_strides))),
                a.dtype,
                a.device,
            )
        )
    return tuple(out)


def symbolic_fakes(fake_mode, example: Sequence[torch.Tensor], dims: frozenset[tuple[int, int]]) -> list:
    """Fake tensors like ``example`` in ``fake_mode`` (which has a shape environment), the sizes at ``dims``
    symbolic."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    fakes = []
    for i, a in enumerate(example):
        sizes = [DimDynamic.DYNAMIC if (i, d) in dims else DimDynamic.STATIC for d in range(a.dim())]
        context = StatelessSymbolicContext(dynamic_sizes=sizes)
        fakes.append(fake_mode.from_tensor(a, source=ConstantSource(f"input{i}"), symbolic_context=context))
    return fakes


def _expr(value, shape_env=None) -> sympy.Basic:
    """A size or stride (an int or a SymInt) as a sympy expression, in the terms of ``shape_env``'s replacements."""
    node = getattr(value, "node", None)
    if node is None:
        return sympy.Integer(int(value))
    return node.expr if shape_env is None else shape_env.replace(node.expr)


class LayoutCheck:
    """Whether a call's inputs are ones a kernel compiled for ``fakes`` (with the guards of ``shape_env``) runs
    correctly on. Built after the compilation, so that it sees every guard Inductor recorded."""

    def __init__(self, fakes: Sequence, shape_env):
        from torch.utils._sympy.printers import PythonPrinter

        printer = PythonPrinter()
        self.static: list[tuple[int, int, int]] = []
        self.sources: dict[sympy.Symbol, tuple[int, int]] = {}
        self.same: list[tuple[int, int, int, int]] = []
        for i, fake in enumerate(fakes):
            for d, size in enumerate(fake.shape):
                e = _expr(size, shape_env)
                if e.is_Integer:
                    self.static.append((i, d, int(e)))
                elif isinstance(e, sympy.Symbol):
                    if e in self.sources:
                        self.same.append((i, d, *self.sources[e]))
                    else:
                        self.sources[e] = (i, d)
                else:
                    raise NotImplementedError(f"input {i} has size {e} in dim {d}: not a symbol")
        names = sorted(self.sources, key=str)
        self.order = [self.sources[s] for s in names]
        params = ", ".join(str(s) for s in names)
        strides = ", ".join(
            "(" + "".join(printer.doprint(_expr(s, shape_env)) + ", " for s in fake.stride()) + ")" for fake in fakes
        )
        # a guard that two sizes are equal also made one symbol stand for both: in those terms it holds trivially
        exprs = [shape_env.replace(g.expr) for g in shape_env.guards]
        exprs = [e for e in exprs if e is not sympy.true]
        guards = [printer.doprint(e) for e in exprs]
        free = {s for e in exprs for s in e.free_symbols} - set(self.sources)
        if free:
            raise NotImplementedError(f"guards on sizes that are no input's: {sorted(map(str, free))}")
        scope = {"Min": min, "Max": max}
        self._strides: Callable = eval(f"lambda {params}: ({strides},)", scope)  # noqa: S307  (printed by sympy)
        self._guards: Callable = eval(f"lambda {params}: {' and '.join(guards) or 'True'}", scope)  # noqa: S307
        self.guards = guards

    def fits(self, args: Sequence[torch.Tensor]) -> bool:
        return self.fits_layout(layout_key(args))

    def fits_layout(self, key: tuple) -> bool:
        """Whether the inputs whose layout is ``key`` (``layout_key``'s ``((shape, stride), ...)``) fit. A region
        whose inputs grow every call runs this on each call, so it reads the key already built and calls no
        Python function per input: the strides are compared as one tuple, dim by dim only where they differ."""
        for i, d, size in self.static:
            if key[i][0][d] != size:
                return False
        for i, d, j, e in self.same:
            if key[i][0][d] != key[j][0][e]:
                return False
        values = [key[i][0][d] for i, d in self.order]
        if values and min(values) < 2:
            return False
        strides = self._strides(*values)
        if tuple(map(_STRIDE_OF, key)) != strides and not _strides_match(key, strides):
            return False
        return bool(self._guards(*values))


def _strides_match(key: tuple, strides: tuple) -> bool:
    """Each input's strides are ``strides``' but where a dim has size 1 (a stride that is never used)."""
    for (shape, have), want in zip(key, strides):
        if any(w != h and shape[k] != 1 for k, (w, h) in enumerate(zip(want, have))):
            return False
    return True


def check_output_strides(compiled, gm: torch.fx.GraphModule) -> None:
    """Raise unless Inductor's outputs have the strides the region's operations give them, as expressions of the
    symbols (a kernel for one layout copies an output into eager's strides instead; here they must agree)."""
    got = getattr(compiled, "output_strides", None) or []
    out = gm.graph.find_nodes(op="output")[0]
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else out.args
    for i, (v, strides) in enumerate(zip(values, got)):
        val = v.meta.get("val") if isinstance(v, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or strides is None:
            continue
        for d, (want, have) in enumerate(zip(val.stride(), strides)):
            if val.shape[d] == 1:
                continue
            if sympy.simplify(sympy.sympify(str(_expr(want))) - sympy.sympify(str(have))) != 0:
                raise NotImplementedError(f"output {i} would have stride {have} in dim {d} where eager's is {want}")
