"""Adding an embedding's gradient into the weight's other gradient in place (tied embeddings).

A weight used twice -- a language model's token embedding that is also its output projection -- gets two
gradients, and the backward adds them::

    t375 = torch.ops.aten.embedding_dense_backward(t687, idx, 4096, -1, False)  # zeros, then one row per token
    t689 = torch.add(t640, t375)                                                 # a third (V, D) buffer

``accumulate_embedding_grads`` turns the pair into one call that adds the looked-up rows' gradients straight
into the other gradient (``index_add_``), when nothing else reads that gradient::

    t689 = embedding_grad_add_(t640, t687, idx, -1)

That saves two (V, D) buffers and the passes that fill them: on a CPU, fresh multi-megabyte buffers cost a page
fault per 4 KiB, and freeing one can hand its pages back to the system. At run time the call checks that it
owns ``t640`` outright -- no other tensor shares its storage, no other Python name holds it, autograd is not
recording -- and otherwise computes the original two operations, so the result never depends on the check.
Only float32 and float64 CPU tensors are rewritten: on CUDA ``index_add_`` uses atomics (the order of additions,
and so the rounding, would vary between runs), and half types would accumulate in half precision where aten's
embedding backward does not.
"""

from __future__ import annotations

import sys

import torch

import fulmen.torch as ltorch
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol
from fulmen.core.trace import Trace
from fulmen.transforms.grad_ops import embedding_dense_backward, executable_symbol
from fulmen.transforms.passes import use_counts


def _owned(t: torch.Tensor) -> bool:
    """Whether ``t`` may be written in place: one TensorImpl owns its storage (so ``t`` is no view and has none;
    ``untyped_storage()`` adds a reference of its own), nothing in C++ holds the TensorImpl, and no Python
    reference holds it beyond the generated code's variable and the two parameters on the way here.

    The Python count is compared with a probe's, passed along calls of the same shape, rather than with a
    constant: how many references a call adds depends on the interpreter's state (after a failed
    ``torch.compile``, Dynamo's frame hook leaves every call holding its arguments twice). A count that differs
    from the probe's for any other reason takes the out-of-place path, never a wrong one."""
    return (t._use_count() == 1 and sys.getrefcount(t) == _probe_refs()
            and torch._C._storage_Use_Count(t.untyped_storage()._cdata) == 2)


def _probe_refs() -> int:
    probe = object()  # held by one variable, like the generated code's
    return _probe_call(probe)


def _probe_call(value: object) -> int:  # stands for _embedding_grad_add
    return _probe_count(value)


def _probe_count(value: object) -> int:  # stands for _owned
    return sys.getrefcount(value)


def _embedding_grad_add(acc: torch.Tensor, grad: torch.Tensor, indices: torch.Tensor, padding_idx: int
                        ) -> torch.Tensor:
    if torch.is_grad_enabled() or not _owned(acc):
        rows = torch.ops.aten.embedding_dense_backward(grad, indices, acc.shape[0], padding_idx, False)
        return torch.add(acc, rows)
    flat_indices = indices.reshape(-1)
    flat_grad = grad.reshape(-1, grad.shape[-1])
    if padding_idx >= 0:  # aten skips the tokens equal to padding_idx (-1: none)
        keep = flat_indices != padding_idx
        flat_indices, flat_grad = flat_indices[keep], flat_grad[keep]
    return acc.index_add_(0, flat_indices, flat_grad)


def _meta(acc, grad, indices, padding_idx):
    return TensorProxy(like=acc, requires_grad=False)


embedding_grad_add = executable_symbol("embedding_grad_add_", _embedding_grad_add, _meta)


def _rewritable(acc: TensorProxy, rows: TensorProxy, producer: BoundSymbol) -> bool:
    padding_idx, scale = producer.args[3:]
    return (not scale and isinstance(padding_idx, int) and isinstance(acc, TensorProxy)
            and acc.device.type == "cpu" and acc.dtype in (torch.float32, torch.float64)
            and rows.dtype == acc.dtype and str(rows.device) == str(acc.device)
            and tuple(acc.shape) == tuple(rows.shape))


def accumulate_embedding_grads(trace: Trace) -> Trace:
    """``add(other_grad, embedding_dense_backward(...))`` -> ``embedding_grad_add_`` where the sum is the only
    reader of both operands and ``other_grad`` is computed in this trace (see the module docstring)."""
    bsyms = trace.bound_symbols
    producer = {p.name: b for b in bsyms for p in b.flat_proxy_outs}
    uses = use_counts(trace)

    replaced: dict[int, BoundSymbol | None] = {}
    for b in bsyms:
        if b.sym.id != ltorch.add.id or b.kwargs or len(b.args) != 2:
            continue
        for acc, rows in (b.args, b.args[::-1]):
            made = producer.get(getattr(rows, "name", None))
            if (made is None or made.sym.id != embedding_dense_backward.id or getattr(acc, "name", None) not in producer
                    or uses.get(acc.name) != 1 or uses.get(rows.name) != 1
                    or id(made) in replaced or not _rewritable(acc, rows, made)):
                continue
            g, idx, _, padding_idx, _ = made.args
            replaced[id(made)] = None
            replaced[id(b)] = embedding_grad_add.bind(acc, g, idx, padding_idx, output=b.output, subsymbols=(made, b))
            break
    if not replaced:
        return trace
    new = [replaced.get(id(b), b) for b in bsyms]
    return trace.derive("Embedding gradients added in place", [b for b in new if b is not None])
