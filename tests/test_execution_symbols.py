"""Executors map each claimed symbol to the symbol generated code calls. Symbols made per call (an opaque
``while_loop``, a fallback op) come and go; a new one must never get the execution symbol of one that died, which
an address reused by CPython would give a map keyed by ``id`` (seen: ``x.cfloat()`` ran an earlier test's
``while_loop`` body)."""

import gc

import torch

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, OpTags, Symbol
from fulmen.executors import OpMapExecutor
from fulmen.executors.torchex import ex as torch_executor


def _bound(sym: Symbol) -> BoundSymbol:
    x = TensorProxy(name="x", shape=(2,), dtype=torch.float32, device="cpu")
    return BoundSymbol(sym, (x,), {}, TensorProxy(name="y", like=x))


def _sym(i: int, impl) -> Symbol:
    return Symbol(name=f"op{i}", meta=lambda a: a, id=f"test_execution_symbols.op{i}", is_prim=True,
                  tags=(OpTags.FALLBACK,), torch_impl=impl)


def test_the_torch_executor_never_hands_a_new_symbol_a_dead_one_s_implementation():
    for i in range(300):
        impl = torch.sin if i % 2 else torch.cos
        sym = _sym(i, impl)
        assert torch_executor.execution_symbol(_bound(sym)).impl is impl
        del sym
        gc.collect(1)  # the young generations hold the symbol just made: enough to free it, and cheap


def test_an_op_map_executor_never_hands_a_new_symbol_a_dead_one_s_implementation():
    executor = OpMapExecutor("test_execution_symbols", {"test_execution_symbols.op": ("op", None, torch.sin)})
    for i in range(300):
        sym = Symbol(name="op", meta=lambda a: a, id="test_execution_symbols.op", is_prim=True, tags=(),
                     torch_impl=torch.sin if i % 2 else torch.cos)
        assert executor.execution_symbol(_bound(sym)).meta is sym.meta
        del sym
        gc.collect(1)  # the young generations hold the symbol just made: enough to free it, and cheap
