"""``torchsymbol``: how a torch callable becomes a symbol of the torch language."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fulmen.core import langctx
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, OpTags, Symbol
from fulmen.core.tracectx import get_tracectx

#: Every torch-language symbol by id (``"torch.add"``, ``"torch.nn.functional.relu"``, ``"torch.Tensor.view"``).
symbols_by_id: dict[str, Symbol] = {}
_NAMESPACES = (
    (torch, "torch"),
    (torch.nn.functional, "torch.nn.functional"),
    (torch.Tensor, "torch.Tensor"),
    (torch.linalg, "torch.linalg"),
    (torch.special, "torch.special"),
    (torch.fft, "torch.fft"),
)


def torch_id(fn: Callable) -> str:
    """The dotted name users know a torch callable by (``torch.nn.functional.cross_entropy``)."""
    if isinstance(fn, torch._ops.OpOverload):  # aten and torch.library custom ops
        return f"torch.ops.{fn.namespace}.{fn._opname}.{fn._overloadname}"
    if isinstance(fn, torch._ops.OpOverloadPacket):
        return f"torch.ops.{fn._qualified_op_name.replace('::', '.')}"
    name = getattr(fn, "__name__", None)
    for ns, prefix in _NAMESPACES:
        if name is not None and getattr(ns, name, None) is fn:
            return f"{prefix}.{name}"
    for ns, prefix in _NAMESPACES:
        for attr, value in vars(ns).items() if hasattr(ns, "__dict__") else ():
            if value is fn:
                return f"{prefix}.{attr}"
    qual = getattr(fn, "__qualname__", None) or repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}.{qual}" if module else qual


# ---- lazy bits: z.conj() and z.conj().imag are views that eager marks (conjugate, negative) instead of copying;
# fulmen computes their values physically, but which later ops alias or copy (resolve_conj, resolve_neg) and
# which writes reach the base depend on the marks, so proxies remember them (meta and fake tensors get them).


def lazy_bits(p: TensorProxy) -> tuple[bool, bool]:
    """(is_conj, is_neg) of the tensor eager PyTorch would have for ``p``."""
    return p.lazy_bits or (False, False)


def set_lazy_bits(p: TensorProxy, conj: bool, neg: bool) -> None:
    p.set_lazy_bits(conj, neg)


def with_lazy_bits(t: torch.Tensor, p: TensorProxy) -> torch.Tensor:
    """The meta or fake tensor ``t`` standing for ``p``, marked with ``p``'s bits."""
    conj, neg = lazy_bits(p)
    if conj:
        torch._C._set_conj(t, True)
    if neg:
        torch._C._set_neg(t, True)
    return t


def _record_view(bsym: BoundSymbol) -> None:
    """Remember that the output is a view of the first argument, so in-place updates reach the base."""
    link_views(bsym.sym, bsym.args, bsym.kwargs, bsym.output)


def link_views(sym: Symbol, args: tuple, kwargs: dict, output, which: Sequence[int] | None = None,
               unview: Callable | None = None) -> None:
    """Make ``output`` (the outputs at positions ``which`` of a tuple output; all when None) views of ``args[0]``:
    each is remade by calling ``sym`` on the base's new value after the base changes in place, and a write to
    it is scattered into the base (or given to ``unview``, see ``fulmen.torch.inplace.mutate``)."""
    base = args[0] if args else None
    if not isinstance(base, TensorProxy):
        return
    rest = args[1:]
    outs = output if isinstance(output, (tuple, list)) else (output,)
    for i, out in enumerate(outs):
        if not isinstance(out, TensorProxy) or out is base or (which is not None and i not in which):
            continue
        if isinstance(output, (tuple, list)):
            def remake(new_base, _i=i):
                return sym(new_base, *rest, **kwargs)[_i]
        else:
            def remake(new_base):
                return sym(new_base, *rest, **kwargs)
        if unview is not None:
            remake.unview = unview
        remake.view_call = (sym, rest, kwargs, i if isinstance(output, (tuple, list)) else None)  # fulmen.torch.overlap
        out.make_view_of(base, remake)


def torchsymbol(
    *torch_fns: Callable,
    id: str | None = None,
    method_name: str | Sequence[str] | None = None,
    property_name: str | None = None,
    tags: Sequence[OpTags] = (),
    is_view: bool = False,
    torch_executable: bool = True,
    normalize: Callable | None = None,
) -> Callable[[Callable], Symbol]:
    """Make ``fn`` (a decomposition into clang/prims) the torch-language symbol for ``torch_fns``.

    The symbol's id is the first torch callable's dotted name unless ``id`` is given. Calls of any of
    ``torch_fns`` on proxies, and the ``Tensor`` methods named by ``method_name``, come here. With
    ``torch_executable`` the torch executor runs the whole symbol as one call of ``torch_fns[0]``.
    """

    def decorator(fn: Callable) -> Symbol:
        sym_id = id or (torch_id(torch_fns[0]) if torch_fns else f"ltorch.{fn.__name__}")
        sym = Symbol(name=fn.__name__, meta=fn, id=sym_id, is_prim=False, tags=tuple(tags), module="ltorch",
                     torch_fns=tuple(torch_fns), post_hook=_record_view if is_view else None, normalize=normalize,
                     torch_executable=torch_executable and bool(torch_fns), doc=fn.__doc__ or "")
        if is_view:
            sym.tags = sym.tags + (OpTags.VIEW,)
        symbols_by_id[sym_id] = sym
        for tfn in torch_fns:
            langctx.torch_functions[tfn] = sym
        names = [method_name] if isinstance(method_name, str) else list(method_name or ())
        for name in names:
            langctx.methods[name] = sym
        if property_name:
            langctx.properties[property_name] = sym
        return sym

    return decorator


def register_function(torch_fns: Sequence[Callable], fn: Callable, *, method_names: Sequence[str] = ()) -> None:
    """Route torch callables to a plain function (not a symbol): in-place variants and Python-level helpers."""
    if method_names and all(n.endswith("_") and not n.endswith("__") for n in method_names):
        fn = _marking_start(fn)
    for tfn in torch_fns:
        langctx.torch_functions[tfn] = fn
    for name in method_names:
        langctx.methods[name] = fn


def _marking_start(fn: Callable) -> Callable:
    """``fn`` (an in-place variant) noting where in the trace the user's call began: autograd's check of values
    saved and then overwritten tells the op's own reads of the tensor it updates from earlier ones by it."""

    def inplace(*args, **kwargs):
        trc = get_tracectx()
        if trc is None or trc.inplace_start is not None or len(trc.scopes) != 1:
            return fn(*args, **kwargs)
        trc.inplace_start = len(trc.scopes[0])
        try:
            return fn(*args, **kwargs)
        finally:
            trc.inplace_start = None

    inplace.__name__, inplace.__qualname__, inplace.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    inplace.__wrapped__ = fn
    return inplace


def tensor_methods(*names: str) -> tuple:
    """``torch.Tensor`` attributes by name, skipping ones this torch build lacks."""
    return tuple(getattr(torch.Tensor, n) for n in names if hasattr(torch.Tensor, n))
