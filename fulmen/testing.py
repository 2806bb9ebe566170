"""Test helpers: run a program through its decompositions, and compare fulmen with eager torch in one call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from fulmen.core.codegen import compile_trace
from fulmen.core.symbol import BoundSymbol
from fulmen.core.trace import check_trace
from fulmen.executors.base import claim_symbols
from fulmen.executors.torchex import TorchExecutor
from fulmen.frontend.tracing import trace_program
from fulmen.transforms.passes import dce, del_last_used


class PrimsOnlyExecutor(TorchExecutor):
    """The torch executor restricted to prims and opaque ops: every torch-language symbol is decomposed."""

    def __init__(self):
        super().__init__()
        self.name = "torch-prims-only"

    def can_execute(self, bsym: BoundSymbol) -> bool:
        if bsym.sym.module == "ltorch":
            return False
        return super().can_execute(bsym)


_prims_only = PrimsOnlyExecutor()


def run_decomposed(fn: Callable, *args, **kwargs) -> Any:
    """Trace ``fn`` and run it with every torch-language symbol replaced by its prims (no grad)."""
    trace, spec = trace_program(fn, args, kwargs, same_tensors=False)  # called below with one tensor per position
    check_trace(trace)
    claimed = claim_symbols(dce(trace), [_prims_only])
    check_trace(claimed)
    final = del_last_used(claimed)
    check_trace(final)
    compiled, _ = compile_trace(final)
    flat, _ = tree_flatten((args, kwargs))
    tensors = [t for t in flat if isinstance(t, torch.Tensor)] + list(spec.captured)
    with torch.no_grad():
        return compiled(*tensors)


def _clone_tensor(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty((), dtype=x.dtype, device=x.device)
    out.set_(x.detach().untyped_storage().clone(), x.storage_offset(), x.shape, x.stride())
    return out.requires_grad_(x.requires_grad)


def clone_args(x: Any) -> Any:
    """A deep copy of call arguments: tensors keep their strides, storage offset and requires_grad, so transposed,
    gapped and expanded inputs reach the op as they were (tests run eager and fulmen on separate copies)."""
    return tree_map_only(torch.Tensor, _clone_tensor, x)


def assert_close(actual: Any, expected: Any, **kwargs) -> None:
    """``torch.testing.assert_close`` over nested outputs; non-tensor leaves must be equal."""
    a_flat, a_spec = tree_flatten(actual)
    e_flat, e_spec = tree_flatten(expected)
    assert a_spec == e_spec, f"output structures differ: {a_spec} vs {e_spec}"
    for a, e in zip(a_flat, e_flat):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(a, e, **kwargs)
        else:
            assert a == e, f"{a!r} != {e!r}"


def check_against_torch(fn: Callable, *args, decomposed: bool = True, **tolerances) -> None:
    """Compare ``fulmen.jit(fn)`` (and, with ``decomposed``, the prims-only run) with eager ``fn``."""
    import fulmen

    expected = fn(*args)
    assert_close(fulmen.jit(fn)(*args), expected, **tolerances)
    if decomposed:
        assert_close(run_decomposed(fn, *args), expected, **tolerances)
