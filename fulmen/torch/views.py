"""How views alias and lay out their results, as eager's do: the strides fulmen keeps for proxies, and
``view_symbol``, which declares a torch-language view op (``fulmen.torch.shape`` holds the ops themselves).

Proxies carry no strides, so fulmen keeps the strides eager would give each view here (inputs are taken to be
contiguous) and asks PyTorch itself, on a storage-less ``meta`` tensor with those strides, what the op does: a
view, a copy, or an error. Program inputs have the strides of the tensors they stand for (``set_strides``);
elementwise results take their inputs' layout (``follow_input_layout``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence

import torch
from torch._prims_common import compute_elementwise_output_strides
from torch.utils._pytree import tree_leaves

from fulmen import clang, prims
from fulmen.core import symbolic
from fulmen.core.proxies import TensorProxy, _user_location
from fulmen.core.symbol import BoundSymbol, OpTags, Symbol
from fulmen.core.symbolic import contains_symbolic
from fulmen.core.utils import canonicalize_dim, contiguous_strides
from fulmen.torch import kernel_layouts
from fulmen.torch.registry import link_views, register_function, set_lazy_bits, torchsymbol, with_lazy_bits

#: id(proxy) -> (weak reference to it, the strides eager gives it); proxies not listed are contiguous.
_strides: dict[int, tuple[weakref.ref, tuple[int, ...]]] = {}
#: Strides of views, keyed by the function that remakes the view from its base: a view keeps its layout when
#: an in-place update gives it a new value (``fulmen.torch.inplace`` passes the same function on).
_view_strides: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


#: The strides of a view whose layout torch could not tell for symbolic sizes (``_view_hook``).
UNKNOWN = ("unknown",)


def _unknown_layout(p: TensorProxy) -> NotImplementedError:
    return NotImplementedError(
        f"fulmen does not know the strides of the view {p.name} ({p.type_string()}) for symbolic sizes (PyTorch's "
        "meta tensors could not make it), and the traced code depends on them (stride(), is_contiguous(), a view "
        "or an in-place write through it). The program is compiled for the exact sizes instead.")


def strides_of(p: TensorProxy) -> tuple[int, ...]:
    """The strides eager PyTorch gives the tensor ``p`` stands for (inputs: those of ``set_strides``); a view whose
    strides torch could not make for symbolic sizes is taken to be contiguous here (``known_strides`` tells)."""
    if p.view_of is not None:
        strides = _view_strides.get(p.view_of[1])
        if strides is not None and strides is not UNKNOWN:
            return strides
    entry = _strides.get(id(p))
    if entry is not None and entry[0]() is p:
        return entry[1]
    return contiguous_strides(p.shape)


def layout_of(p: TensorProxy) -> tuple[int, ...] | None:
    """``strides_of(p)``, or None when ``p`` is contiguous for want of any other record (the common case, told
    apart without computing contiguous strides)."""
    if p.view_of is None and id(p) not in _strides:
        return None
    return strides_of(p)


def known_strides(p: TensorProxy) -> tuple[int, ...]:
    """``strides_of(p)`` for a read the program's values depend on (``stride()``, ``is_contiguous()``): for a view
    whose strides are not known (symbolic sizes), NotImplementedError, so that the symbolic compilation gives up
    and the program compiles for exact sizes (logged), rather than answer as if it were contiguous."""
    if p.view_of is not None and _view_strides.get(p.view_of[1]) is UNKNOWN:
        raise _unknown_layout(p)
    return strides_of(p)


def stride(a: TensorProxy, dim: int | None = None):
    """``Tensor.stride()``: the strides eager gives the tensor ``a`` stands for (``strides_of``), not the traced
    wrapper's own, which are contiguous (offsets computed from those, as for ``as_strided``, pick other elements)."""
    strides = known_strides(a)
    return strides if dim is None else strides[canonicalize_dim(a.ndim, dim)]


def is_contiguous(a: TensorProxy, memory_format: torch.memory_format = torch.contiguous_format) -> bool:
    """``Tensor.is_contiguous()`` of the tensor ``a`` stands for, decided by torch from its sizes and strides."""
    with torch._C.DisableTorchFunction():
        return torch.empty_strided(tuple(a.shape), known_strides(a), device="meta").is_contiguous(
            memory_format=memory_format)


def dim_order(a: TensorProxy, *, ambiguity_check: bool | list = False) -> tuple[int, ...]:
    """``Tensor.dim_order()`` of the tensor ``a`` stands for, decided by torch from its sizes and strides."""
    with torch._C.DisableTorchFunction():
        return torch.empty_strided(tuple(a.shape), known_strides(a), device="meta").dim_order(
            ambiguity_check=ambiguity_check)


def storage_offset(a: TensorProxy) -> int:
    """``Tensor.storage_offset()``: 0 for a tensor the program computes; for an input (whose offset a later call's
    tensor need not share: the cache does not key on it) or a view (whose offset fulmen does not track), an error
    naming the user's line rather than a made-up offset."""
    if a.view_of is None and a.origin not in ("input", "input-leaf"):
        return 0
    what = "a program input" if a.view_of is None else "a view"
    raise NotImplementedError(
        f"Tensor.storage_offset() of {a.name} ({a.type_string()}), {what}, is read inside a function fulmen "
        f"traces.\n  at {_user_location()}\nfulmen does not know where a traced input or view starts in its "
        "storage. Pass the offset in as an argument (x.storage_offset() read outside the compiled function), or "
        "index the tensor instead of using offsets into its storage.")


#: id(proxy) -> weak reference to it, for the program inputs (and captured tensors) that are inference tensors,
#: made under ``torch.inference_mode`` (by id: a proxy's ``==`` is the traced elementwise op)
_inference_inputs: dict[int, weakref.ref] = {}


def set_inference(p: TensorProxy) -> None:
    """Record that the input ``p`` stands for an inference tensor (the cache keys it so)."""
    key = id(p)
    _inference_inputs[key] = weakref.ref(p, lambda _, key=key: _inference_inputs.pop(key, None))


def is_inference(a: TensorProxy) -> bool:
    """``Tensor.is_inference()``: an input that is an inference tensor, and any view of one, as eager's; a value
    the program computes (and its views) is one when the call runs under ``torch.inference_mode`` (which the cache
    keys). A function that enters or leaves inference mode itself runs eagerly (``fulmen.frontend.tracing``'s
    ``RunsEagerly``), so no value reads otherwise."""
    base = a
    while base.view_of is not None:
        base = base.view_of[0]
    if base.origin in ("input", "input-leaf"):
        ref = _inference_inputs.get(id(base))
        return ref is not None and ref() is base
    return torch.is_inference_mode_enabled()


register_function((torch.Tensor.stride,), stride, method_names=("stride",))
register_function((torch.Tensor.is_inference,), is_inference, method_names=("is_inference",))
register_function((torch.Tensor.is_contiguous,), is_contiguous, method_names=("is_contiguous",))
register_function((torch.Tensor.dim_order,), dim_order, method_names=("dim_order",))
register_function((torch.Tensor.storage_offset,), storage_offset, method_names=("storage_offset",))


def memory_order(p: TensorProxy) -> list[int] | None:
    """The dims of ``p``, outermost first, in the order its elements lie in memory, when ``p`` is dense and
    non-overlapping but not contiguous: ``empty_like(p)`` keeps that layout, so eager fills a tensor made like
    ``p`` (a dropout mask) in that order. None when the order is the contiguous one, or not known."""
    strides = layout_of(p)
    if strides is None or any(type(n) is not int for n in (*strides, *p.shape)):
        return None
    inner_first = sorted((d for d in range(p.ndim) if p.shape[d] != 1), key=lambda d: strides[d])
    expected = 1
    for d in inner_first:
        if strides[d] != expected:
            return None  # overlapping or with gaps: empty_like makes it contiguous
        expected *= p.shape[d]
    outer_first = inner_first[::-1]
    if outer_first == sorted(outer_first):
        return None
    return outer_first + [d for d in range(p.ndim) if p.shape[d] == 1]


def laid_out_as_kernel(out: TensorProxy, input: TensorProxy, fns: tuple) -> TensorProxy:
    """``out`` (computed elementwise from ``input``, so laid out as it) in the layout eager's kernel of ``fns`` gives
    its result (``kernel_layouts``): where a symbol runs as its decomposition (under autodiff, in a fused region)
    its result must still have the strides the symbol's recorded output promises."""
    if layout_of(input) is None:  # a contiguous input: the elementwise result is contiguous, as the kernel's
        return out
    ruled = kernel_layouts.rule_strides(fns, (input,), {}, [tuple(out.shape)], strides_of)
    if not ruled or ruled[0] is None or ruled[0] == strides_of(input):
        return out
    ranks = sorted(range(out.ndim), key=lambda d: (ruled[0][d], -d))
    return prims.stride_order(out, tuple(ranks.index(d) for d in range(out.ndim)))


def dense(a: TensorProxy) -> TensorProxy:
    """``a`` laid out contiguously (``a.contiguous()`` as a kernel's decomposition writes it: no copy at run time
    when ``a`` is contiguous already), so that a reshape of it is a view whatever ``a``'s strides."""
    return prims.stride_order(a, tuple(range(a.ndim - 1, -1, -1)))


def bernoulli_like(a: TensorProxy, p: float, shape=None) -> TensorProxy:
    """A bernoulli(p) tensor of ``shape`` (default: ``a``'s) in ``a``'s dtype, drawn as eager draws into
    ``empty_like(a)``: laid out as a dense ``a`` is (transposed, channels_last) and filled in memory order, so a
    seeded run draws eager's numbers (ATen's dropout mask)."""
    shape = tuple(a.shape) if shape is None else tuple(shape)
    order = memory_order(a) if shape == tuple(a.shape) else None
    if order is None:
        return prims.bernoulli(shape, p, device=a.device, dtype=a.dtype)
    noise = prims.bernoulli(tuple(shape[d] for d in order), p, device=a.device, dtype=a.dtype)
    return clang.permute(noise, [order.index(d) for d in range(len(shape))])


def _set_strides(p: TensorProxy, strides: tuple[int, ...]) -> None:
    if p.view_of is not None:
        _view_strides[p.view_of[1]] = tuple(strides)
        return
    if tuple(strides) == contiguous_strides(p.shape):
        _strides.pop(id(p), None)
        return
    key = id(p)
    _strides[key] = (weakref.ref(p, lambda _, key=key: _strides.pop(key, None)), tuple(strides))


def set_strides(p: TensorProxy, strides: Sequence[int]) -> None:
    """Record the strides of ``p``: a program input, which has those of the tensor it stands for (the cache keys
    non-contiguous inputs by their strides), or the new value an in-place update gives a tensor, which keeps the
    tensor's; its views and copies are then decided as eager decides them."""
    _set_strides(p, tuple(int(s) for s in strides))


def _to_meta(x):
    if isinstance(x, TensorProxy):
        return with_lazy_bits(torch.empty_strided(tuple(x.shape), strides_of(x), dtype=x.dtype, device="meta"), x)
    if type(x) in (tuple, list):
        return type(x)(_to_meta(v) for v in x)
    return x


def _on_meta(fn, args, kwargs):
    """Run ``fn`` on meta tensors laid out as eager would lay out the proxies: (meta output, meta input 0).

    Torch function handling is off meanwhile: only meta tensors are involved, and the tracer's mode would
    otherwise see each of these calls, a second trip through the tracer for every view op traced. Inference mode
    is off too: under it torch records no view's base, and every view would be taken for a copy."""
    with torch._C.DisableTorchFunction(), torch.inference_mode(False):
        margs = [_to_meta(a) for a in args]
        return fn(*margs, **{k: _to_meta(v) for k, v in kwargs.items()}), margs[0]


def follow_input_layout(bsym: BoundSymbol) -> None:
    """After a torch-language op that makes new tensors is recorded: eager lays its results out by the op's own
    rule (an elementwise op as its inputs, a transposed input gives a transposed result; ``layer_norm``
    contiguous; ``sort`` as its input), which decides what a later ``view``/``reshape`` of them does. When some
    input is not contiguous, the results get the strides the op gives on meta tensors laid out as the inputs,
    replacing what the calls inside its decomposition gave them."""
    outs = bsym.output if isinstance(bsym.output, tuple) else (bsym.output,)
    if not all(isinstance(o, TensorProxy) and o.view_of is None and all(type(n) is int for n in o.shape)
               for o in outs):
        return
    # in argument order, lists included (torch.cat of channels_last tensors is channels_last)
    tensors = [a for a in tree_leaves((bsym.args, bsym.kwargs)) if isinstance(a, TensorProxy)]
    if any(a is o for a in tensors for o in outs) or all(layout_of(a) is None for a in tensors):
        return
    fns = (*bsym.sym.torch_fns, bsym.sym.id)
    ruled = kernel_layouts.rule_strides(fns, bsym.args, bsym.kwargs, [tuple(o.shape) for o in outs], strides_of)
    if ruled is not None:  # a kernel with a layout rule of its own (fulmen.torch.kernel_layouts)
        for o, strides in zip(outs, ruled):
            if strides is not None:
                _set_strides(o, strides)
        return
    strides = _iterator_strides(tensors, tuple(outs[0].shape)) if OpTags.ELEMENTWISE in bsym.sym.tags else None
    if strides is not None and len(outs) == 1:
        _set_strides(outs[0], strides)
        return
    try:  # fake kernels on the inputs' devices: they lay out results per device, as eager's kernels do
        mout = kernel_layouts.on_fake(bsym.sym.torch_fns[0], bsym.args, bsym.kwargs, strides_of, with_lazy_bits)
    except Exception:  # an argument fake tensors cannot take: the result stays taken to be contiguous
        return
    mouts = mout if isinstance(mout, tuple) else (mout,)
    if len(mouts) == len(outs) and all(isinstance(m, torch.Tensor) and tuple(m.shape) == tuple(o.shape)
                                       for m, o in zip(mouts, outs)):
        for m, o in zip(mouts, outs):
            _set_strides(o, m.stride())


def _iterator_strides(tensors: list[TensorProxy], shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The strides eager's pointwise kernels (TensorIterator) give a result of ``shape`` from ``tensors``, in
    argument order: the first operand whose strides order two dims decides, broadcast dims (stride 0) never do.
    Not torch's meta function of the op, which for some ops (``copysign``: a ``where`` on the sign of its second
    operand) is a decomposition that orders its operands otherwise. None where an operand does not broadcast to
    the result (``glu`` halves its input): the op is no pointwise iteration over its operands."""
    with torch._C.DisableTorchFunction():
        try:
            metas = [torch.empty_strided(tuple(a.shape), strides_of(a), device="meta").broadcast_to(shape)
                     for a in tensors if a.ndim]
        except RuntimeError:
            return None
        return tuple(compute_elementwise_output_strides(*metas)) if metas else contiguous_strides(shape)


follow_input_layout.layout_only = True  # a copy of a recorded call may stand in for it (fulmen.frontend.replay)


def _view_hook(bsym: BoundSymbol, unview=None) -> None:
    """After a view op is recorded: link its outputs to the input when eager would alias them, keep strides."""
    base = bsym.args[0] if bsym.args else None
    if not isinstance(base, TensorProxy):
        return
    sym = bsym.sym
    fn = sym.view_meta_fn or sym.torch_fns[0]
    try:
        if symbolic.in_use and contains_symbolic((bsym.args[1:], bsym.kwargs), shapes=False):
            # a symbolic int among the arguments (x[:n]): a meta tensor of exact sizes would specialize it
            raise ValueError("symbolic arguments")
        out, mbase = _on_meta(fn, bsym.args, bsym.kwargs)
    except Exception:  # eager layout unknown (e.g. an argument meta tensors cannot take): assume a plain view
        link_views(sym, bsym.args, bsym.kwargs, bsym.output, unview=unview)
        outs = bsym.output if isinstance(bsym.output, (tuple, list)) else (bsym.output,)
        if _symbolic(base) or any(isinstance(p, TensorProxy) and _symbolic(p) for p in outs):
            for p in outs:  # not taken to be contiguous: a read of the strides gives up the symbolic compilation
                if isinstance(p, TensorProxy) and p is not base and p.view_of is not None:
                    _view_strides[p.view_of[1]] = UNKNOWN
        return
    outs = bsym.output if isinstance(bsym.output, (tuple, list)) else (bsym.output,)
    mouts = out if isinstance(out, (tuple, list)) else (out,)
    with torch._C.DisableTorchFunction():  # meta tensors only (see _on_meta)
        layouts = [(p, m.stride(), m.is_conj(), m.is_neg(), m is mbase or m._base is mbase)
                   for p, m in zip(outs, mouts) if isinstance(p, TensorProxy) and isinstance(m, torch.Tensor)]
    if sym.always_alias or any(aliases for *_, aliases in layouts):
        link_views(sym, bsym.args, bsym.kwargs, bsym.output, unview=unview)
        if isinstance(bsym.output, (tuple, list)) and torch.is_grad_enabled() and not sym.separate_views:
            # autograd refuses in-place writes to the views a multi-view op (split, chunk, unbind) returns
            for p in bsym.output:
                if isinstance(p, TensorProxy) and p.requires_grad:
                    p.mark_multi_output_view()
    for p, strides, conj, neg, _ in layouts:
        if p is not base:
            _set_strides(p, strides)
            set_lazy_bits(p, conj, neg)


def _symbolic(p: TensorProxy) -> bool:
    return any(type(n) is not int for n in p.shape)


def check_viewable(fn, a: TensorProxy, *args, **kwargs) -> None:
    """Raise eager's error when ``a``'s strides do not allow the view (``x.t().view(-1)``)."""
    if strides_of(a) != contiguous_strides(a.shape):
        _on_meta(fn, (a, *args), kwargs)


def new_tensor(fn):
    """``fn`` whose result is never its input itself: eager's view ops return a new tensor even when nothing
    changes (``x.view(x.shape) is x`` is False), which under no_grad is a leaf that stops gradients to ``x``."""

    @functools.wraps(fn)
    def meta(*args, **kwargs):
        out = fn(*args, **kwargs)
        a = args[0] if args else None
        if not isinstance(a, TensorProxy):
            return out
        if out is a:
            return prims.reshape(a, tuple(a.shape))
        if isinstance(out, (tuple, list)) and any(o is a for o in out):
            return type(out)(prims.reshape(a, tuple(a.shape)) if o is a else o for o in out)
        return out

    return meta


def view_symbol(*torch_fns, meta_fn=None, always_alias: bool = False, unview=None, may_return_input: bool = False,
                separate_views: bool = False, **kwargs):
    """``torchsymbol(..., is_view=True)`` whose outputs alias the input exactly when eager's do.

    ``unview(new value of the view)`` gives the new value of the whole input, for views that a write cannot be
    scattered through element by element (a view with another dtype, as ``view_as_real``'s). The result is a new
    tensor, never the input itself, unless ``may_return_input`` (eager's ``flatten`` returns its input when there is
    nothing to flatten). ``separate_views``: the op returns several views that eager makes one view op each
    (``tensor_split``), which autograd lets be written in place.
    """

    def decorator(fn) -> Symbol:
        sym = torchsymbol(*torch_fns, is_view=True, **kwargs)(fn if may_return_input else new_tensor(fn))
        sym.post_hook = _view_hook if unview is None else lambda bsym: _view_hook(bsym, unview)
        sym.view_meta_fn, sym.always_alias, sym.separate_views = meta_fn, always_alias, separate_views
        return sym

    return decorator
