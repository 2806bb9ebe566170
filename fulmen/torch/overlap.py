"""Eager's refusal of in-place writes whose source shares part of the memory written (``x.copy_(x.t())``,
``x[1:].add_(x[:-1])``, ``torch.add(a, 1, out=a.t())``).

Traced functionally such a write has a well-defined result, but eager raises instead, so fulmen raises the same
error. Views remember how they were made (``fulmen.torch.registry.link_views``); the two tensors' places in their
common storage are found by making the same views of a storage-less ``meta`` tensor laid out as fulmen takes the
storage's first value to be (inputs contiguous), and compared as eager's ``get_overlap_status`` compares them.
"""

from __future__ import annotations

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense

from fulmen.core import langctx
from fulmen.core.proxies import TensorProxy, latest

PARTIAL_OVERLAP = ("unsupported operation: some elements of the input tensor and the written-to tensor refer to a "
                   "single memory location. Please clone() the tensor before performing the operation.")


def _made_from(p: TensorProxy) -> tuple[TensorProxy, list] | None:
    """(the value whose storage ``p`` views, the view calls from it to ``p``); None when a call is unknown."""
    calls = []
    while p.view_of is not None:
        p, remake = p.view_of
        call = getattr(remake, "view_call", None)
        if call is None:
            return None
        calls.append(call)
    return p, calls[::-1]


def _meta(p: TensorProxy) -> torch.Tensor:
    from fulmen.torch.shape import strides_of

    return torch.empty_strided(tuple(p.shape), strides_of(p), dtype=p.dtype, device="meta")


def _on_meta(root: TensorProxy, calls: list) -> torch.Tensor | None:
    """``root``'s view made by ``calls`` on a meta tensor (None when one cannot run on meta tensors)."""
    t = _meta(root)
    try:
        with torch._C.DisableTorchFunction():
            for sym, rest, kwargs, index in calls:
                fn = sym.view_meta_fn or (sym.torch_fns[0] if sym.torch_fns else None)
                if fn is None:
                    return None
                rest = [_meta(a) if isinstance(a, TensorProxy) else a for a in rest]
                t = fn(t, *rest, **kwargs)
                t = t if index is None else t[index]
            return t
    except Exception:
        return None


def _partially_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """eager's ``get_overlap_status(a, b) == PARTIAL`` for two tensors in one storage."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if not is_non_overlapping_and_dense(a) or not is_non_overlapping_and_dense(b):
        return False  # eager: too hard to tell, not checked
    a_begin, b_begin = a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    a_end, b_end = a_begin + a.numel() * a.element_size(), b_begin + b.numel() * b.element_size()
    if a_begin == b_begin and a_end == b_end:
        return a.stride() != b.stride()
    return a_begin < b_end and b_begin < a_end


def check_no_partial_overlap(op: str, written, *sources) -> None:
    """Raise eager's RuntimeError when a tensor among ``sources`` shares part, but not all, of ``written``'s memory
    (``op``, when given, names the operation first)."""
    if not isinstance(written, TensorProxy):
        return
    dst = latest(written)
    found = None
    for src in sources:
        if not isinstance(src, TensorProxy) or latest(src) is dst:
            continue
        src = latest(src)
        if src.view_of is None and dst.view_of is None:
            continue  # two values each in a storage of its own
        found = found or _made_from(dst)
        theirs = _made_from(src)
        if found is None or theirs is None or latest(found[0]) is not latest(theirs[0]):
            continue
        a, b = _on_meta(found[0], found[1]), _on_meta(found[0], theirs[1])
        if a is not None and b is not None and _partially_overlap(a, b):
            raise RuntimeError(f"{op}(): {PARTIAL_OVERLAP}" if op else PARTIAL_OVERLAP)


langctx.out_checks.append(check_no_partial_overlap)
