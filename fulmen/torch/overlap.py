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
from fulmen.core.proxies import TensorProxy, _user_location, latest

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


#: Above this many elements the exact test of ``_order_dependent`` is replaced by a test of the byte ranges.
_EXACT_LIMIT = 1 << 20


def _addresses(t: torch.Tensor) -> torch.Tensor:
    """The storage index of each element of the meta tensor ``t``, as a real int64 tensor of ``t``'s shape."""
    index = torch.full((), t.storage_offset(), dtype=torch.int64)
    for d, (size, stride) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.ndim
        shape[d] = size
        index = index + torch.arange(size, dtype=torch.int64).reshape(shape) * stride
    return index.expand(t.shape)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The first and last storage index ``t``'s elements occupy (strides of views are never negative)."""
    return t.storage_offset(), t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _order_dependent(dst: torch.Tensor, src: torch.Tensor, copies: bool) -> bool:
    """Whether writing ``dst`` elementwise from ``src`` (broadcast to it) reads an element of ``dst`` other than the
    one written: eager's kernel then reads some values before and some after it writes them, and its result depends
    on the order it visits elements (``y.sub_(y.narrow(1, 0, 1))``). Eager does not check this where its overlap
    test gives up (a source or destination with gaps or repeats). ``copies``: the op writes the source's values
    unchanged (``copy_``, an index assignment)."""
    if dst.numel() == 0 or src.numel() == 0:
        return False
    try:
        src = src.expand(dst.shape)
    except RuntimeError:
        return False  # not broadcastable: the op itself raises
    if dst.numel() > _EXACT_LIMIT:  # by the spans of memory: disjoint, or one layout, is all it can tell apart
        if src.stride() == dst.stride() and src.storage_offset() == dst.storage_offset():
            return False
        (d_lo, d_hi), (s_lo, s_hi) = _span(dst), _span(src)
        return d_lo <= s_hi and s_lo <= d_hi
    with torch._C.DisableTorchFunction():
        written, read = _addresses(dst).reshape(-1), _addresses(src).reshape(-1)
        crossing = (read != written) & torch.isin(read, written)
        if not copies or not crossing.any():
            return bool(crossing.any())
        # a copy writes each element its source value: an element read elsewhere keeps its value when it is its own
        # source (``x.copy_(x[:, :1])`` reads column 0, which column 0's copy leaves as it was)
        order = torch.argsort(written)
        at = order[torch.searchsorted(written[order], read[crossing])]
        return bool((read[at] != written[at]).any())


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
        if a is None or b is None:
            continue
        while not op and b.ndim > a.ndim and b.shape[0] == 1:
            b = b[0]  # an index assignment drops the value's leading size-1 dims (eager's set_item), then compares
        if _partially_overlap(a, b):
            raise RuntimeError(f"{op}(): {PARTIAL_OVERLAP}" if op else PARTIAL_OVERLAP)
        if _order_dependent(a, b, copies=op in ("copy_", "")):
            raise NotImplementedError(
                f"{op or 'an in-place write'}: the source reads elements of the tensor being written, at other "
                "positions (it views the same memory in another layout), so eager's result depends on the order "
                "its kernel visits elements and fulmen cannot reproduce it; clone() the source first.\n  at "
                f"{_user_location()}")


langctx.out_checks.append(check_no_partial_overlap)
