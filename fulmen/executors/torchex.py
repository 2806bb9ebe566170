"""The torch executor: runs every prim, every opaque (fallback) op and most torch-language symbols.

It is always last in the executor list. A torch-language symbol declared with ``torch_executable`` runs
as one call of the torch callable it stands for (``ltorch.layer_norm`` -> ``F.layer_norm``); prims run
through the torch implementation declared with them.
"""

from __future__ import annotations

from types import SimpleNamespace

from fulmen.core.codegen import register_namespace
from fulmen.core.symbol import BoundSymbol, OpTags, Symbol
from fulmen.executors import checked_implementation
from fulmen.executors.base import OperatorExecutor, _always, register_executor
from fulmen.torch.registry import torch_id

#: What generated code calls prims' torch implementations through: ``torchex.broadcast_in_dim(...)``.
torchex_namespace = SimpleNamespace()
register_namespace("torchex", torchex_namespace)


class TorchExecutor(OperatorExecutor):
    def __init__(self):
        super().__init__("torch", version="builtin")

    def can_execute(self, bsym: BoundSymbol) -> bool:
        sym = bsym.sym
        if sym.id in self.implmap:
            return super().can_execute(bsym)
        if sym.executor is self:
            return True
        return sym.torch_impl is not None or sym.torch_executable

    def execution_symbol(self, bsym: BoundSymbol) -> Symbol:
        sym = bsym.sym
        if sym.id in self.implmap:
            return super().execution_symbol(bsym)
        if sym.executor is self:
            return sym
        cached = sym.execution_symbols.get(self)
        if cached is None:
            cached = sym.execution_symbols[self] = self._make_exec_symbol(sym)
        return cached

    def _make_exec_symbol(self, sym: Symbol) -> Symbol:
        if sym.torch_executable:
            fn = sym.torch_fns[0]
            module, _, name = torch_id(fn).rpartition(".")
        elif OpTags.FALLBACK in sym.tags or (sym.module or "").startswith("torch."):  # printed as the torch callable
            fn = sym.torch_impl
            module, name = sym.module, sym.name
            if getattr(fn, "kernel_may_disagree_with_fake", False):
                # a kernel whose outputs fake tensors may not predict (one resizing what it writes): checked at the
                # program's first call, which compiles again with what it returned (fulmen.core.meta_corrections)
                fn = checked_implementation(fn, executor=self.name, symbol=name, meta=sym.meta, corrects=name)
        elif (sym.module or "").split(".")[0] == "torch":  # it names the torch callable it runs (torch.ops.aten.gelu)
            fn = sym.torch_impl
            module, name = sym.module, sym.name
        else:
            fn = sym.torch_impl
            module, name = "torchex", sym.name
            setattr(torchex_namespace, name, fn)
        return Symbol(name=name, module=module, impl=fn, executor=self, is_prim=True, id=f"torch-exec:{sym.id}",
                      tags=sym.tags)


ex = TorchExecutor()
register_executor(ex)
_always.append(ex)
