"""``as_strided`` as eager addresses memory: its sizes, strides and offset are positions in the *storage* its input
views, not in the input's own elements (``torch.as_strided(x.t(), ...)`` ignores the transpose; an offset given is
absolute, and a missing one is the input's own ``storage_offset()``).

The value of the view is the torch call on the input (at run time that input is the tensor eager has, so a read
sees eager's elements). What fulmen must model is which elements of the storage's owner a write through the view
reaches, and what the view holds after the owner changes in place: the view is linked to the value that owns the
storage (the first value of the view chain, whose strides fulmen keeps), and remade from that value's elements put
in storage order. Where that storage cannot be known (a view chain that cannot be replayed, an owner whose elements
share memory, positions outside the owner), a write through the view, or a read of it after its owner changed, is
refused naming the user's line rather than reaching other elements.
"""

from __future__ import annotations

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense

from fulmen import clang, prims
from fulmen.core.proxies import TensorProxy, _user_location
from fulmen.core.tracectx import get_tracectx
from fulmen.torch.fallback import opaque_symbol
from fulmen.torch.overlap import _made_from, _meta, _on_meta
from fulmen.torch.views import layout_of, set_strides


def _storage_order(strides: tuple[int, ...]) -> list[int]:
    """The dims of a dense, non-overlapping tensor with ``strides``, outermost in memory first."""
    return sorted(range(len(strides)), key=lambda d: -strides[d])


def _remake_from_storage(sym, owner_shape, owner_strides, size, stride, offset: int):
    """``remake(new owner value)``: the as_strided view of the owner's storage holding ``new``'s elements."""
    order, numel = _storage_order(owner_strides), 1
    for n in owner_shape:
        numel *= n

    def remake(new_owner: TensorProxy) -> TensorProxy:
        memory = clang.reshape(clang.permute(new_owner, order), (numel,))
        if offset:
            memory = clang.slice_in_dim(memory, offset, numel, 1, 0)
        # dense from its first element, so as_strided's default offset (the tensor's own) starts at ``offset``
        memory = prims.stride_order(memory, (0,))
        return opaque_symbol(torch.as_strided)(memory, tuple(size), tuple(stride), None)

    remake.view_call = (sym, (tuple(size), tuple(stride), offset), {}, None)  # fulmen.torch.overlap
    return remake


def _refusing_remake(a: TensorProxy, why: str):
    where = _user_location()

    def remake(new_owner: TensorProxy) -> TensorProxy:
        raise NotImplementedError(
            f"a write through torch.as_strided of {a.name} ({a.type_string()}), or a read of that view after the "
            f"tensor it views changed in place: {why}, so fulmen cannot tell which elements the view covers.\n"
            f"  as_strided at {where}\nTake as_strided of a contiguous tensor (x.contiguous()), or write the "
            "elements by indexing instead."
        )

    return remake


def _offset_and_owner(a: TensorProxy, size, stride, storage_offset):
    """(owner, its strides, the view's offset into the owner's storage) or (None, why, None)."""
    made = _made_from(a)
    if made is None:
        return None, "it is a view made by an operation fulmen cannot replay", None
    owner, calls = made
    if any(type(n) is not int for n in (*owner.shape, *size, *stride, 0 if storage_offset is None else storage_offset)):
        return None, "its sizes or offset are symbolic", None
    meta_owner, meta_a = _meta(owner), _on_meta(owner, calls)
    if meta_a is None or not is_non_overlapping_and_dense(meta_owner):
        return None, "the memory it views is not laid out densely", None
    offset = meta_a.storage_offset() if storage_offset is None else storage_offset
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if any(n == 0 for n in size):
        last = offset
    if offset < 0 or last >= max(owner.numel(), 1):
        return None, f"the view reaches storage positions outside the {owner.numel()} elements of {owner.name}", None
    return owner, tuple(meta_owner.stride()), offset


def _from_an_input(a: TensorProxy) -> bool:
    """Whether ``a`` is a program input or a view of one: its storage may start before its first element (a caller's
    ``base[1:]``), which the program's key does not hold, so an absolute offset cannot be placed in it."""
    trace = get_tracectx()
    inputs = {id(p) for p in trace.args} if trace is not None else set()
    return any(id(t) in inputs for t in _view_chain(a))


def _view_chain(a: TensorProxy) -> list[TensorProxy]:
    """``a``, the tensor it is a view of, and so on to the tensor that owns the storage (last)."""
    chain = [a]
    while chain[-1].view_of is not None:
        chain.append(chain[-1].view_of[0])
    return chain


def link_to_storage(sym, out: TensorProxy, a: TensorProxy, size, stride, storage_offset) -> None:
    """Make ``out``, eager's ``as_strided(a, size, stride, storage_offset)``, a view of the value owning ``a``'s
    storage. A contiguous ``a`` that is no view keeps the plain link (its storage is itself, from offset 0)."""
    if storage_offset is not None and _from_an_input(a):
        why = "its storage_offset is a position in a program input's storage, where the input itself starts is unknown"
        owner, strides = None, why + " (leave storage_offset out to start at the input's own offset)"
    elif a.view_of is None and layout_of(a) is None:
        return
    else:
        owner, strides, offset = _offset_and_owner(a, tuple(size), tuple(stride), storage_offset)
    if owner is None:
        remake = _refusing_remake(a, strides)
        owner = _view_chain(a)[-1]
    else:
        remake = _remake_from_storage(sym, tuple(owner.shape), strides, size, stride, offset)
    out.make_view_of(owner, remake)
    set_strides(out, tuple(stride))
