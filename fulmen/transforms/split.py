"""From a linearized program to forward and backward traces.

``split_forward_backward`` (training): the forward trace returns the program's outputs and the tensors the
backward needs; the backward trace takes ``(saved_for_backward, cotangents)`` -- two lists it empties, so
each saved tensor is freed right after its last use -- and returns one gradient per input (``None`` for
inputs that do not require grad). What is saved is chosen by ``remat.choose_saved``.

``differentiate_inline`` (``fulmen.grad`` and friends): forward and backward recorded into the current trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.utils._pytree import tree_flatten

import fulmen.torch as ltorch
from fulmen.core.codeutils import outputs_of
from fulmen.core.proxies import Proxy, TensorProxy, latest
from fulmen.core.symbol import BoundSymbol, Symbol
from fulmen.core.trace import Trace, get_tracectx, tracectx
from fulmen.transforms import remat
from fulmen.transforms.autodiff import backward_pass, flat_tensor_args
from fulmen.transforms.linearize import Joint, Node, is_differentiable_dtype, linearize, zeros_like


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
                 impl=_unpack_and_clear, executor=torch_ex)
    sym.extra["skip_meta_check"] = True
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


def split_forward_backward(trace: Trace, executors: Sequence, *, recompute: bool = True) -> ForwardBackward | None:
    """Differentiate ``trace`` with respect to its inputs that require grad; ``None`` when no output depends on
    them (then the program needs no backward)."""
    context = Trace("joint", parent=trace)
    requires = [isinstance(a, TensorProxy) and a.requires_grad and is_differentiable_dtype(a.dtype)
                for a in trace.args]
    active = {a.name for a, rg in zip(trace.args, requires) if rg}
    with tracectx(context):
        joint = linearize(trace.bound_symbols, active, executors)
    outputs = list({p.name: p for p in outputs_of(trace.output) if isinstance(p, TensorProxy)}.values())
    differentiable = [i for i, o in enumerate(outputs) if o.name in joint.active]
    if not differentiable:
        return None
    fb = ForwardBackward(forward=trace, outputs=outputs, differentiable=differentiable, saved=[], joint=joint,
                         context=context, input_requires_grad=requires)
    everything = (True,) * len(differentiable)
    bw, body, cts, grads, needed = _emit_backward(fb, everything)  # the full backward decides what is saved
    fb.saved, producers = remat.choose_saved(_leaves(joint.nodes), trace.args, needed, recompute=recompute)
    fb.producers = remat.coarsen(joint.nodes, [p.name for p in fb.saved], producers)
    forward = trace.derive("Forward (split from the joint trace)",
                           emit_forward(joint.nodes, {p.name for p in fb.saved}))
    forward.output = (*outputs, *fb.saved)
    forward.names.update(bw.names)
    fb.forward = forward
    fb.backward_traces[everything] = _finish_backward(fb, bw, body, cts, grads)
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
    saved, producers = remat.choose_saved(_leaves(joint.nodes), inputs, needed)
    producers = remat.coarsen(joint.nodes, [p.name for p in saved], producers)
    # the forward computes what is saved: the needed values not recomputed, and what the recomputation reads
    forward = emit_forward(joint.nodes, {p.name for p in saved})
    defined = {x.name for x in inputs} | {p.name for b in forward for p in b.flat_proxy_outs} | seed_names
    trc.scopes[-1].extend(forward + remat.with_recompute(body, defined, producers,
                                                         also_read=[g.name for g in grads if g is not None],
                                                         strict=False))
    return out, grads
