"""Torch language: matrix products (matmul, mm, bmm, mv, dot, outer, linear, addmm and friends), einsum, tensordot.

Each op checks its inputs with torch's messages, then lowers to ``prims.matmul`` / ``prims.linear`` with
shape ops around them. ``einsum`` contracts its operands pairwise, left to right (what torch does without
opt_einsum): diagonals of repeated subscripts, then sums of subscripts no one else needs, then one
batched matmul per pair.
"""

from __future__ import annotations

from numbers import Number

import torch

from fulmen import clang, prims
from fulmen.clang import maybe_convert_to_dtype
from fulmen.core import dtypes
from fulmen.core.dtypes import scalar_type_name
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import OpTags
from fulmen.core.utils import canonicalize_dim, check, prod
from fulmen.torch.registry import torchsymbol
from fulmen.torch.views import strides_of, view_symbol

__all__ = [
    "matmul", "mm", "bmm", "mv", "dot", "vdot", "outer", "linear", "addmm", "addmv", "baddbmm", "addbmm",
    "einsum", "tensordot",
]

_MM = (OpTags.MATMUL_OP,)


# ---- checks with torch's messages ----

def _check_tensors(op: str, *tensors) -> None:
    for t in tensors:
        check(isinstance(t, TensorProxy), lambda: f"{op}(): expected tensors, but got {type(t).__name__}", TypeError)


def _check_not_bool(op: str, *tensors) -> None:
    for t in tensors:
        check(t.dtype is not torch.bool, lambda: f'"{op}" not implemented for \'Bool\'', NotImplementedError)


def _check_same_dtype(a: TensorProxy, b: TensorProxy) -> None:
    check(a.dtype == b.dtype, lambda: f"expected m1 and m2 to have the same dtype, but got: "
          f"{scalar_type_name(a.dtype).lower()} != {scalar_type_name(b.dtype).lower()}", RuntimeError)


def _check_expandable(t: TensorProxy, shape: tuple[int, ...]) -> None:
    """torch's error when ``t`` (the ``input`` of addmm and friends) cannot expand to the result's shape."""
    check(t.ndim <= len(shape), lambda: f"The expanded size of the tensor must have at least {t.ndim} dims, but the "
          f"target sizes {list(shape)} have {len(shape)}", RuntimeError)
    offset = len(shape) - t.ndim
    for i in range(t.ndim - 1, -1, -1):
        d = i + offset
        check(t.shape[i] in (1, shape[d]), lambda: f"The expanded size of the tensor ({shape[d]}) must match the "
              f"existing size ({t.shape[i]}) at non-singleton dimension {d}.  Target sizes: {list(shape)}.  "
              f"Tensor sizes: {list(t.shape)}", RuntimeError)


def _scale_factors(op: str, input: TensorProxy, beta: Number, alpha: Number) -> tuple[Number, Number]:
    """Integer tensors take integer beta/alpha: torch converts the Python numbers to the tensor's type."""
    for name, v in (("beta", beta), ("alpha", alpha)):
        check(isinstance(v, Number) and not isinstance(v, complex),
              lambda: f"{op}(): argument '{name}' must be a real number, but got {v!r}", TypeError)
    if dtypes.is_exact_dtype(input.dtype):
        return int(beta), int(alpha)
    return beta, alpha


def _add_scaled(input: TensorProxy, product: TensorProxy, beta: Number, alpha: Number) -> TensorProxy:
    """beta * input + alpha * product; with beta == 0 the input is ignored (its NaNs do not propagate)."""
    out = product if alpha == 1 else clang.mul(product, alpha)
    if beta == 0:
        return out
    term = clang.expand_to(input, out.shape)
    term = term if beta == 1 else clang.mul(term, beta)
    return clang.add(term, out)


# ---- products ----

@torchsymbol(torch.matmul, torch.Tensor.matmul, method_name="matmul", tags=_MM)
def matmul(input, other):
    """torch.matmul: dot, matrix-vector, matrix-matrix or broadcast batched products, by the operands' ranks."""
    _check_tensors("matmul", input, other)
    check(input.ndim >= 1 and other.ndim >= 1, lambda: f"both arguments to matmul need to be at least 1D, but they "
          f"are {input.ndim}D and {other.ndim}D", RuntimeError)
    if input.ndim == 1 and other.ndim == 1:
        return dot(input, other)
    if other.ndim == 1:
        rows = prod(input.shape[:-1])
        check(input.shape[-1] == other.shape[0], lambda: f"size mismatch, got input ({rows}), mat ({rows}x"
              f"{input.shape[-1]}), vec ({other.shape[0]})", RuntimeError)
    elif input.ndim <= 2 or other.ndim == 2:
        rows = 1 if input.ndim == 1 else prod(input.shape[:-1])
        k = input.shape[-1]
        check(k == other.shape[-2], lambda: f"mat1 and mat2 shapes cannot be multiplied ({rows}x{k} and "
              f"{other.shape[-2]}x{other.shape[-1]})", RuntimeError)
    _check_same_dtype(input, other)
    _check_not_bool("matmul", input, other)
    return prims.matmul(input, other)


def matmul_folds_a_copy(input, other) -> TensorProxy | None:
    """The operand of ``torch.matmul(input, other)`` that eager's backward never reads, having saved a copy: with one
    operand of 3 or more dims and the other of 1 or 2 that requires grad, eager folds the larger one's batch into
    its rows with ``reshape`` (mT first when it is ``other``), which copies when the batch dims cannot be merged
    as a view (a transposed batch). A later in-place write into that operand then leaves eager's backward
    working."""
    if not (isinstance(input, TensorProxy) and isinstance(other, TensorProxy)):
        return None
    if input.ndim >= 3 and other.ndim <= 2:
        larger, smaller, transposed = input, other, False
    elif other.ndim >= 3 and input.ndim <= 2:
        larger, smaller, transposed = other, input, True
    else:
        return None
    if not smaller.requires_grad or not all(isinstance(n, int) for n in larger.shape):
        return None
    shape, strides = list(larger.shape), list(strides_of(larger))
    if transposed:
        shape[-2:], strides[-2:] = shape[:-3:-1], strides[:-3:-1]
    folded = torch.empty_strided(shape, strides, device="meta")
    try:
        folded.view(-1, shape[-1])
    except RuntimeError:  # reshape copies
        return larger
    return None


@torchsymbol(torch.mm, torch.Tensor.mm, method_name="mm", tags=_MM)
def mm(input, mat2):
    """Matrix product of two 2-D tensors."""
    _check_tensors("mm", input, mat2)
    check(input.ndim == 2, lambda: "self must be a matrix", RuntimeError)
    check(mat2.ndim == 2, lambda: "mat2 must be a matrix", RuntimeError)
    check(input.shape[1] == mat2.shape[0], lambda: f"mat1 and mat2 shapes cannot be multiplied ({input.shape[0]}x"
          f"{input.shape[1]} and {mat2.shape[0]}x{mat2.shape[1]})", RuntimeError)
    _check_same_dtype(input, mat2)
    _check_not_bool("mm", input, mat2)
    return prims.matmul(input, mat2)


def _check_bmm(op: str, batch1, batch2) -> None:
    check(batch1.ndim == 3, lambda: "batch1 must be a 3D tensor", RuntimeError)
    check(batch2.ndim == 3, lambda: "batch2 must be a 3D tensor", RuntimeError)
    want = [batch1.shape[0], batch1.shape[2]]
    check(list(batch2.shape[:2]) == want, lambda: f"Expected size for first two dimensions of batch2 tensor to be: "
          f"{want} but got: {list(batch2.shape[:2])}.", RuntimeError)
    check(batch1.dtype == batch2.dtype, lambda: f"expected scalar type {scalar_type_name(batch1.dtype)} but found "
          f"{scalar_type_name(batch2.dtype)}", RuntimeError)
    _check_not_bool(op, batch1, batch2)


@torchsymbol(torch.bmm, torch.Tensor.bmm, method_name="bmm", tags=_MM)
def bmm(input, mat2):
    """Batched matrix product of two 3-D tensors with equal batch sizes."""
    _check_tensors("bmm", input, mat2)
    _check_bmm("bmm", input, mat2)
    return prims.matmul(input, mat2)


def _check_mv(input_len, mat, vec) -> None:
    check(mat.ndim == 2 and vec.ndim == 1, lambda: f"vector + matrix @ vector expected, got 1, {mat.ndim}, "
          f"{vec.ndim}", RuntimeError)
    check(mat.shape[1] == vec.shape[0] and input_len in (1, mat.shape[0]),
          lambda: f"size mismatch, got input ({input_len}), mat ({mat.shape[0]}x{mat.shape[1]}), vec ({vec.shape[0]})",
          RuntimeError)
    check(mat.dtype == vec.dtype, lambda: f"addmv input tensors must have the same dtype, but got "
          f"{scalar_type_name(mat.dtype)} and {scalar_type_name(vec.dtype)}", RuntimeError)
    _check_not_bool("addmv", mat, vec)


@torchsymbol(torch.mv, torch.Tensor.mv, method_name="mv", tags=_MM)
def mv(input, vec):
    """Matrix-vector product."""
    _check_tensors("mv", input, vec)
    _check_mv(input.shape[0] if input.ndim else 1, input, vec)
    return prims.matmul(input, vec)


@torchsymbol(torch.dot, torch.Tensor.dot, method_name="dot", tags=_MM)
def dot(input, tensor):
    """Inner product of two 1-D tensors of one length and dtype."""
    _check_tensors("dot", input, tensor)
    check(input.ndim == 1 and tensor.ndim == 1, lambda: f"1D tensors expected, but got {input.ndim}D and "
          f"{tensor.ndim}D tensors", RuntimeError)
    check(input.shape[0] == tensor.shape[0], lambda: f"inconsistent tensor size, expected tensor [{input.shape[0]}] "
          f"and src [{tensor.shape[0]}] to have the same number of elements, but got {input.shape[0]} and "
          f"{tensor.shape[0]} elements respectively", RuntimeError)
    check(input.dtype == tensor.dtype, lambda: f"dot : expected both vectors to have same dtype, but found "
          f"{scalar_type_name(input.dtype)} and {scalar_type_name(tensor.dtype)}", RuntimeError)
    _check_not_bool("dot", input, tensor)
    return prims.matmul(input, tensor)


@torchsymbol(torch.vdot, torch.Tensor.vdot, method_name="vdot", tags=_MM)
def vdot(input, other):
    """dot(conj(input), other): for real tensors, dot."""
    _check_tensors("vdot", input, other)
    if dtypes.is_complex_dtype(input.dtype):
        input = prims.conj(input)
    return dot(input, other)


@torchsymbol(torch.outer, torch.Tensor.outer, torch.ger, torch.Tensor.ger, method_name=("outer", "ger"), tags=_MM)
def outer(input, vec2):
    """input[i] * vec2[j], with torch's type promotion."""
    _check_tensors("outer", input, vec2)
    check(input.ndim == 1, lambda: f"outer: Expected 1-D argument self, but got {input.ndim}-D", RuntimeError)
    check(vec2.ndim == 1, lambda: f"outer: Expected 1-D argument vec2, but got {vec2.ndim}-D", RuntimeError)
    return clang.mul(clang.unsqueeze(input, 1), vec2)


@torchsymbol(torch.nn.functional.linear, id="torch.nn.functional.linear", tags=_MM)
def linear(input, weight, bias=None):
    """input @ weight.T + bias."""
    _check_tensors("linear", input, weight)
    check(input.ndim >= 1 and weight.ndim >= 1, lambda: f"both arguments to linear need to be at least 1D, but they "
          f"are {input.ndim}D and {weight.ndim}D", RuntimeError)
    if bias is not None:
        _check_tensors("linear", bias)
        out_shape = tuple(input.shape[:-1]) + ((weight.shape[0],) if weight.ndim == 2 else ())
        _check_expandable(bias, out_shape)
    return prims.linear(input, weight, bias)


@torchsymbol(torch.addmm, torch.Tensor.addmm, method_name="addmm", tags=_MM)
def addmm(input, mat1, mat2, *, beta: Number = 1, alpha: Number = 1):
    """beta * input + alpha * (mat1 @ mat2); input broadcasts to the product's shape."""
    _check_tensors("addmm", input, mat1, mat2)
    check(mat1.ndim == 2, lambda: f"mat1 must be a matrix, got {mat1.ndim}-D tensor", RuntimeError)
    check(mat2.ndim == 2, lambda: f"mat2 must be a matrix, got {mat2.ndim}-D tensor", RuntimeError)
    check(mat1.shape[1] == mat2.shape[0], lambda: f"mat1 and mat2 shapes cannot be multiplied ({mat1.shape[0]}x"
          f"{mat1.shape[1]} and {mat2.shape[0]}x{mat2.shape[1]})", RuntimeError)
    _check_expandable(input, (mat1.shape[0], mat2.shape[1]))
    check(input.dtype == mat2.dtype, lambda: f"self and mat2 must have the same dtype, but got "
          f"{scalar_type_name(input.dtype)} and {scalar_type_name(mat2.dtype)}", RuntimeError)
    _check_same_dtype(mat1, mat2)
    _check_not_bool("addmm", mat1, mat2)
    beta, alpha = _scale_factors("addmm", input, beta, alpha)
    return _add_scaled(input, prims.matmul(mat1, mat2), beta, alpha)


@torchsymbol(torch.addmv, torch.Tensor.addmv, method_name="addmv", tags=_MM)
def addmv(input, mat, vec, *, beta: Number = 1, alpha: Number = 1):
    """beta * input + alpha * (mat @ vec)."""
    _check_tensors("addmv", input, mat, vec)
    check(input.ndim <= 1, lambda: f"vector + matrix @ vector expected, got {input.ndim}, {mat.ndim}, {vec.ndim}",
          RuntimeError)
    _check_mv(input.shape[0] if input.ndim else 1, mat, vec)
    check(input.dtype == mat.dtype, lambda: f"addmv input tensors must have the same dtype, but got "
          f"{scalar_type_name(input.dtype)}, {scalar_type_name(mat.dtype)}, and {scalar_type_name(vec.dtype)}",
          RuntimeError)
    beta, alpha = _scale_factors("addmv", input, beta, alpha)
    return _add_scaled(input, prims.matmul(mat, vec), beta, alpha)


@torchsymbol(torch.baddbmm, torch.Tensor.baddbmm, method_name="baddbmm", tags=_MM)
def baddbmm(input, batch1, batch2, *, beta: Number = 1, alpha: Number = 1):
    """beta * input + alpha * bmm(batch1, batch2)."""
    _check_tensors("baddbmm", input, batch1, batch2)
    _check_bmm("baddbmm", batch1, batch2)
    _check_expandable(input, (batch1.shape[0], batch1.shape[1], batch2.shape[2]))
    check(input.dtype == batch1.dtype, lambda: f"expected scalar type {scalar_type_name(batch1.dtype)} but found "
          f"{scalar_type_name(input.dtype)}", RuntimeError)
    beta, alpha = _scale_factors("baddbmm", input, beta, alpha)
    return _add_scaled(input, prims.matmul(batch1, batch2), beta, alpha)


@torchsymbol(torch.addbmm, torch.Tensor.addbmm, method_name="addbmm", tags=_MM)
def addbmm(input, batch1, batch2, *, beta: Number = 1, alpha: Number = 1):
    """beta * input + alpha * sum_b batch1[b] @ batch2[b], as one (n, b*m) @ (b*m, p) product."""
    _check_tensors("addbmm", input, batch1, batch2)
    check(batch1.ndim == 3, lambda: "batch1 must be a 3D tensor", RuntimeError)
    check(batch2.ndim == 3, lambda: "batch2 must be a 3D tensor", RuntimeError)
    b, n, m = batch1.shape
    check(batch2.shape[0] == b, lambda: f"batch1 and batch2 must have same number of batches, got {b} and "
          f"{batch2.shape[0]}", RuntimeError)
    check(batch2.shape[1] == m, lambda: f"Incompatible matrix sizes for bmm ({n}x{m} and {batch2.shape[1]}x"
          f"{batch2.shape[2]})", RuntimeError)
    p = batch2.shape[2]
    _check_expandable(input, (n, p))
    check(input.dtype == batch1.dtype == batch2.dtype, lambda: f"expected scalar type {scalar_type_name(input.dtype)} "
          f"but found {scalar_type_name(batch2.dtype if batch1.dtype == input.dtype else batch1.dtype)}", RuntimeError)
    _check_not_bool("addbmm", batch1, batch2)
    beta, alpha = _scale_factors("addbmm", input, beta, alpha)
    lhs = clang.reshape(clang.permute(batch1, (1, 0, 2)), (n, b * m))
    return _add_scaled(input, prims.matmul(lhs, clang.reshape(batch2, (b * m, p))), beta, alpha)


# ---- tensordot ----

def _sum_keepdim(a, dim: int):
    shape = list(a.shape)
    shape[dim] = 1
    return clang.reshape(prims.sum(a, (dim,)), shape)


@torchsymbol(torch.tensordot, tags=_MM)
def tensordot(a, b, dims=2, out=None):
    """Contract the last ``dims`` dims of ``a`` with the first of ``b``, or the dims listed in ``dims``."""
    _check_tensors("tensordot", a, b)
    check(out is None, lambda: "tensordot(): out= is not supported inside fulmen.jit", NotImplementedError)
    if isinstance(dims, int) and not isinstance(dims, bool):
        check(dims >= 0, lambda: f"tensordot expects dims >= 0, but got dims={dims}", RuntimeError)
        check(dims <= a.ndim and dims <= b.ndim, lambda: f"tensordot expects dims < ndim_a or ndim_b, but got "
              f"dims={dims}", RuntimeError)
        dims_a, dims_b = list(range(a.ndim - dims, a.ndim)), list(range(dims))
    else:
        check(isinstance(dims, (tuple, list)) and len(dims) == 2, lambda: f"tensordot expects dims to be an int or "
              f"a pair of dim lists, but got {dims!r}", TypeError)
        dims_a, dims_b = ([d] if isinstance(d, int) else list(d) for d in dims)
    check(len(dims_a) == len(dims_b), lambda: "both dimension lists should have same length", RuntimeError)
    check(a.dtype == b.dtype, lambda: "both inputs should have same dtype", RuntimeError)
    dims_a = [canonicalize_dim(a.ndim, d) for d in dims_a]
    dims_b = [canonicalize_dim(b.ndim, d) for d in dims_b]
    for da, db in zip(dims_a, dims_b):
        # a contracted dim of size 1 on one side broadcasts: eager sums the other side over it first
        if b.shape[db] == 1:
            a = _sum_keepdim(a, da)
        elif a.shape[da] == 1:
            b = _sum_keepdim(b, db)
        else:
            check(a.shape[da] == b.shape[db], lambda: f"contracted dimensions need to match, but first has size "
                  f"{a.shape[da]} in dim {da} and second has size {b.shape[db]} in dim {db}", RuntimeError)
    free_a = [d for d in range(a.ndim) if d not in dims_a]
    free_b = [d for d in range(b.ndim) if d not in dims_b]
    k = prod(a.shape[d] for d in dims_a)
    lhs = clang.reshape(clang.permute(a, free_a + dims_a), (prod(a.shape[d] for d in free_a), k))
    rhs = clang.reshape(clang.permute(b, dims_b + free_b), (k, prod(b.shape[d] for d in free_b)))
    out_shape = [a.shape[d] for d in free_a] + [b.shape[d] for d in free_b]
    return clang.reshape(prims.matmul(lhs, rhs), out_shape)


# ---- einsum ----

_LETTERS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _sublist_equation(args) -> tuple[str, list]:
    """einsum(op0, sub0, op1, sub1, ..., [sub_out]) -> ("ab,bc->ac", [op0, op1])."""
    def letters(sub):
        out = ""
        for s in sub:
            if s is Ellipsis:
                out += "..."
            else:
                check(isinstance(s, int) and 0 <= s < 52, lambda: f"einsum(): subscript in subscript list is not "
                      f"within the valid range [0, 52), got {s!r}", RuntimeError)
                out += chr(ord("A") + s) if s < 26 else chr(ord("a") + s - 26)
        return out

    operands, terms = list(args[0::2]), [letters(s) for s in args[1::2]]
    if len(args) % 2 == 1:  # an odd count ends with the output subscripts
        operands = operands[:-1]
        return ",".join(terms) + "->" + letters(args[-1]), operands
    return ",".join(terms), operands


def _parse_term(term: str, number: int, offset: int) -> tuple[list[str], bool]:
    """Labels of one operand's subscripts; "..." becomes the marker "...". Returns (labels, has_ellipsis)."""
    labels: list[str] = []
    i, has_ellipsis = 0, False
    while i < len(term):
        c = term[i]
        if c == ".":
            check(not has_ellipsis, lambda: f"einsum(): found '.' for operand {number} for which an ellipsis was "
                  "already found", RuntimeError)
            check(term[i:i + 3] == "...", lambda: f"einsum(): found '.' for operand {number} that is not part of any "
                  "ellipsis", RuntimeError)
            labels.append("...")
            has_ellipsis = True
            i += 3
            continue
        check(c in _LETTERS, lambda: f"einsum(): invalid subscript given at index {offset + i} in the equation string, "
              "subscripts must be in [a-zA-Z]", RuntimeError)
        labels.append(c)
        i += 1
    return labels, has_ellipsis


def _diagonal(t: TensorProxy, labels: list[str], number: int) -> tuple[TensorProxy, list[str]]:
    """Take the diagonal over every subscript repeated within one operand ("ii->i")."""
    while len(set(labels)) != len(labels):
        label = next(lb for lb in labels if labels.count(lb) > 1)
        where = [i for i, lb in enumerate(labels) if lb == label]
        n = t.shape[where[0]]
        for w in where[1:]:
            check(t.shape[w] == n, lambda: f"einsum(): subscript {label} is repeated for operand {number} but the "
                  f"sizes don't match, {t.shape[w]} != {n}", RuntimeError)
        rest = [i for i in range(t.ndim) if i not in where]
        k = len(where)
        # In the flattened n**k block the diagonal entries are 1 + n + ... + n**(k-1) apart.
        step = (n ** k - 1) // (n - 1) if n > 1 else 1
        t = clang.reshape(clang.permute(t, rest + where), [t.shape[i] for i in rest] + [n ** k])
        t = clang.slice_in_dim(t, 0, n ** k, step, dim=t.ndim - 1)
        labels = [labels[i] for i in rest] + [label]
    return t, labels


def _sum_labels(t: TensorProxy, labels: list[str], drop: set[str]) -> tuple[TensorProxy, list[str]]:
    """Sum out the dims whose labels are in ``drop`` (integers sum to int64, as torch.sum does)."""
    dims = tuple(i for i, lb in enumerate(labels) if lb in drop)
    if not dims:
        return t, labels
    result = torch.int64 if dtypes.is_exact_dtype(t.dtype) else t.dtype
    acc = torch.float32 if dtypes.is_low_precision_dtype(result) else result
    out = maybe_convert_to_dtype(prims.sum(maybe_convert_to_dtype(t, acc), dims), result)
    return out, [lb for lb in labels if lb not in drop]


def _contract_pair(a, la, b, lb, keep: set[str], sizes: dict[str, int]):
    """Multiply two labelled operands, summing the labels they share that ``keep`` does not need: one ``bmm``, or
    one ``mul`` when nothing is summed, as eager's einsum calls them (so CPU autocast, which casts bmm and not mul,
    casts the same ones: ``fulmen.transforms.autocast.CPU_COMPOSITES``)."""
    batch = [lb_ for lb_ in la if lb_ in lb and lb_ in keep]
    summed = [lb_ for lb_ in la if lb_ in lb and lb_ not in keep]
    only_a = [lb_ for lb_ in la if lb_ not in lb]
    only_b = [lb_ for lb_ in lb if lb_ not in la]

    def arrange(t, labels, order):
        t = clang.permute(t, [labels.index(x) for x in order])
        # A length-1 dim broadcasts against the other operand's length (torch allows this in einsum).
        full = [sizes[x] if x in batch or x in summed else t.shape[i] for i, x in enumerate(order)]
        return clang.expand_to(t, full)

    a = arrange(a, la, batch + only_a + summed)
    b = arrange(b, lb, batch + summed + only_b)
    nb, ns = len(batch), len(summed)
    bsz = [a.shape[i] for i in range(nb)]
    m_sz, n_sz = list(a.shape[nb:a.ndim - ns]), list(b.shape[nb + ns:])
    k = prod(a.shape[a.ndim - ns:])
    lhs = clang.reshape(a, (prod(bsz), prod(m_sz), k))
    rhs = clang.reshape(b, (prod(bsz), k, prod(n_sz)))
    product = bmm(lhs, rhs) if summed else _mul(lhs, rhs)
    out = clang.reshape(product, bsz + m_sz + n_sz)
    return out, batch + only_a + only_b


def _mul(a, b):
    from fulmen.torch.elementwise import mul  # the torch-language op, recorded as eager's einsum calls it

    return mul(a, b)


def _einsum_args(equation, operands) -> tuple[str, list[str], tuple]:
    """The equation without spaces, its input terms and the operands, checked as eager checks them."""
    if isinstance(equation, TensorProxy):  # the sublist form: einsum(op0, [0, 1], op1, [1, 2], [0, 2])
        equation, operands = _sublist_equation((equation,) + operands)
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    check(isinstance(equation, str), lambda: f"einsum(): the equation must be a string, got {equation!r}", TypeError)
    check(len(operands) > 0, lambda: "einsum(): must provide at least one operand", RuntimeError)
    _check_tensors("einsum", *operands)
    eq = equation.replace(" ", "")
    terms = eq.partition("->")[0].split(",")
    check(len(terms) <= len(operands), lambda: "einsum(): fewer operands were provided than specified in the equation",
          RuntimeError)
    check(len(terms) >= len(operands), lambda: "einsum(): more operands were provided than specified in the equation",
          RuntimeError)
    for t in operands[1:]:
        check(t.dtype == operands[0].dtype, lambda: f"expected scalar type {scalar_type_name(operands[0].dtype)} but "
              f"found {scalar_type_name(t.dtype)}", RuntimeError)
    return eq, terms, operands


def _parsed_terms(terms: list[str], operands) -> tuple[list, list[str]]:
    """Each term's labels with how many dims its "..." stands for, and the labels of the broadcast "..." dims."""
    parsed, offset = [], 0
    for number, (term, t) in enumerate(zip(terms, operands)):
        labels, has_ellipsis = _parse_term(term, number, offset)
        offset += len(term) + 1
        n_sub = len(labels) - has_ellipsis
        if has_ellipsis:
            check(n_sub <= t.ndim, lambda: f"einsum(): the number of subscripts in the equation ({n_sub}) is more than "
                  f"the number of dimensions ({t.ndim}) for operand {number}", RuntimeError)
        else:
            check(n_sub == t.ndim, lambda: f"einsum(): the number of subscripts in the equation ({n_sub}) does not "
                  f"match the number of dimensions ({t.ndim}) for operand {number} and no ellipsis was given",
                  RuntimeError)
        parsed.append((labels, t.ndim - n_sub))
    n_ell = max(e for _, e in parsed) if any("..." in lb for lb, _ in parsed) else 0
    return parsed, [f"...{j}" for j in range(n_ell)]  # right-aligned across operands, as broadcasting is


def _labelled_operands(parsed: list, ell_labels: list[str], operands) -> tuple[list, dict]:
    """(operand with repeated labels reduced to diagonals, its labels) each, and the size of every label."""
    ops, sizes, n_ell = [], {}, len(ell_labels)
    for number, ((labels, e), t) in enumerate(zip(parsed, operands)):
        if "..." in labels:
            at = labels.index("...")
            labels = labels[:at] + ell_labels[n_ell - e:] + labels[at + 1:]
        t, labels = _diagonal(t, labels, number)
        for lb, s in zip(labels, t.shape):
            seen = sizes.get(lb, 1)
            check(s == 1 or seen == 1 or s == seen, lambda: f"einsum(): subscript {lb} has size {s} for operand "
                  f"{number} which does not broadcast with previously seen size {seen}", RuntimeError)
            sizes[lb] = s if seen == 1 else seen
        ops.append((t, labels))
    return ops, sizes


def _output_labels(eq: str, terms: list[str], ell_labels: list[str], sizes: dict) -> list[str]:
    """The output's labels: those after "->", or (implicit form) "..." then the labels used once, sorted."""
    lhs, arrow, rhs = eq.partition("->")
    if not arrow:
        counts: dict[str, int] = {}
        for lb in "".join(terms).replace(".", ""):
            counts[lb] = counts.get(lb, 0) + 1
        return ell_labels + sorted(lb for lb, c in counts.items() if c == 1)
    out_labels, out_has_ellipsis = _parse_term(rhs, -1, len(lhs) + 2)
    if out_has_ellipsis:
        at = out_labels.index("...")
        out_labels = out_labels[:at] + ell_labels + out_labels[at + 1:]
    for lb in out_labels:
        check(lb in sizes, lambda: f"einsum(): output subscript {lb} does not appear in the equation for any input "
              "operand", RuntimeError)
        check(out_labels.count(lb) == 1, lambda: f"einsum(): output subscript {lb} appears more than once in the "
              "output", RuntimeError)
    return out_labels


@torchsymbol(torch.einsum, tags=_MM)
def einsum(equation, *operands):
    """Einstein summation: "bij,bjk->bik", implicit outputs, "..." broadcasting and repeated subscripts (diagonals)."""
    flat = operands[0] if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else operands
    if len(flat) == 1 and isinstance(flat[0], TensorProxy):
        return einsum_of_one(flat[0], equation)
    return _einsum(equation, operands)


@view_symbol(id="ltorch.einsum_of_one", tags=_MM, torch_executable=False,
             meta_fn=lambda a, equation: torch.einsum(equation, a))
def einsum_of_one(a, equation):
    """``torch.einsum`` of one operand, which eager answers with a view of it when nothing is summed ("ij->ji",
    "ii->i"): a write through the result reaches the operand, as in eager (the view hook asks torch which)."""
    return _einsum(equation, (a,))


def _einsum(equation, operands):
    eq, terms, operands = _einsum_args(equation, operands)
    parsed, ell_labels = _parsed_terms(terms, operands)
    ops, sizes = _labelled_operands(parsed, ell_labels, operands)
    out_labels = _output_labels(eq, terms, ell_labels, sizes)
    out_set = set(out_labels)
    # Sum out, per operand, the labels neither the output nor any other operand mentions.
    for i, (t, labels) in enumerate(ops):
        others = {lb for j, (_, ls) in enumerate(ops) if j != i for lb in ls}
        ops[i] = _sum_labels(t, labels, {lb for lb in labels if lb not in out_set and lb not in others})
    t, labels = ops[0]
    for i in range(1, len(ops)):
        keep = out_set | {lb for _, ls in ops[i + 1:] for lb in ls}
        t, labels = _contract_pair(t, labels, *ops[i], keep, sizes)
    t, labels = _sum_labels(t, labels, {lb for lb in labels if lb not in out_set})
    perm = [labels.index(lb) for lb in out_labels]
    if any(t is op for op in operands):  # "ij->ij": torch returns a view of the operand; so does the trace
        return prims.transpose(t, perm)
    return clang.permute(t, perm)
