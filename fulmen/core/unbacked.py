"""Data-dependent sizes: unbacked ``torch.SymInt`` symbols for the shapes of ``nonzero``, ``masked_select``,
``unique``, boolean-mask indexing and the like.

The size of such an op's result is known only when it runs. While tracing it is an *unbacked* symbol of the
trace's ``ShapeEnv`` (PyTorch's own mechanism, ``ShapeEnv.create_unbacked_symint``), printed ``u0``; generated
code binds it from the result's shape right after the op (``u0 = t3.shape[0]``), and the ops after it compute
with it as with any symbolic size. A call whose data give another size reuses the same program: nothing about an
unbacked size is checked by the cache, so nothing a meta concludes about it may become a guard. A meta that needs
to decide a question about an unbacked size (is it 1?) raises ``DataDependentError`` naming the user's line.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from fulmen.core import symbolic
from fulmen.core.tracectx import current


def _new_shape_env():
    from fulmen.core.utils import compiler_import_lock

    with compiler_import_lock:  # a ShapeEnv imports parts of Dynamo, as the background compiler does
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        return ShapeEnv(duck_shape=False)


def shape_env_of(x: Any):
    """The ShapeEnv of the first symbolic size among the proxies (or SymInts) in a nested value, or None."""
    from fulmen.core.proxies import TensorProxy

    for leaf in torch.utils._pytree.tree_leaves(x):
        for s in leaf.shape if isinstance(leaf, TensorProxy) else (leaf,):
            if isinstance(s, symbolic.SYMBOLIC_TYPES):
                return s.node.shape_env
    return None


def trace_shape_env():
    """The ShapeEnv of the trace being built: the one its dynamic input sizes come from, or a new one made for its
    data-dependent sizes (a trace of exact sizes has none until an op needs one)."""
    trace = current.trace
    if trace is None:
        raise RuntimeError("a data-dependent size can only be created while fulmen traces a program")
    env = trace.shape_env
    if env is None:
        env = shape_env_of(trace.args)
        if env is None:
            env = _new_shape_env()
        trace.shape_env = env
        symbolic.in_use = True  # codegen binds the symbols from now on
    return env


def is_unbacked_symbol(sym) -> bool:
    """Whether a sympy symbol is an unbacked (data-dependent) size: PyTorch names them ``u0``, ``u1``, ..."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return bool(free_unbacked_symbols(sym))


def has_unbacked(x: Any) -> bool:
    """Whether a (nested) value holds a size or number that depends on an unbacked symbol, in a proxy's shape or
    in the value itself."""
    from fulmen.core.proxies import TensorProxy

    if not symbolic.in_use:
        return False
    for leaf in torch.utils._pytree.tree_leaves(x):
        for s in leaf.shape if isinstance(leaf, TensorProxy) else (leaf,):
            if isinstance(s, symbolic.SYMBOLIC_TYPES) and symbolic.is_symbolic(s) and any(
                    is_unbacked_symbol(f) for f in symbolic.expr_of(s).free_symbols):
                return True
    return False


def _guard_error_type():
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return GuardOnDataDependentSymNode


GuardOnDataDependentSymNode = _guard_error_type()


def data_dependent_guard(what: str | None, error: Exception) -> Exception:
    """The error for a meta that had to decide something about a data-dependent size (``u0 == 1``), naming the
    user's line: the innermost frame of ``error``'s traceback outside fulmen and torch, else the caller's."""
    from fulmen.core.proxies import DataDependentError, _user_location, is_library_file

    where = None
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if not is_library_file(code.co_filename):
            import linecache

            line = linecache.getline(code.co_filename, tb.tb_lineno).strip()
            where = f'File "{code.co_filename}", line {tb.tb_lineno}' + (f": {line}" if line else "")
        tb = tb.tb_next
    question = str(error).split("\n")[0].removeprefix("Could not guard on data-dependent expression ")
    return DataDependentError(
        f"{what or 'an operation'} needs to decide a question about a size that depends on tensor values "
        f"({question}), which is not known while fulmen traces the program.\n  at {where or _user_location()}\n"
        "Sizes from nonzero, masked_select, boolean-mask indexing or unique are known only when the program runs. "
        "Combine such a result only with tensors of the same data-dependent size or with sizes it does not need "
        "to compare, move this part out of the compiled function, or use torch.compile(model, backend=\"fulmen\").")


def known_equal(a: Any, b: Any) -> bool:
    """``a == b`` for sizes, where a data-dependent size counts as different unless it is equal for every value
    (PyTorch's ``guard_or_false``): for a choice between a special case and the general path, which is right for
    every value."""
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import guard_or_false

        return guard_or_false(a == b)
    return a == b


def size_carriers(bsyms, available, candidates) -> list:
    """Values among ``candidates`` to hand to code running ``bsyms`` so that it can bind the symbolic sizes it uses:
    one for each symbol that no ``available`` value carries bare in its shape (a backward that expands a gradient
    to the shape of ``nonzero``'s result, ``(u0, 5)``, when no saved tensor has that size)."""
    if not symbolic.in_use:
        return []
    needed: set = set()
    for b in bsyms:
        symbolic.free_symbols((b.args, b.kwargs), needed)
    if not needed:
        return []
    carried = {symbolic.bare_symbol(d) for p in available for d in getattr(p, "shape", ())}
    missing = needed - carried
    out = []
    for p in candidates:
        for d in getattr(p, "shape", ()):
            sym = symbolic.bare_symbol(d)
            if sym is not None and sym in missing:
                missing.discard(sym)
                out.append(p)
    return out


_positions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def mask_positions(mask, compute):
    """``compute(mask)`` (the positions of a mask's set elements, one tensor per dim), whose length is the same
    data-dependent size for every read of one mask value in the trace being built: ``y[m] = x[m]`` reads the mask
    twice, and both sides must have the same length to match. Each read computes the positions itself (a read may
    be claimed whole by an executor, which hides what its decomposition computed from the next one)."""
    out = compute(mask)
    memo = _positions.setdefault(current.trace, {})
    seen = memo.get(id(mask))
    if seen is not None and seen[0] is mask:
        torch._check(out[0].shape[0] == seen[1])  # the ShapeEnv replaces the new symbol by the first one
    else:
        memo[id(mask)] = (mask, out[0].shape[0])
    return out


def same_shape(a, b) -> bool:
    """``tuple(a) == tuple(b)`` for shapes, false where it depends on the data (as ``known_equal``)."""
    try:
        return tuple(a) == tuple(b)
    except GuardOnDataDependentSymNode:
        return len(a) == len(b) and all(known_equal(x, y) for x, y in zip(a, b))


_ERRORS = {"IndexError": IndexError, "RuntimeError": RuntimeError, "ValueError": ValueError}


def _check_sizes(cond: bool, message: str, error: str) -> None:
    if not cond:
        raise _ERRORS[error](message)


def _check_sizes_meta(cond, message, error):
    return None


def _make_check_symbol():
    from fulmen.core.symbol import OpTags, Symbol

    sym = Symbol(name="check_sizes", meta=_check_sizes_meta, id="fulmen.check_sizes", is_prim=True, module="fulmen",
                 tags=(OpTags.SIDE_EFFECT, OpTags.DONT_DCE, OpTags.NON_DIFFERENTIABLE), torch_impl=_check_sizes,
                 skip_meta_check=True)
    return sym


check_sizes = _make_check_symbol()


def expect(cond: Any, message, error: type[Exception] = RuntimeError) -> None:
    """``check(cond, message, error)`` for a condition on sizes: decided now where the sizes decide it (a guard for
    dynamic ones), and where it depends on a data-dependent size, checked when the program runs
    (``fulmen.check_sizes(0 < u0, ...)`` in the trace) and assumed true while tracing goes on, as eager would
    have raised otherwise."""
    try:
        ok = bool(cond)
    except GuardOnDataDependentSymNode:
        trace = current.trace
        trace.scopes[-1].append(check_sizes.bind(cond, message(), error.__name__, output=None))
        torch._check(cond)  # the ShapeEnv takes it as known from here on (0 < u0 makes u0 == 0 false)
        return
    if not ok:
        raise error(message())


def shapes_agree(recorded, rerun) -> bool:
    """Whether a meta run again (``check_trace``) agrees with the shape it recorded: a data-dependent size is a new
    symbol on every run, so such a pair only needs to be data-dependent on both sides."""
    if len(recorded) != len(rerun):
        return False
    for a, b in zip(recorded, rerun):
        if has_unbacked(a) or has_unbacked(b):
            if not (has_unbacked(a) and has_unbacked(b)):
                return False
        elif a != b:
            return False
    return True
