"""Executors: who runs each operation of a trace.

``base`` holds the classes, the registry and ``claim_symbols``; ``torchex`` the torch executor (always last).
This package also keeps the seeds' older way of making an executor from a table, ``add_operator_executor``,
the name ``TORCH`` for the torch executor, and ``checked_implementation``, the one-time check that an
executor's implementation returns what the operation's meta promised.

    from fulmen.executors import add_operator_executor
    add_operator_executor("numpy_add", {PrimIDs.ADD: ("add_numpy", checker, impl)}, add_to_default_executors=False)
    cfun = fulmen.compile(fun, executors_list=["numpy_add", fulmen.executors.TORCH])
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fulmen.core import meta_corrections
from fulmen.core.codegen import META_EPOCH
from fulmen.core.codeutils import outputs_of
from fulmen.core.devices import to_device
from fulmen.core.dtypes import short_name
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, Symbol
from fulmen.core.trace import Trace, tracectx
from fulmen.executors.base import (
    ExecutorError,
    ImplInfo,
    OperatorExecutor,
    add_default_executor,
    register_executor,
)

__all__ = ["add_operator_executor", "checked_implementation", "MetaMismatch", "TORCH"]


# ---- the one-time output check ----

def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        dims = ", ".join(str(s) for s in x.shape)
        return f"{to_device(x.device)} {short_name(x.dtype)}[{dims}]"
    return f"{type(x).__name__} ({x!r})" if not isinstance(x, (tuple, list)) else f"a {type(x).__name__} of {len(x)}"


def _mismatches(expected: Any, actual: Any, where: str = "output") -> list[str]:
    """Where ``actual`` (real values) disagrees with ``expected`` (what the meta computed from proxies)."""
    if isinstance(expected, TensorProxy):
        if not isinstance(actual, torch.Tensor):
            return [f"{where} is {_describe(actual)}, but the meta promises a tensor {expected.type_string()}"]
        got = (tuple(actual.shape), actual.dtype, to_device(actual.device).type)
        if got != (tuple(expected.shape), expected.dtype, expected.device.type):
            return [f"{where} is {_describe(actual)}, but the meta promises {expected.type_string()}"]
        return []
    if isinstance(expected, (tuple, list)) and outputs_of(expected):
        if not isinstance(actual, (tuple, list)) or len(actual) != len(expected):
            return [f"{where} is {_describe(actual)}, but the meta promises a {type(expected).__name__} of "
                    f"{len(expected)}"]
        found: list[str] = []
        for i, (e, a) in enumerate(zip(expected, actual)):
            found += _mismatches(e, a, f"{where}[{i}]")
        return found
    return []  # numbers and None: the meta's value is not a promise about the implementation's


def _expected_outputs(meta: Callable, args: tuple, kwargs: dict) -> Any:
    """Run ``meta`` on proxies standing for the real arguments."""
    scratch = Trace("output_check")

    def proxy(x):
        if isinstance(x, torch.Tensor):
            return TensorProxy(like=x)
        if type(x) in (tuple, list):
            return type(x)(proxy(v) for v in x)
        return x

    with tracectx(scratch):
        return meta(*proxy(args), **{k: proxy(v) for k, v in kwargs.items()})


class MetaMismatch(ExecutorError):
    """An implementation returned tensors of other shapes, dtypes or devices than its symbol's meta declared. The
    metadata it returned is recorded (``fulmen.core.meta_corrections``); the jitted function that ran the program
    traces and compiles again (``fulmen.frontend.jit``) and runs the call on the new program."""


def checked_implementation(fn: Callable, *, executor: str, symbol: str, meta: Callable | None,
                           corrects: str | None = None) -> Callable:
    """``fn`` wrapped so that its first call in each compiled program is checked.

    The first call runs ``fn``, turns an exception into an ``ExecutorError`` naming ``executor`` and
    ``symbol``, and compares each returned tensor's shape, dtype and device type with what ``meta``
    computes for the same arguments. Once a call passed, the wrapper replaces itself by ``fn`` in the
    generated program's globals, so later calls of that program call ``fn`` directly (no per-call cost).
    Called from anywhere else, it checks once and then only forwards.

    ``corrects``: the name of the traced symbol ``fn`` runs (``symbol`` names the implementation), given for a prim
    an executor or a user declared, whose meta may be what is wrong. Where that meta and the returned tensors differ
    only in metadata, the check warns, records what ``fn`` returned for the symbol and raises ``MetaMismatch``: the
    jitted function compiles again with that metadata and repeats the call. Without it (a symbol of fulmen's own
    languages, whose meta is torch's semantics) a disagreement is the implementation's error.
    """
    done_elsewhere = False

    def first_call_check(*args, **kwargs):
        nonlocal done_elsewhere
        if done_elsewhere:
            return fn(*args, **kwargs)
        try:
            out = fn(*args, **kwargs)
        except Exception as e:
            raise ExecutorError(f"the implementation of {symbol} in executor {executor!r} raised "
                                f"{type(e).__name__}: {e}") from e
        if meta is not None:
            try:
                expected = _expected_outputs(meta, args, kwargs)
            except Exception as e:
                raise ExecutorError(f"the meta of {symbol} (executor {executor!r}) rejects the arguments its "
                                    f"implementation was called with: {type(e).__name__}: {e}") from e
            if corrects is not None:
                traced_at = sys._getframe(1).f_globals.get(META_EPOCH)
                if traced_at is not None and meta_corrections.recorded_after(meta, args, kwargs, traced_at):
                    # traced before the correction (another program found it): its later operations expect the
                    # declared metadata, so it compiles again too
                    _replace_in_caller(first_call_check, _stale(MetaMismatch(f"{symbol}: traced before")))
                    raise MetaMismatch(f"the program calling {symbol} was traced with the metadata its meta declares, "
                                       "which its implementation does not return")
                expected = meta_corrections.corrected(meta, args, kwargs, expected)
            problems = _mismatches(expected, out)
            if problems and corrects is None:
                raise ExecutorError(f"the implementation of {symbol} in executor {executor!r} disagrees with its "
                                    "meta: " + "; ".join(problems))
            if problems:
                error = _corrected(meta, corrects, symbol, executor, args, kwargs, expected, out, problems)
                _replace_in_caller(first_call_check, _stale(error))  # its program never runs this call again
                raise error
        if not _replace_in_caller(first_call_check, fn):
            done_elsewhere = True
        return out

    first_call_check.__wrapped__ = fn
    first_call_check.__name__ = getattr(fn, "__name__", symbol)
    first_call_check.__qualname__ = first_call_check.__name__
    return first_call_check


def _replace_in_caller(check: Callable, by: Callable) -> bool:
    """Replace ``check`` by ``by`` in the generated program that called it; False when called from elsewhere."""
    caller = sys._getframe(2)
    if not caller.f_code.co_filename.startswith("<fulmen"):
        return False
    names = caller.f_globals
    for name, value in list(names.items()):
        if value is check:
            names[name] = by
    return True


def _stale(error: MetaMismatch) -> Callable:
    def traced_with_other_metadata(*args, **kwargs):
        raise MetaMismatch(str(error))

    return traced_with_other_metadata


def _own_meta(sym: Symbol) -> bool:
    """Whether ``sym``'s meta is its author's claim about an implementation (a prim a user or an executor
    declared), which the implementation's outputs may correct; a symbol of fulmen's languages means torch's
    semantics, and a composite's outputs are those of its decomposition."""
    return sym.is_prim and sym.module not in ("prims", "ltorch")


def _tensors_in_same_places(expected: Any, actual: Any) -> bool:
    """Whether ``actual`` has a tensor exactly where the meta's ``expected`` has one (their metadata may differ)."""
    if isinstance(expected, TensorProxy):
        return isinstance(actual, torch.Tensor)
    if isinstance(expected, (tuple, list)) and outputs_of(expected):
        return isinstance(actual, (tuple, list)) and len(actual) == len(expected) and all(
            map(_tensors_in_same_places, expected, actual))
    return not meta_corrections.tensor_metas(actual)


def _corrected(meta: Callable, traced: str, symbol: str, executor: str, args: tuple, kwargs: dict,
               expected: Any, out: Any, problems: list[str]) -> MetaMismatch:
    """Record what the implementation returned, warn, and return the error that has the call compiled again;
    raise an ``ExecutorError`` where no tracing can match it (other outputs, or other metadata again)."""
    disagreement = f"the implementation of {symbol} in executor {executor!r} disagrees with its meta: " + \
        "; ".join(problems)
    signature = meta_corrections.signature(args, kwargs)
    if not _tensors_in_same_places(expected, out) or signature in meta_corrections.corrections.get(meta, {}):
        raise ExecutorError(disagreement)  # already corrected once: the implementation is not consistent
    meta_corrections.record(meta, args, kwargs, out)
    warnings.warn(f"{disagreement}. fulmen compiles {traced!r} again with the metadata the implementation "
                  "returned and repeats the call; make the meta return it to compile once.", stacklevel=4)
    return MetaMismatch(disagreement)


# ---- executors from an op map (the seeds' older form) ----

class OpMapExecutor(OperatorExecutor):
    """An executor built from ``{symbol_id: (name, checker, implementation)}``.

    It claims a symbol in its table when the checker accepts the call; ``claim_symbols`` also gives it a
    composite symbol whose whole decomposition it can run (seed 002: ``ltorch.add`` runs as ``add_numpy``).
    """

    def __init__(self, name: str, op_map: Mapping[Any, tuple[str, Callable | None, Callable]]):
        super().__init__(name, version="op_map")
        self._ops: dict[Any, tuple[str, Callable]] = {}
        for sym_id, entry in op_map.items():
            if isinstance(sym_id, Symbol):
                sym_id = sym_id.id
            if not (isinstance(entry, tuple) and len(entry) == 3):
                raise TypeError(f"add_operator_executor({name!r}): the op_map entry for {sym_id!r} must be a tuple "
                                f"(name, checker, implementation), but got {entry!r}")
            impl_name, checker, fn = entry
            if not isinstance(impl_name, str) or not impl_name.isidentifier():
                raise ValueError(f"add_operator_executor({name!r}): the name for {sym_id!r} must be a Python "
                                 f"identifier (it is printed in execution traces), but got {impl_name!r}")
            if checker is not None and not callable(checker):
                raise TypeError(f"add_operator_executor({name!r}): the checker for {sym_id!r} is not callable")
            if not callable(fn):
                raise TypeError(f"add_operator_executor({name!r}): the implementation for {sym_id!r} is not callable")
            self._ops[sym_id] = (impl_name, fn)
            # the symbol here is a stand-in: the one generated code calls is made per claimed symbol, below
            self.implmap[sym_id] = ImplInfo(symbol=Symbol(name=impl_name, impl=fn, executor=self), checker=checker)

    def implements(self, sym_or_id) -> bool:
        return (sym_or_id.id if isinstance(sym_or_id, Symbol) else sym_or_id) in self._ops

    def can_execute(self, bsym: BoundSymbol) -> bool:
        return bsym.sym.id in self._ops and super().can_execute(bsym)

    def execution_symbol(self, bsym: BoundSymbol) -> Symbol:
        sym = bsym.sym
        cached = sym.execution_symbols.get(self)
        if cached is None:
            impl_name, fn = self._ops[sym.id]
            impl = checked_implementation(fn, executor=self.name, symbol=impl_name, meta=sym.meta,
                                          corrects=sym.name if _own_meta(sym) else None)
            cached = Symbol(name=impl_name, id=f"{self.name}:{impl_name}", meta=sym.meta, is_prim=True, impl=impl,
                            executor=self, tags=sym.tags)
            sym.execution_symbols[self] = cached
        return cached


def add_operator_executor(name: str, op_map: Mapping[Any, tuple[str, Callable | None, Callable]], *,
                          add_to_default_executors: bool = True) -> OperatorExecutor:
    """Register an executor named ``name`` from ``op_map = {symbol_id: (name, checker, implementation)}``.

    ``checker(*args, **kwargs) -> bool`` sees the operation's proxies and says whether this executor takes
    the call; ``implementation`` gets real tensors and returns real tensors; ``name`` is what execution
    traces print. With ``add_to_default_executors`` it also goes first in the default executor list.
    Returns the executor (the seeds ignore it and use the name).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"add_operator_executor expects a non-empty executor name, but got {name!r}")
    if not isinstance(op_map, Mapping) or not op_map:
        raise TypeError(f"add_operator_executor({name!r}) expects a non-empty dict op_map, but got {op_map!r}")
    ex = OpMapExecutor(name, op_map)
    register_executor(ex)
    if add_to_default_executors:
        add_default_executor(ex)
    return ex


def __getattr__(name: str):
    # The torch executor is looked up on first use so that importing the executor base stays cycle-free.
    if name == "TORCH":
        from fulmen.executors.torchex import ex

        return ex
    raise AttributeError(f"module 'fulmen.executors' has no attribute {name!r}")
