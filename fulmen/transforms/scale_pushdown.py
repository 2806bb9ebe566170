"""Moving a multiplication by a scalar tensor past the matrix products that read its result.

A loss averaged over its rows hands the backward a cotangent divided by the row count, and the backward of a
language model's head multiplies the whole (N, V) gradient of the logits by it before two matrix products::

    t681 = ltorch.mul(t671, t679)               # (256, 4096) * () -> a fresh (256, 4096) buffer
    t636 = prims.matmul(t682, W)                # t682 = reshape(t681): (2, 128, 4096) @ (4096, 256)
    t640 = prims.matmul(t638, t639)             # t638 = transpose(reshape(t681)): (4096, 256) @ (256, 256)

A matrix product is linear in each operand, so the scalar can multiply the smaller of the product's other
operand and its result instead::

    t636 = ltorch.mul(prims.matmul(t682, W), t679)       # scales (2, 128, 256)
    t640 = prims.matmul(t638, ltorch.mul(t639, t679))    # scales (256, 256)

(the reshapes now read ``t671``). That removes the (N, V) pass and its fresh buffer, whose pages the multiply
spent most of its time faulting in; with that buffer gone the forward's cross-entropy kernel no longer faults in
its own output either (figures: docs/performance.md, "Backward rewrites").

``push_scale_past_matmuls`` rewrites a ``mul(a, s)`` (``s`` a 0-d tensor) when every reader of its result is a
chain of reshapes and transposes ending in a matrix product that reads it once, the result is not returned,
and each product gets a smaller multiply than the one removed. Only float32 and float64: the product of the
unscaled operand is larger by the reciprocal of the scalar, which a half type's range may not hold. The
result differs from the original order by rounding only (a relative 1e-7 in float32).
"""

from __future__ import annotations

import torch

import fulmen.torch as ltorch
from fulmen import prims
from fulmen.core.codeutils import outputs_of
from fulmen.core.proxies import Proxy, TensorProxy
from fulmen.core.symbol import BoundSymbol
from fulmen.core.trace import Trace, tracectx

_SHAPE_ONLY = {prims.reshape.id, prims.transpose.id}
_DTYPES = (torch.float32, torch.float64)


def _numel(p: TensorProxy) -> int | None:
    """``p``'s element count, or None when a size is symbolic."""
    return p.numel() if all(isinstance(d, int) for d in p.shape) else None


def _scalar_product(b: BoundSymbol) -> tuple[TensorProxy, TensorProxy] | None:
    """``(a, s)`` when ``b`` is ``mul(a, s)`` of a float32/float64 tensor ``a`` and a 0-d tensor ``s`` of the same
    dtype and device, whose result has ``a``'s shape; else None."""
    if b.sym.id != ltorch.mul.id or b.kwargs or len(b.args) != 2:
        return None
    out = b.output
    for a, s in (b.args, b.args[::-1]):
        if (isinstance(a, TensorProxy) and isinstance(s, TensorProxy) and isinstance(out, TensorProxy)
                and s.ndim == 0 and a.ndim >= 1 and a.dtype in _DTYPES and s.dtype == a.dtype == out.dtype
                and str(s.device) == str(a.device) == str(out.device)
                and tuple(a.shape) == tuple(out.shape) and _numel(a) is not None):
            return a, s
    return None


def _matmul_readers(root: str, readers: dict[str, list[BoundSymbol]], returned: set[str]
                    ) -> list[tuple[BoundSymbol, int]] | None:
    """The matrix products reached from ``root`` through reshapes and transposes, with the position of the operand
    that derives from ``root``; None when anything else reads ``root`` or one of those views, a view is returned,
    or a product reads the scaled value in both operands."""
    found: list[tuple[BoundSymbol, int]] = []
    pending, seen = [root], set()
    while pending:
        name = pending.pop()
        if name in returned or name in seen:
            return None
        seen.add(name)
        for b in readers.get(name, ()):
            if b.sym.id in _SHAPE_ONLY and b.args and getattr(b.args[0], "name", None) == name:
                pending.extend(p.name for p in b.flat_proxy_outs)
            elif b.sym.id == prims.matmul.id and not b.kwargs and len(b.args) == 2:
                found.append((b, next(i for i, x in enumerate(b.args) if getattr(x, "name", None) == name)))
            else:
                return None
    if any(sum(getattr(x, "name", None) in seen for x in b.args) != 1 for b, _ in found):
        return None
    return found


def push_scale_past_matmuls(trace: Trace) -> Trace:
    """The rewrite described in the module docstring, applied to every candidate of ``trace``'s top level."""
    bsyms = trace.bound_symbols
    candidates = [(b, found) for b in bsyms if (found := _scalar_product(b)) is not None]
    if not candidates:
        return trace
    readers: dict[str, list[BoundSymbol]] = {}
    for b in bsyms:
        for p in dict.fromkeys(x.name for x in b.flat_args):
            readers.setdefault(p, []).append(b)
    returned = {p.name for p in outputs_of(trace.output)}

    dropped: set[int] = set()
    scaled: dict[int, tuple[int, TensorProxy]] = {}  # matmul bsym id -> (operand position, scalar)
    swap: dict[str, Proxy] = {}  # the removed products' names -> their inputs
    for b, (a, s) in candidates:
        products = _matmul_readers(b.output.name, readers, returned)
        if not products or any(id(m) in scaled for m, _ in products):
            continue
        removed = a.numel()
        sizes = [(_numel(m.args[1 - i]), _numel(m.output)) for m, i in products]
        if any(o is None or r is None or min(o, r) >= removed for o, r in sizes):
            continue
        dropped.add(id(b))
        swap[b.output.name] = a
        for m, i in products:
            scaled[id(m)] = (i, s)
    if not dropped:
        return trace

    new: list[BoundSymbol] = []
    with tracectx(trace):
        for b in bsyms:
            if id(b) in dropped:
                continue
            reads = b.from_bsym_swap_proxies(swap, skip_output=True) if any(
                p.name in swap for p in b.flat_args) else b
            plan = scaled.get(id(b))
            new.extend(_scaled_product(trace, reads, *plan) if plan else (reads,))
    return trace.derive("Scalar factors moved past matrix products", new)


def _scaled_product(trace: Trace, b: BoundSymbol, i: int, s: TensorProxy) -> list[BoundSymbol]:
    """``b`` (a matrix product whose operand ``i`` lost its factor ``s``) with ``s`` multiplying its other operand
    or its result, whichever is smaller; the last symbol returned produces ``b``'s output proxy."""
    x, y = b.args[i], b.args[1 - i]
    scope: list[BoundSymbol] = []
    trace.scopes.append(scope)
    try:
        if _numel(y) <= _numel(b.output):
            args = [x, x]
            args[1 - i] = ltorch.mul(y, s)
            out = prims.matmul(*args)
        else:
            out = ltorch.mul(prims.matmul(*b.args), s)
    finally:
        trace.scopes.pop()
    scope[-1] = scope[-1].from_bsym_swap_proxies({out.name: b.output})
    return scope
