"""From a linearized program to forward and backward traces.

``split_forward_backward`` (training): the forward trace returns the program's outputs and the tensors the
backward needs; the backward trace takes ``(saved_for_backward, cotangents)`` -- two lists it empties, so
each saved tensor is freed right after its last use -- and returns one gradient per input (``None`` for
inputs that do not require grad). What is saved is chosen by ``remat.choose_saved``.

Inputs the program updates in place (``prims.copy_`` writes their new value back at the end of the forward)
hold the new value by the time the backward runs: one the backward needs, or a view of one, is saved as a
copy taken before the write (``ForwardBackward.snapshots``). One that requires grad is also an output
(``ForwardBackward.dirty``): the autograd function returns the caller's tensor there, marked dirty, so that
autograd moves its history onto the function as it does for an eager in-place op.

``differentiate_inline`` (``fulmen.grad`` and friends): forward and backward recorded into the current trace.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.utils._pytree import tree_flatten

import fulmen.torch as ltorch
from fulmen.core.codeutils import outputs_of
from fulmen.core.proxies import Proxy, TensorProxy, latest
from fulmen.core.symbol import BoundSymbol, Symbol
from fulmen.core.trace import Trace, get_tracectx, tracectx
from fulmen.core.unbacked import size_carriers
from fulmen.prims import PrimIDs
from fulmen.torch.linalg import matmul_folds_a_copy
from fulmen.transforms import remat
from fulmen.transforms.autodiff import backward_pass, flat_tensor_args
from fulmen.transforms.checkpoint_regions import checkpoint_choices, replay_random_draws
from fulmen.transforms.linearize import Joint, Node, is_differentiable_dtype, linearize, zeros_like
from fulmen.transforms.passes import MAY_ALIAS, overwritten_inputs


def emit_forward(nodes: Sequence[Node], must_compute: set[str]) -> list[BoundSymbol]:
    """Each node whole, unless a value only its parts compute must be computed (then its parts, recursively)."""
    out: list[BoundSymbol] = []

    def emit(node: Node) -> None:
        if node.parts is None or not (node.internal() & must_compute):
            out.append(node.bsym)
        else:
            for part in node.parts:
                emit(part)

    for node in nodes:
        emit(node)
    return out


def forward_values_read(bsyms: Sequence[BoundSymbol], defined: set[str], also_read: Sequence[str] = ()) -> list[str]:
    """Names ``bsyms`` (and then ``also_read``) read that neither they nor ``defined`` define, in order."""
    defined = set(defined)
    read: dict[str, None] = {}
    for b in bsyms:
        for p in b.flat_args:
            if p.name not in defined:
                read.setdefault(p.name)
        defined.update(p.name for p in b.flat_proxy_outs)
    for name in also_read:
        if name not in defined:
            read.setdefault(name)
    return list(read)


def prune(bsyms: Sequence[BoundSymbol], wanted: Sequence[str]) -> list[BoundSymbol]:
    """Dead-code elimination of a backward body: keep what the returned gradients need."""
    needed = set(wanted)
    kept: list[BoundSymbol] = []
    for b in reversed(bsyms):
        if any(p.name in needed for p in b.flat_proxy_outs):
            kept.append(b)
            needed.update(p.name for p in b.flat_args)
    kept.reverse()
    return kept


def _size_carriers(body: Sequence[BoundSymbol], cts: Sequence[TensorProxy], needed: Sequence[str],
                   inputs: Sequence[Proxy], leaves: Sequence[BoundSymbol]) -> list[str]:
    """Names of forward values to save only for their shapes: the backward binds from them the data-dependent sizes
    (``fulmen.core.unbacked``) it uses and no tensor it reads carries."""
    values = {p.name: p for p in inputs}
    values.update((p.name, p) for b in leaves for p in b.flat_proxy_outs)
    available = [*cts, *(values[n] for n in needed if n in values)]
    return [p.name for p in size_carriers(body, available, values.values()) if p.name not in needed]


def _leaves(nodes: Sequence[Node]) -> list[BoundSymbol]:
    return [b for n in nodes for b in n.leaves()]


# ---------------------------------------------------------------------------------------------------------
# helper symbols of the backward trace

def _unpack_and_clear(seq: list) -> tuple:
    values = tuple(seq)
    seq.clear()  # the caller's list no longer keeps the tensors alive: `del` frees each after its last use
    return values


def _make_unpack() -> Symbol:
    from fulmen.executors.torchex import ex as torch_ex

    sym = Symbol(name="unpack_and_clear", meta=lambda seq: None, id="autodiff.unpack_and_clear", is_prim=True,
                 impl=_unpack_and_clear, executor=torch_ex, skip_meta_check=True)
    return sym


UNPACK = _make_unpack()


# ---------------------------------------------------------------------------------------------------------
# training: forward trace + backward traces

@dataclass
class ForwardBackward:
    """The result of ``split_forward_backward``; ``backward_trace(mask)`` builds backward traces on demand."""

    forward: Trace
    outputs: list[TensorProxy]  # unique tensor outputs, in the order the forward returns them
    differentiable: list[int]  # indices into outputs of those that take a cotangent
    saved: list[Proxy]
    joint: Joint
    context: Trace
    input_requires_grad: list[bool]
    producers: dict[str, BoundSymbol] = field(default_factory=dict)
    backward_traces: dict[tuple, Trace] = field(default_factory=dict)
    # saved values the forward overwrites (inputs, views of them): {name: the copy the forward returns instead}
    snapshots: dict[str, TensorProxy] = field(default_factory=dict)
    # (input index, output index): an input that requires grad and is updated in place, and its new value
    dirty: list[tuple[int, int]] = field(default_factory=list)
    # (output index, input index): a differentiable output that may share memory with an input that requires grad
    views: list[tuple[int, int]] = field(default_factory=list)
    # inputs that require grad but that no gradient reaches: passed detached, so that autograd adds no edge to their
    # history (which may be freed already; eager never visits it either)
    unreached: list[int] = field(default_factory=list)
    # eager's error for a backward that needs a value an in-place op overwrote after an op saved it, and the outputs
    # (positions in differentiable) whose backward goes through that op: None when there is none
    modified_saved: tuple[str, frozenset[int]] | None = None

    def backward_trace(self, present: tuple[bool, ...] | None = None) -> Trace:
        """The backward for cotangents given only for ``present`` differentiable outputs (all by default)."""
        present = present if present is not None else (True,) * len(self.differentiable)
        trace = self.backward_traces.get(present)
        if trace is None:
            trace = self.backward_traces[present] = _backward_trace(self, present)
        return trace


def _emit_backward(fb: ForwardBackward, present: tuple[bool, ...]) -> tuple[Trace, list, list, list, list[str]]:
    """The backward walk into a new trace: (trace, body, cotangents, input gradients, forward values read)."""
    bw = Trace("backward", parent=fb.context)
    bw.args = [Proxy(bw.add_name("saved_for_backward")), Proxy(bw.add_name("cotangents"))]
    outs = [fb.outputs[i] for i, p in zip(fb.differentiable, present) if p]
    body: list[BoundSymbol] = []
    with tracectx(bw):
        cts = [TensorProxy(like=o, prefix="ct", requires_grad=False) for o in outs]
        bw.scopes.append(body)
        try:
            reached = backward_pass(fb.joint, {o.name: c for o, c in zip(outs, cts)})
        finally:
            bw.scopes.pop()
    grads = [reached.get(x.name) if rg else None for x, rg in zip(fb.forward.args, fb.input_requires_grad)]
    returned = [g.name for g in grads if g is not None]
    body = prune(body, returned)
    needed = forward_values_read(body, {c.name for c in cts}, also_read=returned)
    return bw, body, cts, grads, needed


def _finish_backward(fb: ForwardBackward, bw: Trace, body: list, cts: list, grads: list) -> Trace:
    """Unpack the saved tensors and cotangents, recompute what is not saved, return the gradients."""
    available = {p.name for p in fb.saved} | {c.name for c in cts}
    bsyms = remat.with_recompute(body, available, fb.producers,
                                 also_read=[g.name for g in grads if g is not None])
    saved_arg, cts_arg = bw.args
    bw.bound_symbols = [UNPACK.bind(saved_arg, output=tuple(fb.saved)), UNPACK.bind(cts_arg, output=tuple(cts)),
                        *bsyms]
    bw.scopes = [bw.bound_symbols]
    bw.output = tuple(grads)
    bw.provenance = "Backward (split from the joint trace)"
    return bw


def _backward_trace(fb: ForwardBackward, present: tuple[bool, ...]) -> Trace:
    bw, body, cts, grads, _ = _emit_backward(fb, present)
    return _finish_backward(fb, bw, body, cts, grads)


def _dirty_outputs(trace: Trace, requires: list[bool], written: dict[str, TensorProxy],
                   outputs: list[TensorProxy]) -> list[tuple[int, int]]:
    """Adds the new values of the inputs that require grad and are updated in place to ``outputs``; returns
    (input index, output index) for each."""
    dirty: list[tuple[int, int]] = []
    index = {p.name: i for i, p in enumerate(outputs)}
    taken: set[int] = set()
    kept = _history_kept(trace)
    for j, (a, rg) in enumerate(zip(trace.args, requires)):
        new = written.get(a.name) if rg else None
        if new is None or _kept_from(kept, new.name) == a.name:
            continue
        k = index.setdefault(new.name, len(outputs))
        if k == len(outputs):
            outputs.append(new)
        if k in taken:
            raise NotImplementedError(
                f"fulmen: two inputs that require grad are updated in place to the same value ({new.name}); "
                "autograd cannot give both tensors that history. Clone the value written into one of them.")
        taken.add(k)
        dirty.append((j, k))
    return dirty


def _history_kept(trace: Trace) -> dict[str, str]:
    """``{new value: old value}`` for writes autograd does not see (under ``torch.no_grad()``): as in eager, an input
    written only so keeps its autograd history (a leaf stays a leaf), so it is not an output marked dirty."""
    return {b.output.name: b.args[1].name for b in trace.bound_symbols
            if b.sym.id == "ltorch.overwritten" and b.args[2] and isinstance(b.args[1], TensorProxy)}


def _kept_from(kept: dict[str, str], name: str) -> str:
    """The value a chain of history-keeping writes (several updates under no_grad) started from."""
    while name in kept:
        name = kept[name]
    return name


def _modified_saved_value(trace: Trace, joint: Joint, executors: Sequence, context: Trace,
                          outputs: list[TensorProxy], differentiable: list[int]) -> tuple[str, frozenset[int]] | None:
    """Eager's error when an op's backward needs a value that a later in-place op overwrote (``y = x.sin();
    x.add_(1)``): eager saved the tensor, its version changed, and the backward refuses it. Functionally the old
    value is still at hand, but the program must fail where eager fails. The in-place op's own computation of the
    new value from the tensor it updates is exempt: eager's in-place kernels save what they need of it."""
    bsyms = trace.bound_symbols
    producer = {p.name: i for i, b in enumerate(bsyms) for p in b.flat_proxy_outs}
    readers: dict[str, list[int]] = {}
    for i, b in enumerate(bsyms):
        for p in b.flat_args:
            readers.setdefault(p.name, []).append(i)
    found = None
    for old, new, position, start in trace.overwritten:
        earlier = [i for i in readers.get(old.name, ()) if i < position]
        if not earlier:
            continue
        if start is not None:  # the user's in-place call: its reads of the tensor it updates as self are exempt
            own = {i for i in earlier if i >= start and not _reads_beyond_first(bsyms[i], old.name)}
        else:  # an update made inside an op (inplace=True): everything the new value is computed from is exempt
            own, stack = set(), [new.name]
            while stack:
                i = producer.get(stack.pop())
                if i is not None and i >= earlier[0] and i not in own:
                    own.add(i)
                    stack.extend(p.name for p in bsyms[i].flat_args)
        for i in earlier:
            b = bsyms[i]
            if i in own or b.no_grad or not any(p.name in joint.active for p in b.flat_proxy_outs):
                continue
            if (not _views_of(b, old) and not _saved_as_a_copy(b, old)
                    and old.name in _read_by_backward(b, joint.active, executors, context)):
                reached = {p.name for p in b.flat_proxy_outs}
                for later in bsyms[i + 1:]:
                    if any(p.name in reached for p in later.flat_args):
                        reached.update(p.name for p in later.flat_proxy_outs)
                through = frozenset(k for k, j in enumerate(differentiable) if outputs[j].name in reached)
                message = found[0] if found is not None else (
                    f"one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: {old.name} ({old.type_string()}), saved by {b.sym.qualified_name} to compute its "
                    "gradient, was overwritten in place afterwards (as in eager, a backward through it fails). "
                    "Clone the tensor before the in-place operation, or update a copy.")
                found = (message, through | (found[1] if found is not None else frozenset()))
    return found


def _views_of(bsym: BoundSymbol, base: TensorProxy) -> bool:
    """Whether every tensor ``bsym`` returns is a view of ``base``, its first argument (``torch.atleast_3d``, an
    ``hsplit`` piece, ``as_strided``). A view's backward reads its base's geometry, never its values (autograd
    saves no tensor for it), so a later write into the base leaves eager's backward through the view working,
    although an opaque view's backward here recomputes the view from the base."""
    first = bsym.args[0] if bsym.args else None
    outs = [p for p in bsym.flat_proxy_outs if isinstance(p, TensorProxy)]
    return (isinstance(first, TensorProxy) and first.name == base.name and bool(outs)
            and all(p.view_of is not None and p.view_of[0].name == base.name for p in outs))


def _saved_as_a_copy(bsym: BoundSymbol, old: TensorProxy) -> bool:
    """Whether eager's ``bsym`` saves a copy of ``old`` rather than ``old`` itself (a matmul folding a transposed
    batch: ``ltorch.matmul_folds_a_copy``), so that overwriting ``old`` later leaves its backward working."""
    if bsym.sym.id != ltorch.matmul.id:
        return False
    copied = matmul_folds_a_copy(*bsym.args[:2])
    return copied is not None and copied.name == old.name


def _reads_beyond_first(bsym: BoundSymbol, name: str) -> bool:
    """Whether ``bsym`` reads the value ``name`` other than as its first argument (``y.mul_(y)``'s other operand)."""
    rest = tree_flatten((bsym.args[1:], bsym.kwargs))[0]
    return any(isinstance(p, Proxy) and p.name == name for p in rest)


def _read_by_backward(bsym: BoundSymbol, active: set[str], executors: Sequence, context: Trace) -> list[str]:
    """The forward values the backward of ``bsym`` alone reads (worked out in a scratch trace, then dropped)."""
    scratch = Trace("saved_check", parent=context)
    body: list[BoundSymbol] = []
    with tracectx(scratch):
        joint = linearize([bsym], set(active), executors)
        outs = [p for p in bsym.flat_proxy_outs if p.name in joint.active]
        cts = {p.name: TensorProxy(like=p, prefix="ct", requires_grad=False) for p in outs}
        scratch.scopes.append(body)
        try:
            reached = backward_pass(joint, cts)
        finally:
            scratch.scopes.pop()
    grads = [g.name for name, g in reached.items() if name in active and name not in cts]
    return forward_values_read(prune(body, grads), set(cts), also_read=grads)


def _alias_roots(leaves: Sequence[BoundSymbol], names: Iterable[str]) -> dict[str, str]:
    """``{value: the one of names it may share memory with}`` for ``names`` and the views of them: an executor may
    return ``x[0]`` as a view of ``x``, so a write into ``x`` changes it too."""
    roots = {n: n for n in names}
    for b in leaves:
        if not MAY_ALIAS.isdisjoint(b.sym.tags):
            root = next((roots[p.name] for p in b.flat_args if p.name in roots), None)
            if root is not None:
                roots.update((p.name, root) for p in b.flat_proxy_outs)
    return roots


def _view_outputs(fb: ForwardBackward, leaves: Sequence[BoundSymbol]) -> list[tuple[int, int]]:
    """(output index, input index) of the differentiable outputs that may be views of inputs that require grad."""
    index = {a.name: j for j, (a, rg) in enumerate(zip(fb.forward.args, fb.input_requires_grad)) if rg}
    roots = _alias_roots(leaves, index)
    dirty = {k for _, k in fb.dirty}
    return [(k, index[roots[fb.outputs[k].name]]) for k in fb.differentiable
            if fb.outputs[k].name in roots and fb.outputs[k].name not in index and k not in dirty]


def _snapshot(trc: Trace, inputs: Sequence[TensorProxy]) -> tuple[dict[str, TensorProxy], list[BoundSymbol]]:
    """Copies of ``inputs`` (``{name: copy}``) named in ``trc``, and the symbols computing them."""
    scope: list[BoundSymbol] = []
    with tracectx(trc):
        trc.scopes.append(scope)
        try:
            copies = {p.name: ltorch.clone(p) for p in inputs}
        finally:
            trc.scopes.pop()
    return copies, scope


def _returned_free(fb: ForwardBackward, leaves: Sequence[BoundSymbol], written: Sequence[str]) -> list[str]:
    """The outputs the caller holds that saving costs nothing: not a dirty output (that is an input) and not one
    that may share memory with an input the forward overwrites (saving it takes a snapshot copy)."""
    dirty = {k for _, k in fb.dirty}
    stale = _alias_roots(leaves, written) if written else {}
    return [o.name for i, o in enumerate(fb.outputs) if i not in dirty and o.name not in stale]


def split_forward_backward(trace: Trace, executors: Sequence, *, recompute: bool = True) -> ForwardBackward | None:
    """Differentiate ``trace`` with respect to its inputs that require grad; ``None`` when no output depends on
    them and no input that requires grad is updated in place (then the program needs no backward)."""
    context = Trace("joint", parent=trace)
    requires = [isinstance(a, TensorProxy) and a.requires_grad and is_differentiable_dtype(a.dtype)
                for a in trace.args]
    active = {a.name for a, rg in zip(trace.args, requires) if rg}
    with tracectx(context):
        joint = linearize(trace.bound_symbols, active, executors)
    outputs = list({p.name: p for p in outputs_of(trace.output) if isinstance(p, TensorProxy)}.values())
    written = overwritten_inputs(trace)
    dirty = _dirty_outputs(trace, requires, written, outputs) if written else []
    differentiable = [i for i, o in enumerate(outputs) if o.name in joint.active]
    if not differentiable and not dirty:
        return None
    fb = ForwardBackward(forward=trace, outputs=outputs, differentiable=differentiable, saved=[], joint=joint,
                         context=context, input_requires_grad=requires, dirty=dirty)
    if trace.overwritten:
        fb.modified_saved = _modified_saved_value(trace, joint, executors, context, outputs, differentiable)
    checkpointed, kept = checkpoint_choices(joint.nodes, trace.checkpoint_regions, outputs)
    # before the backward trace copies the joint's names: the replays name the generator states they read
    replays = replay_random_draws(joint.nodes, checkpointed, context) if checkpointed else {}
    everything = (True,) * len(differentiable)
    bw, body, cts, grads, needed = _emit_backward(fb, everything)  # the full backward decides what is saved
    leaves = _leaves(joint.nodes)
    needed += _size_carriers(body, cts, needed, trace.args, leaves)
    exact = remat.bit_exact_reads(body)
    remat_leaves = [replays.get(id(b), b) for b in _leaves(joint.nodes)] if replays else leaves
    choose = functools.partial(remat.choose_saved, remat_leaves, trace.args, recompute=recompute,
                               overwritten=written, exact=exact, checkpointed=checkpointed, kept=kept,
                               returned=_returned_free(fb, leaves, written))
    fb.saved, producers = choose(needed)
    # a value needed only for a symbol its shape carried may have been chosen for recomputation: then the backward
    # binds that symbol from another (a symbolic int's carrier, fulmen.frontend.dynamic)
    lost = _size_carriers(body, cts, [p.name for p in fb.saved], trace.args, leaves)
    if lost:
        fb.saved, producers = choose(needed + lost)
    fb.producers = remat.coarsen(joint.nodes, [p.name for p in fb.saved], producers, exact)
    fb.views = _view_outputs(fb, leaves)
    bsyms = emit_forward(joint.nodes, {p.name for p in fb.saved})
    if written:  # the backward must read these values as they were before the forward wrote into them
        stale = _alias_roots(leaves, written)
        fb.snapshots, copies = _snapshot(bw, [p for p in fb.saved if p.name in stale])
        first = next(i for i, b in enumerate(bsyms) if b.sym.id is PrimIDs.COPY_)
        bsyms[first:first] = copies
    forward = trace.derive("Forward (split from the joint trace)", bsyms)
    forward.output = (*outputs, *[fb.snapshots.get(p.name, p) for p in fb.saved])
    forward.names.update(bw.names)
    fb.forward = forward
    fb.backward_traces[everything] = _finish_backward(fb, bw, body, cts, grads)
    dirty_inputs = {i for i, _ in dirty}
    fb.unreached = [i for i, (rg, g) in enumerate(zip(requires, grads)) if rg and g is None and i not in dirty_inputs]
    return fb


# ---------------------------------------------------------------------------------------------------------
# fulmen.grad / value_and_grad / vjp: forward and backward recorded into the current trace

def _resolve(x):
    if isinstance(x, TensorProxy):
        return latest(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_resolve(v) for v in x)
    if isinstance(x, dict):
        return {k: _resolve(v) for k, v in x.items()}
    return x


def differentiate_inline(fn: Callable, args: tuple, kwargs: dict, executors: Sequence,
                         cotangents: Any = None) -> tuple[Any, list]:
    """Trace ``fn(*args, **kwargs)`` into the current trace followed by its backward.

    The output cotangents are ones (the gradient of the sum of the outputs) unless ``cotangents`` gives one per
    floating point tensor output. Returns ``(output, gradients)``, one gradient per tensor argument.
    """
    trc = get_tracectx()
    inputs = flat_tensor_args(args, kwargs)
    scope: list[BoundSymbol] = []
    trc.scopes.append(scope)
    try:
        out = _resolve(fn(*args, **kwargs))
    finally:
        trc.scopes.pop()
    active = {x.name for x in inputs if is_differentiable_dtype(x.dtype)}
    # In-place updates were resolved while fn ran; the rules below must read the values they name, not the
    # latest values of mutated proxies.
    had_mutations, trc.has_mutations = trc.has_mutations, False
    try:
        return _differentiate(trc, scope, out, inputs, active, executors, cotangents)
    finally:
        trc.has_mutations = had_mutations


def _differentiate(trc: Trace, scope: list, out: Any, inputs: list, active: set, executors: Sequence,
                   cotangents: Any) -> tuple[Any, list]:
    from fulmen.transforms.autodiff import fit_gradient, seed_cotangent

    joint = linearize(scope, active, executors)
    float_outs = [p for p in outputs_of(out) if isinstance(p, TensorProxy) and is_differentiable_dtype(p.dtype)]
    body: list[BoundSymbol] = []
    trc.scopes.append(body)
    try:
        seeds: dict[str, TensorProxy] = {}
        if cotangents is None:
            counts: dict[str, int] = {}
            for p in float_outs:
                counts[p.name] = counts.get(p.name, 0) + 1
            for p in {p.name: p for p in float_outs}.values():
                if p.name in joint.active:
                    seeds[p.name] = seed_cotangent(p, float(counts[p.name]))
        else:
            given = tree_flatten(cotangents)[0]
            if len(given) != len(float_outs):
                raise ValueError(f"vjp: expected {len(float_outs)} cotangents (one per floating point tensor "
                                 f"output), got {len(given)}")
            for p, c in zip(float_outs, given):
                if c is not None and p.name in joint.active:
                    c = fit_gradient(c, p)
                    seeds[p.name] = c if p.name not in seeds else ltorch.add(seeds[p.name], c)
        reached = backward_pass(joint, seeds)
        grads = []
        for x in inputs:
            if not is_differentiable_dtype(x.dtype):
                grads.append(None)
            else:
                grads.append(reached.get(x.name) if x.name in reached else zeros_like(x))
    finally:
        trc.scopes.pop()
    seed_names = {c.name for c in seeds.values()}
    body = prune(body, [g.name for g in grads if g is not None])
    needed = forward_values_read(body, seed_names, also_read=[g.name for g in grads if g is not None])
    exact = remat.bit_exact_reads(body)
    saved, producers = remat.choose_saved(_leaves(joint.nodes), inputs, needed, exact=exact)
    producers = remat.coarsen(joint.nodes, [p.name for p in saved], producers, exact)
    # the forward computes what is saved: the needed values not recomputed, and what the recomputation reads
    forward = emit_forward(joint.nodes, {p.name for p in saved})
    defined = {x.name for x in inputs} | {p.name for b in forward for p in b.flat_proxy_outs} | seed_names
    trc.scopes[-1].extend(forward + remat.with_recompute(body, defined, producers,
                                                         also_read=[g.name for g in grads if g is not None],
                                                         strict=False))
    return out, grads
