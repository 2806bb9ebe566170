"""In-place operations made functional.

``a.add_(b)`` records ``t = ltorch.add(a, b)`` and makes ``t`` the current value of ``a``: later uses of
the Python object ``a`` read ``t`` (see ``proxies.latest``). Views made by view ops remember their base
and how they were made, so updating a view updates its base (and the base's other views), as in eager.
When the jitted function returns, inputs whose value changed are written back with ``prims.copy_``.

Autograd sees these updates as eager's does: ``ltorch.overwritten`` carries a tensor's history through a write
autograd does not record (under ``no_grad``, through ``detach()``) and through values that replace it (``zero_``);
a source overlapping the memory written is refused (``fulmen.torch.overlap``), as is a backward through a value
overwritten after an op saved it (``fulmen.transforms.split``). Ops that change a tensor's shape or strides in
place (``squeeze_``, ``t_``, ...) are refused: a proxy keeps the shape it was made with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from fulmen import clang, prims
from fulmen.core.devices import to_torch_device
from fulmen.core.proxies import TensorProxy, _user_location, latest
from fulmen.core.symbol import OpTags, Symbol
from fulmen.core.trace import get_tracectx
from fulmen.core.tracer import get_tracer
from fulmen.core.utils import check
from fulmen.torch.overlap import check_no_partial_overlap
from fulmen.torch.registry import register_function, tensor_methods, torchsymbol
from fulmen.torch.shape import as_strided, layout_of, set_strides
from fulmen.torch.views import memory_order


def _overlap_message() -> str:
    return ("unsupported operation: more than one element of the written-to tensor refers to a single memory "
            f"location. Please clone() the tensor before performing the operation.\n  at {_user_location()}")


def scatter_into(base: TensorProxy, select: Callable[[TensorProxy], TensorProxy], values) -> TensorProxy:
    """A copy of ``base`` whose elements that ``select(base)`` picks are replaced by ``values``.

    ``select`` may be any composition of view and indexing ops: it is applied to a tensor of element
    numbers to learn which elements of ``base`` it picks, then those are written with one ``index_put``.
    """
    numbers = prims.iota(base.numel(), start=0, step=1, device=base.device, dtype=torch.int64)
    numbers = clang.reshape(numbers, base.shape)
    picked = select(numbers)
    picked = latest(picked)
    if not isinstance(values, TensorProxy):
        values = clang.full(picked.shape, values, device=base.device, dtype=base.dtype)
    values = clang.maybe_convert_to_dtype(values, base.dtype)
    # as eager's index assignment, leading size-1 dims of the values beyond the picked elements' dims are dropped
    # (``a[0] = b`` with ``a[0]`` of shape (5,) and ``b`` of shape (1, 1))
    extra = 0
    while values.ndim - extra > picked.ndim and values.shape[extra] == 1:
        extra += 1
    if extra:
        values = clang.reshape(values, tuple(values.shape[extra:]))
    if values.device != base.device:
        values = prims.device_put(values, base.device)
    values = clang.expand_to(values, picked.shape)
    flat = clang.reshape(base, (base.numel(),))
    flat = prims.index_put(flat, [clang.reshape(picked, (picked.numel(),))],
                           clang.reshape(values, (values.numel(),)), False)
    return clang.reshape(flat, base.shape)


@torchsymbol(id="ltorch.overwritten")
def overwritten(new: TensorProxy, old: TensorProxy, keeps_gradient: bool) -> TensorProxy:
    """``new``'s values as the value an in-place op gave the tensor that held ``old``, for autograd.

    Eager autograd keeps a tensor's history through an in-place op where the new value alone would lose it:
    written where autograd does not see it (``keeps_gradient``: the gradient of the result reaches ``old``
    unchanged, as for ``w.add_(u)`` inside ``no_grad`` or ``w.detach().zero_()``), or overwritten by values that
    do not depend on it (``zero_``, ``fill_``, ``copy_``: the result still requires grad and ``old`` receives a
    zero gradient). The gradient rule is in ``fulmen.transforms.grad_rules``.
    """
    out = prims.reshape(new, tuple(new.shape))
    out.requires_grad = True
    return out


@torchsymbol(id="ltorch.overlapping_write")
def overlapping_write(new: TensorProxy, where: str) -> TensorProxy:
    """``new``, the value of a base written through a view of it whose elements share memory (an ``expand``-ed
    view, ``b[None].expand(2, 3).fill_(1.0)``) where autograd sees the write. Eager runs the write, and its
    backward through it raises ("more than one element of the written-to tensor refers to a single memory
    location"); the gradient rule (``fulmen.transforms.grad_rules``) raises the same there, naming ``where`` (the
    user's line), rather than differentiating the write as if the elements were distinct."""
    return prims.reshape(new, tuple(new.shape))


def mutate(target: TensorProxy, new_value, *, overwrites: bool = False, refuse_overlap: bool = True,
           _from_view: TensorProxy | None = None, _refresh_written: bool = False) -> TensorProxy:
    """Make ``new_value`` (cast and broadcast to ``target``) the current value of ``target``; returns target.

    ``overwrites``: the new value replaces the old one instead of being computed from it (``copy_``, ``fill_``).
    ``refuse_overlap``: a target whose elements share memory (an ``expand``-ed view) is refused, as eager's in-place
    ops refuse it (not ``fill_``/``zero_``, whose elements all get one value, nor index assignments, which check the
    part written)."""
    trc = get_tracectx()
    check(trc is not None, lambda: "in-place operations can only be traced", RuntimeError)
    trc.has_mutations = True
    if not isinstance(target, TensorProxy) and isinstance(target, torch.Tensor):
        target = get_tracer().capture(target)  # a global or closure tensor: an input, written back like the arguments
    current = latest(target)
    if _from_view is None and torch.is_grad_enabled():
        _check_not_multi_output_view(target)
    if refuse_overlap and _from_view is None:
        check(not _shares_elements(current), _overlap_message)
    new = _cast_to(current, new_value)
    # torch's check concerns the tensor written through (x.detach().zero_() on a leaf is allowed)
    if _from_view is None and torch.is_grad_enabled() and current.requires_grad and current.origin == "input-leaf":
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
    if new is current:  # nothing was computed (x.add_(0) folded away): the value is unchanged
        return target
    trc.overwritten.append((current, new, len(trc.scopes[0]), trc.inplace_start))  # autograd's saved-tensor check
    grad_enabled = torch.is_grad_enabled()
    # a write autograd does not see: under no_grad, or through a view that does not require grad (x.detach(), x.data)
    unseen = not grad_enabled or (_from_view is not None and not _from_view.requires_grad)
    if current.requires_grad and (unseen or overwrites or not isinstance(new_value, TensorProxy)):
        with torch.enable_grad():  # recorded as differentiable even inside no_grad: it carries the history on
            new = overwritten(new, current, unseen)
    current.replace_with(new)
    trc.mutations += 1
    if current.view_of is None:  # the tensor keeps its layout (a view's is kept by its remake function)
        strides = layout_of(current)
        if strides is not None:
            set_strides(new, strides)
    if current.view_of is not None:
        _write_to_base(current, new)
    _refresh_views(current, new, None if _refresh_written else _from_view, keep_history=unseen and new.requires_grad)
    return target


def _cast_to(current: TensorProxy, new_value) -> TensorProxy:
    """``new_value`` (a tensor or a number) cast and broadcast to ``current``, as an in-place op writes it: into
    ``current``'s memory, so a tensor that is not a view gets a dense value laid out as ``current`` is (a
    channels_last tensor stays channels_last after ``zero_()``; ``copy_`` of a broadcast source is no expanded
    view of that source)."""
    order = memory_order(current) if current.view_of is None else None
    if not isinstance(new_value, TensorProxy):
        if order is None:
            return clang.full(current.shape, new_value, device=current.device, dtype=current.dtype)
        filled = clang.full(tuple(current.shape[d] for d in order), new_value, device=current.device,
                            dtype=current.dtype)
        return clang.permute(filled, [order.index(d) for d in range(current.ndim)])
    check(clang.broadcast_shapes(current.shape, new_value.shape) == tuple(current.shape),
          lambda: f"output with shape {list(current.shape)} doesn't match the broadcast shape "
          f"{list(clang.broadcast_shapes(current.shape, new_value.shape))}")
    new = clang.expand_to(clang.maybe_convert_to_dtype(new_value, current.dtype), current.shape)
    if current.view_of is not None or (layout_of(current) is not None and order is None):
        return new  # a view's write goes to its base; a layout with gaps or unknown sizes is left as it was
    if tuple(new_value.shape) != tuple(current.shape) or layout_of(new) != layout_of(current):
        order = order if order is not None else list(range(current.ndim))
        new = prims.stride_order(new, tuple(current.ndim - 1 - order.index(d) for d in range(current.ndim)))
    return new


def _write_to_base(current: TensorProxy, new: TensorProxy) -> None:
    """A view written to: its base gets the new value of the view's elements (``mutate`` of the base)."""
    base, remake = current.view_of
    select, through = remake, None
    # a base whose elements share memory (an expand) cannot take the view's new value element by element (its
    # other elements would carry old values to the same memory): the write goes on up, through the composed
    # views, to the first base that can
    while latest(base).view_of is not None and _shares_elements(latest(base)):
        through = base
        outer, outer_remake = latest(base).view_of
        select = (lambda inner, view: lambda b: inner(view(b)))(select, outer_remake)
        base = outer
    if through is None:
        unview = getattr(remake, "unview", None)
        new_base = unview(new) if unview is not None else scatter_into(latest(base), remake, new)
        if torch.is_grad_enabled() and current.requires_grad and _shares_elements(current):
            new_base = overlapping_write(new_base, _user_location())
        # computed from the base's old value; the view written is then remade from the base's new value too, so a
        # returned view shares the returned base's memory and has eager's strides, not those of ``new``
        mutate(base, new_base, _from_view=current, _refresh_written=True)
    else:
        # whether autograd sees the write is the written view's business (x.expand(...).detach().fill_ is unseen)
        mutate(base, scatter_into(latest(base), select, new), _from_view=current, _refresh_written=True)


def _refresh_views(old: TensorProxy, new: TensorProxy, written: TensorProxy | None, keep_history: bool) -> None:
    """The views of ``old`` now stand for the same views of ``new``, and so on down to views of views (``b = a[0]``,
    ``c = b.t()``: a write to ``a`` changes ``c``); ``written``, the view the write came through, is current.
    ``keep_history``: the write was one autograd does not see (under no_grad), and the views keep their history
    through it, as the base does."""
    if not old.views:
        return
    views = list(old.views)  # remake() below registers each refreshed value as a view of `new` too
    for view in views:
        if view is written or latest(view) is new:
            continue
        if view.view_of is None or view.view_of[0].views is not old.views:
            continue  # no longer a view of this tensor (an unview's result, made current in its base's place)
        base_view, remake = view.view_of
        with torch.enable_grad() if keep_history else contextlib.nullcontext():
            refreshed = remake(new)
        view_now = latest(view)
        if view_now is not refreshed:
            view_now.replace_with(refreshed, links_of=view)
            _refresh_views(view, refreshed, None, keep_history)
    old.restore_views(views)  # the original view proxies keep standing for their refreshed values


def setitem(a: TensorProxy, key, value) -> None:
    """``a[key] = value``: basic and advanced indexing, scalars and broadcastable tensors."""
    from fulmen.core import langctx

    getitem = langctx.method("__getitem__")
    current = latest(a)
    if isinstance(value, TensorProxy) and (value.view_of is not None or current.view_of is not None):
        # eager refuses a value overlapping the part written: a view of the target, or the base the target views
        target = getitem(current, key)  # recorded only to be compared; dead code elimination drops it
        # a 0-d CPU value of another shape than the part written is filled in (TensorIndexing's copy_to): eager
        # reads it once, before writing, and checks no overlap
        fills = value.ndim == 0 and to_torch_device(value.device).type == "cpu" and tuple(target.shape) != ()
        if not fills:
            check_no_partial_overlap("", target if target.view_of is not None else a, value)
    if current.view_of is not None and _shares_elements(current):
        # the view's elements share memory (an expand): only those the key picks are written, straight into the
        # base; a new value of the whole view would also carry the others' old values to the same base elements
        picked = getitem(current, key)
        check(not (isinstance(picked, TensorProxy) and picked.view_of is not None and _shares_elements(picked)),
              _overlap_message)
        base, remake = current.view_of
        select = lambda b: getitem(remake(b), key)  # noqa: E731
        while latest(base).view_of is not None and _shares_elements(latest(base)):  # up to a base that can take it
            outer, outer_remake = latest(base).view_of
            select = (lambda inner, view: lambda b: inner(view(b)))(select, outer_remake)
            base = outer
        # written through a view autograd does not see (a detached expand): the base keeps its history, as in eager
        unseen_view = None if current.requires_grad else current
        mutate(base, scatter_into(latest(base), select, value), refuse_overlap=False, _from_view=unseen_view,
               _refresh_written=True)
        return
    mutate(a, scatter_into(current, lambda base: getitem(base, key), value), refuse_overlap=False)


def _memory_meta(a: TensorProxy, size: tuple, stride: tuple) -> TensorProxy:
    return TensorProxy(shape=size, dtype=a.dtype, device=a.device, requires_grad=False)


#: ``torch.as_strided(x, (n,), (1,))``: the n elements of memory from where ``x`` starts, as a dense 1-D tensor that
#: shares them. Its own symbol (not the opaque ``torch.as_strided``): its result is the base of ``x``, not a view of it.
memory_of = Symbol(name="as_strided", meta=_memory_meta, id="ltorch.memory_of", is_prim=True, tags=(OpTags.FALLBACK,),
                   module="torch", torch_fns=(torch.as_strided,), torch_impl=torch.as_strided)


def view_input_as_its_memory(p: TensorProxy) -> None:
    """Make the program input ``p``, whose elements share memory (an ``expand``-ed tensor, stride 0), a view of the
    memory it covers, as eager's tensor is: a write through it (``fill_``, ``zero_``, an index assignment) then
    reaches every element that shares the memory written, a later read sees it, and the caller's memory gets it.
    Called before the user's code runs; a program that never writes ``p`` loses the unused memory value to DCE.
    Inputs that require grad keep their refusal (autograd's view of such a write is not modelled)."""
    strides = layout_of(p)
    if p.requires_grad or not _shares_elements(p) or any(type(n) is not int for n in (*p.shape, *strides)):
        return
    span = 1 + sum((n - 1) * st for n, st in zip(p.shape, strides)) if p.numel() else 0
    memory = memory_of(p, (span,), (1,))

    def remake(new_memory, shape=tuple(p.shape), strides=tuple(strides)):
        return as_strided(new_memory, shape, strides, 0)

    remake.view_call = (as_strided, (tuple(p.shape), tuple(strides), 0), {}, None)  # replayable (fulmen.torch.overlap)
    p.make_view_of(memory, remake)
    set_strides(p, strides)  # now kept for the view, as for any view (fulmen.torch.views)


def _check_not_multi_output_view(target: TensorProxy) -> None:
    """Eager's refusal of an in-place write, with grad mode on, to a view (or a view of a view) of one of the outputs
    of a function returning several views, made with grad mode on and requiring grad."""
    t = target
    while t is not None:
        check(t.origin != "multi-output-view", lambda: "A view of an output of a function that returns multiple "
              "views (split, chunk, unbind) is being modified inplace. Such functions do not allow the output views "
              "to be modified inplace. You should replace the inplace operation by an out-of-place one.")
        t = t.view_of[0] if t.view_of is not None else None


def _shares_elements(t: TensorProxy) -> bool:
    """Whether some elements of the view ``t`` are the same memory (a stride 0 over more than one element)."""
    strides = layout_of(t)
    return strides is not None and any(st == 0 and n > 1 for st, n in zip(strides, t.shape))


# ---------------------------------------------------------------------------------------------------------
# in-place changes of shape and strides

#: In-place ops that change a tensor's shape or strides rather than its values (eager gives the caller's tensor
#: object the new layout); the out-of-place form each suggests.
_METADATA_OPS = {"squeeze_": "x = x.squeeze(...)", "unsqueeze_": "x = x.unsqueeze(...)", "t_": "x = x.t()",
                 "transpose_": "x = x.transpose(...)", "swapdims_": "x = x.swapdims(...)",
                 "swapaxes_": "x = x.swapaxes(...)", "resize_": "x = x.reshape(...) or a new tensor",
                 "resize_as_": "x = x.reshape_as(...) or a new tensor", "as_strided_": "x = x.as_strided(...)",
                 "set_": "x = source"}


def _metadata_op(name: str):
    def changes_metadata(a, *args, **kwargs):
        """Refused: a proxy's shape is fixed when it is made (it is the same Python object before and after, as
        the user's tensor is), so the layout eager gives the tensor in place cannot be followed."""
        if _leaves_shape(name, a, args, kwargs):
            return a
        raise NotImplementedError(
            f"Tensor.{name}() changes the shape or strides of tensor {getattr(a, 'name', '?')} in place, which "
            f"fulmen.jit does not support: the caller's tensor would keep its old layout.\n  at {_user_location()}\n"
            f"Use the out-of-place form and its result instead ({_METADATA_OPS[name]}).")

    changes_metadata.__name__ = name
    return changes_metadata


def _leaves_shape(name: str, a, args, kwargs) -> bool:
    """Whether ``a.<name>(*args)`` changes nothing: a squeeze of no size-1 dim, a resize to the current shape."""
    if not isinstance(a, TensorProxy):
        return False
    shape = tuple(a.shape)
    if name == "squeeze_":
        dims = args[0] if args else kwargs.get("dim")
        dims = range(a.ndim) if dims is None else ((dims,) if isinstance(dims, int) else dims)
        return all(-a.ndim <= d < max(a.ndim, 1) and (not shape or shape[d] != 1) for d in dims)
    if name == "t_":
        return a.ndim < 2
    if name in ("transpose_", "swapdims_", "swapaxes_") and len(args) == 2 and not kwargs:
        return a.ndim == 0 or args[0] % a.ndim == args[1] % a.ndim
    if name == "resize_" and not kwargs:
        size = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
        return tuple(size) == shape
    if name == "resize_as_" and not kwargs and args:
        return tuple(args[0].shape) == shape
    return False


for _name in _METADATA_OPS:
    register_function(tensor_methods(_name), _metadata_op(_name), method_names=[_name])
