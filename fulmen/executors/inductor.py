"""The inductor executor: fuse regions of a trace with PyTorch's Inductor and call the generated code directly.

``fusion_pass`` reorders the execution trace so that the operations Inductor handles well run back to back
(``partition.fusion_groups``: a topological order, so no region can close a cycle) and makes each maximal run
one region. Each region becomes one ``FusedRegion`` callable in the execution trace. A region starts out
running its operations one by one with the torch executor; its Inductor kernel compiles in the background (or
right away in ``compile_mode`` ``"sync"``) and swaps in when ready, so no call waits for a compiler
(``inductor_compile``). Inductor's output code is specialized to its inputs' shapes and strides, so a region
keeps one compiled variant per input layout it sees; once sizes vary between calls (a growing key/value cache),
it compiles one kernel with those sizes symbolic and runs every layout that kernel fits on it
(``inductor_dynamic``). Regions with the same code share their kernels. An operation whose arguments hold a symbolic
size or int (``arange(n)``, ``x[:, :n]``) joins a region when an input of the trace has that symbol as a dimension
(the int's carrier, a cache): the region takes that input too, its code reads the symbol from the input's size, and
the kernel with varying sizes symbolic serves every value; operations using a symbol no input carries run outside.

Random operations stay outside regions (so results draw from torch's generator exactly as in eager), and
so do side effects and opaque ops; a composite that can draw (attention with dropout) is fused where its call
draws nothing.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import __version__ as torch_version

from fulmen.core import symbolic
from fulmen.core.ambient import Ambient
from fulmen.core.bookkeeping import is_bookkeeping
from fulmen.core.codegen import compile_trace
from fulmen.core.codeutils import outputs_of
from fulmen.core.draws import draws
from fulmen.core.proxies import Proxy, TensorProxy
from fulmen.core.symbol import BoundSymbol, OpTags, Symbol
from fulmen.core.symbolic import SYMBOLIC_TYPES, bare_symbol, free_symbols
from fulmen.core.trace import Trace
from fulmen.core.unbacked import has_unbacked
from fulmen.core.utils import IdentityRef
from fulmen.executors.base import FusionExecutor, claim_symbols, get_always_executors, register_executor
from fulmen.executors.inductor_compile import (  # noqa: F401  (re-exported: the public helpers live here)
    COMPILE_MODES,
    Kernel,
    compile_mode,
    get_kernel,
    kernel_stats,
    pending_compilations,
    resume,
    wait_for_compilations,
)
from fulmen.executors.inductor_dynamic import layout_key, symbolic_layout, varying_dims
from fulmen.executors.partition import (
    fusion_groups,
    operations_key,
    split_repeats,
    sums_after_other_readers,
)
from fulmen.transforms.grad_ops import unfold_backward
from fulmen.transforms.passes import checks_values, del_last_used

_NOT_FUSED = (OpTags.SIDE_EFFECT, OpTags.FALLBACK, OpTags.COMMUNICATION)
#: Compiled variants one region keeps (one per input layout it has seen); beyond that it runs unfused.
MAX_VARIANTS = 8
#: Layouts remembered as fitting the region's kernel with symbolic sizes (each new one is checked once).
MAX_FITTED_LAYOUTS = 256
#: How many times one region builds the C++ check of its steady layout (``FusedRegion._steady``).
MAX_FAST_BUILDS = 4
#: Operations (by id) Inductor (torch 2.13) computes wrongly inside a fused graph: ``unfold_backward`` fed by other
#: fused operations (max_pool2d's backward) gave gradients off by 2.0 where alone it is exact.
_NOT_FUSED_IDS = frozenset({unfold_backward.id})
MIN_REGION_SIZE = 2
#: The smallest piece left over next to a model's repeated layers that still gets its own region.
MIN_LEFTOVER = 8


class FusedRegion:
    """One fused region: runs with the torch executor until its Inductor kernel for the current input layout
    (shapes and strides; dtypes and devices are fixed by the trace) is ready."""

    def __init__(self, name: str, eager: Callable, source: str, code_key: tuple):
        self.name = name
        self.eager = eager
        self.source = source
        self.code_key = code_key
        self.mode = compile_mode.get()
        # the default dtype and device the region was traced under: its kernels compile under them
        self.ambient = Ambient.capture()
        if self.mode not in COMPILE_MODES:
            raise ValueError(f"compile mode {self.mode!r} is not one of {', '.join(COMPILE_MODES)}")
        self.kernels: dict[tuple, Kernel] = {}
        self.variants: dict[tuple, Callable] = {}  # layout -> compiled callable, the fast path
        self.last_key: tuple | None = None  # the layout of the last kernel compiled for one layout
        self.dynamic: Kernel | None = None  # the kernel whose varying sizes are symbols, once sizes varied
        # (C++ check, callable) of the layout the region runs call after call (see ``_steady``)
        self.fast: tuple[Any, Callable] | None = None
        # (C++ check, a layout key, the inputs whose sizes vary) once the kernel with symbolic sizes runs: builds
        # the layout key of a call whose other inputs that check finds unchanged (see ``_key``)
        self.growing: tuple[Any, list, tuple[int, ...]] | None = None
        self._last_hit: tuple | None = None
        self._fast_builds = 0
        self._growing_builds = 0

    def __call__(self, *args):
        fast = self.fast  # one read: another thread may replace it
        if fast is not None and fast[0].check(*args):
            return fast[1](list(args))
        key = self._key(args)
        fn = self.variants.get(key)
        if fn is not None:
            steady, self._last_hit = key == self._last_hit, key
            if steady:
                self._steady(args, fn)
            return fn(list(args))
        self._last_hit = key
        return self._slow_call(key, args)

    def _key(self, args: tuple) -> tuple:
        """``layout_key(args)``, the same tuple, built from the last one for the inputs whose sizes do not vary
        where one C++ check finds them unchanged. A decode step's cache inputs grow by one position every call, so
        neither the steady check nor a layout seen before finds the kernel, and the key of every input was built
        and hashed on each call; with this, only the growing inputs' shapes and strides are read."""
        growing = self.growing  # one read: another thread may replace it
        if growing is None or not growing[0].check(*args):
            return layout_key(args)
        _, last, varying = growing
        key = list(last)
        for i in varying:
            a = args[i]
            key[i] = (a.shape, a.stride())
        return tuple(key)

    def _grow(self, args: tuple, key: tuple) -> None:
        """Build ``growing`` from a call whose layout ``key`` the kernel with symbolic sizes fits: one ``TensorGuards``
        comparing every input but the varying ones (any size, any stride) with this call's exactly (type,
        dispatch keys, dtype, device, requires_grad, sizes, strides), so that a call it accepts has their layout
        as in ``key``. Built at most ``MAX_FAST_BUILDS`` times (again when the other inputs' layout changes)."""
        if self._growing_builds >= MAX_FAST_BUILDS:
            return
        self._growing_builds += 1
        varying = tuple(sorted({i for i, _ in self.dynamic.dims}))
        try:
            from torch._C._dynamo.guards import TensorGuards

            guard = TensorGuards(
                *args,
                dynamic_dims_sizes=[[None] * a.dim() if i in varying else list(a.shape) for i, a in enumerate(args)],
                dynamic_dims_strides=[
                    [None] * a.dim() if i in varying else list(a.stride()) for i, a in enumerate(args)
                ],
            )
            ok = guard.check(*args)
        except Exception:  # no such check in this torch, or an input it does not take (it compares dense tensors)
            self._growing_builds = MAX_FAST_BUILDS
            return
        self.growing = (guard, list(key), varying) if ok else None

    def _steady(self, args: tuple, fn: Callable) -> None:
        """The same layout found twice in a row: from now on one C++ check (PyTorch's ``TensorGuards``, Dynamo's
        tensor check) of every input's exact type, dispatch keys, dtype, device, ``requires_grad``, sizes and
        strides finds its callable, instead of a Python tuple of every input's shape and stride hashed into
        ``variants``. It accepts a subset of the layouts the key lookup accepts, and on any difference the lookup
        decides. A region whose layouts alternate never gets one; one whose steady layout changes rebuilds it at
        most ``MAX_FAST_BUILDS`` times."""
        if self._fast_builds >= MAX_FAST_BUILDS:
            return
        self._fast_builds += 1
        try:
            from torch._C._dynamo.guards import TensorGuards

            guard = TensorGuards(
                *args,
                dynamic_dims_sizes=[list(a.shape) for a in args],
                dynamic_dims_strides=[list(a.stride()) for a in args],
            )
            ok = guard.check(*args)
        except Exception:  # no such check in this torch, or an input it does not take (it compares dense tensors)
            self._fast_builds = MAX_FAST_BUILDS
            return
        self.fast = (guard, fn) if ok else None

    def forget_fast(self) -> None:
        """Drop the C++-checked callable (``fulmen.report`` swaps ``variants``' callables for timed ones): the next
        steady layout builds it again from ``variants``."""
        self.fast, self._last_hit, self._fast_builds = None, None, 0
        self.growing, self._growing_builds = None, 0

    def _slow_call(self, key: tuple, args: tuple):
        kernel = self.kernels.get(key)
        if kernel is None:
            if self.kernels:
                fn = self._symbolic_call(key, args)
                if fn is not None:
                    return fn(list(args))
                if self.dynamic is not None and not self.dynamic.done:
                    return self.eager(*args)  # sizes vary: no kernel for this one layout while that compiles
            if len(self.kernels) >= MAX_VARIANTS:
                return self.eager(*args)
            layout = tuple((a.shape, a.stride(), a.dtype, a.device) for a in args)
            kernel = self.kernels[key] = get_kernel(
                (self.code_key, layout, self.ambient.key()), self.name, self.eager, args, self.mode, self.ambient
            )
            self.last_key = key
        elif kernel.parked is not None:
            resume(kernel)
        if kernel.fn is not None:
            self.variants[key] = kernel.fn
            return kernel.fn(list(args))
        return self.eager(*args)

    def _symbolic_call(self, key: tuple, args: tuple) -> Callable | None:
        """The kernel compiled with the varying sizes symbolic, for a layout it fits; the first layout whose sizes
        differ from the last one compiled for starts its compilation (``inductor_dynamic``)."""
        kernel = self.dynamic
        if kernel is None:
            dims = varying_dims(self.last_key, key)
            if not dims:
                return None
            layout = symbolic_layout(self.last_key, key, dims, args)
            kernel = self.dynamic = get_kernel(
                (self.code_key, ("symbolic", dims, layout), self.ambient.key()),
                self.name,
                self.eager,
                args,
                self.mode,
                self.ambient,
                dims,
            )
        elif kernel.parked is not None:
            resume(kernel)
        if kernel.fn is None or not kernel.check.fits_layout(key):
            return None
        if len(self.variants) < MAX_FITTED_LAYOUTS:
            self.variants[key] = kernel.fn
        growing = self.growing
        if growing is None or not growing[0].check(*args):  # none yet, or the other inputs' layout changed
            self._grow(args, key)
        return kernel.fn

    @property
    def failed(self) -> bool:
        return any(k.failed for k in self.kernels.values())


def _same_device_conversion(bsym: BoundSymbol) -> bool:
    """A conversion (``.to``, ``.float()``, ``type_as``) that stays on one device: a dtype cast Inductor fuses like
    any elementwise op, or nothing at all (``x.float()`` of a float32 ``x``). Copies to another device stay
    outside regions."""
    tensors = [p for p in (*bsym.flat_args, *bsym.flat_proxy_outs) if isinstance(p, TensorProxy)]
    return len({str(p.device) for p in tensors}) == 1


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _code_key(fn: Callable, source: str, names: set[str]) -> tuple:
    """The region's code up to the names of its values, and the objects it calls: two regions with equal keys
    compute the same function of their inputs."""
    mapping: dict[str, str] = {}

    def rename(m: re.Match) -> str:
        word = m.group(0)
        if word not in names:
            return word
        return mapping.setdefault(word, f"_v{len(mapping)}")

    lines = []
    for line in source.splitlines():
        code = line.split("#", 1)[0].rstrip()
        if code and not code.startswith(("def ", "import ")):
            lines.append(_NAME.sub(rename, code))
    used = fn.__code__.co_names
    objects = tuple(sorted((k, IdentityRef(v)) for k, v in fn.__globals__.items() if k in used))
    return ("\n".join(lines), objects)


def _unread_checks(trace: Trace, outputs: set[str]) -> set[int]:
    """The operations kept only because they may raise on values (an unused index out of bounds): inside a region
    Inductor would drop them, since nothing reads their results, so they run unfused."""
    read = set(outputs)
    for b in trace.bound_symbols:
        if not is_bookkeeping(b):
            read.update(p.name for p in b.flat_args)
    return {
        id(b)
        for b in trace.bound_symbols
        if not is_bookkeeping(b) and not any(p.name in read for p in b.flat_proxy_outs) and checks_values(b)
    }


_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


class _Symbolic(Exception):
    pass


def _structure_key(region: list[BoundSymbol], inputs: list[Proxy], outputs: list[Proxy]) -> tuple | None:
    """The region up to the names of its values: symbols, constants (objects other than plain values by
    identity), tensor metadata and the data flow between operations. Two regions of one trace with equal keys
    generate the same code, so the second reuses the first's unfused callable (a model's identical layers);
    ``None`` for a region with symbolic sizes."""
    index = {p.name: i for i, p in enumerate(inputs)}

    def canon(x):
        if isinstance(x, Proxy):
            i = index.setdefault(x.name, len(index))
            if isinstance(x, TensorProxy):
                if any(type(d) is not int for d in x.shape):
                    raise _Symbolic
                return (i, tuple(x.shape), x.dtype, str(x.device), x.requires_grad)
            return (i, type(x).__name__)
        if isinstance(x, (tuple, list)) and not hasattr(x, "_fields"):
            return (type(x).__name__, *(canon(v) for v in x))
        if isinstance(x, dict):
            return ("dict", *((k, canon(v)) for k, v in x.items()))
        if isinstance(x, float):
            return ("float", repr(x))  # repr tells -0.0 from 0.0, which compare equal
        if isinstance(x, _PLAIN):
            return (type(x).__name__, x)
        if isinstance(x, SYMBOLIC_TYPES):
            raise _Symbolic
        return ("object", id(x))

    try:
        parts = [tuple(canon(p) for p in inputs)]
        for b in region:
            parts.append((id(b.sym), b.no_grad, canon(b.args), canon(b.kwargs), canon(b.output)))
    except _Symbolic:
        return None
    parts.append(tuple(index[p.name] for p in outputs))
    return tuple(parts)


def _symbol_carriers(args: Sequence) -> dict:
    """sympy symbol -> the first of the trace's inputs ``args`` that has it, bare, as a dimension."""
    out: dict = {}
    for p in args:
        shape = getattr(p, "shape", None)
        if isinstance(p, TensorProxy) and type(shape) is torch.Size:
            for d in shape:
                sym = bare_symbol(d)
                if sym is not None:
                    out.setdefault(sym, p)
    return out


def _with_carriers(region: list[BoundSymbol], inputs: list[Proxy], carriers: dict) -> list[Proxy]:
    """The region's inputs and, after them, an input of the trace for each symbol its operations' arguments use
    (``arange(s0)``, ``view(t, s0, 4)``) that no input has as a dimension: its code binds the symbol from it."""
    needed: set = set()
    for b in region:
        free_symbols((b.args, b.kwargs), needed)
    if not needed:
        return inputs
    names = {p.name for p in inputs}
    for p in inputs:
        for d in getattr(p, "shape", ()):
            needed.discard(bare_symbol(d))
    extra = []
    for sym in sorted(needed, key=str):
        p = carriers[sym]
        if p.name not in names:
            names.add(p.name)
            extra.append(p)
    return [*inputs, *extra]


def _region_io(
    region: list[BoundSymbol], later: list[BoundSymbol], trace_outputs: set[str], also: frozenset[str] = frozenset()
):
    """The region's inputs, and its outputs: what it defines that ``later`` operations or the trace return read,
    plus the names in ``also``, in the order the region defines them."""
    defined: dict[str, Proxy] = {}
    inputs: dict[str, Proxy] = {}
    for bsym in region:
        for p in bsym.flat_args:
            if p.name not in defined and p.name not in inputs:
                inputs[p.name] = p
        for p in bsym.flat_proxy_outs:
            defined[p.name] = p
    used_later = {p.name for b in later for p in b.flat_args} | trace_outputs | also
    outputs = [p for name, p in defined.items() if name in used_later]
    return list(inputs.values()), outputs


def _common_outputs(
    pieces: list[list[BoundSymbol]], later: list[BoundSymbol], trace_outputs: set[str]
) -> list[frozenset[str]]:
    """For each of a run's pieces, the values it must return beyond what later operations read, so that pieces
    with the same operations (a model's layers, ``split_repeats``) return the same values and share one kernel.

    Layers compute alike but need not return alike: the last layer's residual sum is read by nothing after it where
    the others' is read by the next layer's backward (under autocast, the backward recomputes it from the saved
    bfloat16 projections of all layers but the last). Left so, the last layer has other code than the others and
    compiles on its own. Each piece here returns every value that any piece of its kind returns, at the same
    position: a tensor written and freed unread costs far less than compiling a layer again."""
    also = [frozenset()] * len(pieces)
    if len(pieces) < 2:
        return also
    kinds: dict[tuple, list[int]] = {}
    for i, piece in enumerate(pieces):
        kinds.setdefault(operations_key(piece), []).append(i)
    for members in kinds.values():
        if len(members) < 2:
            continue
        returned: set[tuple[int, int]] = set()  # (operation, output) positions some member returns
        for i in members:
            rest = [b for p in pieces[i + 1 :] for b in p] + later
            _, outs = _region_io(pieces[i], rest, trace_outputs)
            names = {p.name for p in outs}
            returned |= {pos for pos, name in _output_positions(pieces[i]) if name in names}
        for i in members:
            also[i] = frozenset(name for pos, name in _output_positions(pieces[i]) if pos in returned)
    return also


def _output_positions(piece: list[BoundSymbol]) -> list[tuple[tuple[int, int], str]]:
    return [((k, j), p.name) for k, b in enumerate(piece) for j, p in enumerate(b.flat_proxy_outs)]


class InductorExecutor(FusionExecutor):
    """Fuses regions of elementwise, reduction, shape and matmul operations with Inductor."""

    def __init__(self):
        super().__init__("inductor", version=torch_version)
        self._count = 0
        self.regions: weakref.WeakSet[FusedRegion] = weakref.WeakSet()  # for fusion_stats; traces own them

    def can_fuse(self, bsym: BoundSymbol, carried: frozenset | None = None) -> bool:
        """Whether ``bsym`` may join a region; ``carried``: the symbols of symbolic sizes and ints that an input of
        the trace has as a dimension, which a region can take that input to read (None while claiming, where the
        trace is not known: the fusion pass decides, and runs what it refuses on the torch executor)."""
        sym = bsym.sym
        if any(t in sym.tags for t in _NOT_FUSED) or sym.id in _NOT_FUSED_IDS:
            return False
        # a call that draws stays outside (its draws keep eager's order); a composite that merely can draw is fused
        # when this call's decomposition draws nothing (attention without dropout: Inductor calls the attention kernel)
        if draws(bsym):
            return False
        if OpTags.DEVICE_OP in sym.tags and not _same_device_conversion(bsym):
            return False
        # A size expression in the arguments (view(t, s0, 4), arange(s0)) needs its symbols' values in the region:
        # the region takes an input of the trace that has each as a dimension (``_fuse``), and its code reads them
        # from their sizes, as a symbolic-size kernel reads sizes. Symbols no input carries stay outside.
        if symbolic.in_use and carried is not None and not free_symbols((bsym.args, bsym.kwargs)) <= carried:
            return False
        # a data-dependent size changes from call to call with the data, and a region compiles once per concrete
        # shape: such values stay on the torch executor, which splits the fused regions there
        if symbolic.in_use and has_unbacked((bsym.flat_args, bsym.flat_proxy_outs)):
            return False
        if sym.executor is not None:
            return False  # an executor's own operation (register_operator, fulmen's runtime helpers) runs there
        if not (sym.is_prim and sym.torch_impl is not None) and not sym.torch_executable:
            return False
        return all(isinstance(p, TensorProxy) for p in bsym.flat_proxy_outs) and bool(bsym.flat_proxy_outs)

    def fusion_pass(self, trace: Trace) -> Trace:
        torch_executors = list(get_always_executors())
        outputs = {p.name for p in outputs_of(trace.output)}
        carriers = _symbol_carriers(self._available_first(trace)) if symbolic.in_use else {}
        carried = frozenset(carriers)
        unread = self._claimed_unfused(trace, outputs, carried)
        can_fuse = lambda b: id(b) not in unread and self.can_fuse(b, carried)  # noqa: E731
        groups = fusion_groups(trace.bound_symbols, can_fuse)
        shared: dict[tuple, tuple] = {}  # structure key -> (unfused callable, its source, code key)
        new: list[BoundSymbol] = []
        for k, (fused, run) in enumerate(groups):
            if not fused and unread and any(id(b) in unread for b in run):
                for b in run:  # claimed as fusible: the torch executor runs it now
                    new.extend(self._unfused(trace, [b], torch_executors) if id(b) in unread else [b])
            elif not fused:
                new.extend(run)
            elif sum(1 for b in run if not is_bookkeeping(b)) < MIN_REGION_SIZE:
                new.extend(self._unfused(trace, run, torch_executors))
            else:
                later = [b for _, r in groups[k + 1 :] for b in r]
                new.extend(b for b in run if is_bookkeeping(b))  # lines that compute nothing stay, ahead of it
                pieces = split_repeats([b for b in run if not is_bookkeeping(b)])
                # next to repeated layers, a short leftover piece (embedding, final norm) is not worth a
                # compilation of its own, which costs far more than it saves: it runs on the torch executor
                smallest = MIN_LEFTOVER if len(pieces) > 1 else MIN_REGION_SIZE
                also = _common_outputs(pieces, later, outputs)
                for i, piece in enumerate(pieces):
                    if len(piece) < smallest:
                        new.extend(self._unfused(trace, piece, torch_executors))
                    else:
                        rest = [b for p in pieces[i + 1 :] for b in p] + later
                        new.append(
                            self._fuse(
                                trace,
                                sums_after_other_readers(piece),
                                rest,
                                outputs,
                                torch_executors,
                                shared,
                                also[i],
                                carriers,
                            )
                        )
        return trace.derive(trace.provenance or "Fusion", new)

    def _available_first(self, trace: Trace) -> list:
        """The trace's inputs and what the unfused operations leading it define from them alone (a backward's saved
        values, unpacked): values defined before every region, as ``fusion_groups`` first runs all that is ready
        and not fusible."""
        out = list(trace.args)
        names = {p.name for p in out}
        for b in trace.bound_symbols:
            if self.can_fuse(b) or not all(p.name in names for p in b.flat_args):
                break
            out.extend(b.flat_proxy_outs)
            names.update(p.name for p in b.flat_proxy_outs)
        return out

    def _claimed_unfused(self, trace: Trace, outputs: set[str], carried: frozenset) -> set[int]:
        """The operations claimed as fusible that the torch executor runs: checks nothing reads (``_unread_checks``),
        and operations using a symbol that no input of the trace carries (``can_fuse``)."""
        unread = _unread_checks(trace, outputs)
        if symbolic.in_use:
            unread |= {
                id(b)
                for b in trace.bound_symbols
                if not is_bookkeeping(b) and self.can_fuse(b) and not self.can_fuse(b, carried)
            }
        return unread

    def _unfused(self, trace: Trace, region: list[BoundSymbol], executors) -> list[BoundSymbol]:
        sub = trace.derive("region", region)
        return claim_symbols(sub, executors).bound_symbols

    def _fuse(
        self,
        trace: Trace,
        region: list[BoundSymbol],
        later: list[BoundSymbol],
        trace_outputs: set[str],
        executors: Sequence,
        shared: dict[tuple, tuple],
        also: frozenset[str] = frozenset(),
        carriers: dict | None = None,
    ) -> BoundSymbol:
        inputs, outputs = _region_io(region, later, trace_outputs, also)
        if carriers:
            inputs = _with_carriers(region, inputs, carriers)
        name = f"inductor_fusion_{self._count}"
        self._count += 1
        structure = _structure_key(region, inputs, outputs)
        compiled = shared.get(structure) if structure is not None else None
        if compiled is None:
            sub = trace.derive("region", region)
            sub.fn_name = name
            sub.args = inputs
            sub.output = tuple(outputs)
            # the unfused path frees each intermediate after its last use, as the whole trace does
            claimed = del_last_used(claim_symbols(sub, executors))
            eager, source = compile_trace(claimed, comments=False)
            names = {p.name for b in region for p in (*b.flat_args, *b.flat_proxy_outs)}
            compiled = (eager, source, _code_key(eager, source, names))
            if structure is not None:
                shared[structure] = compiled
        fused = FusedRegion(name, *compiled)
        self.regions.add(fused)
        sym = Symbol(name=name, id=name, is_prim=True, is_fusion=True, impl=fused, executor=self)
        return BoundSymbol(sym, tuple(inputs), {}, tuple(outputs), tuple(region))


ex = InductorExecutor()
register_executor(ex)


def fusion_stats() -> dict[str, Any]:
    """How many regions exist, how many are compiled, and the compile time of the kernels they share."""
    regions = ex.regions
    return {
        "regions": len(regions),
        "compiled": sum(1 for r in regions if any(k.fn is not None for k in r.kernels.values())),
        "failed": sum(1 for r in regions if r.failed),
        **kernel_stats(),
    }
