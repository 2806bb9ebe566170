"""OpInfos for the linear-algebra ops of ``fulmen/torch/linalg.py`` (matmul, mm, bmm, mv, dot, outer, linear,
addmm, addmv, baddbmm, addbmm, tensordot, einsum)."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

import fulmen.torch as ltorch
from fulmen.tests.opinfos.base import OpInfo, SampleInput, make_tensor

__all__ = []  # filled at the end with every ``<op>_opinfo``

_MM_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)
_MM = {"dtypes": _MM_DTYPES, "cuda_dtypes": (torch.float32, torch.float64, torch.bfloat16)}  # no int64 cuBLAS


def _maker(device, dtype, requires_grad, **kwargs):
    grad = requires_grad and (dtype.is_floating_point or dtype.is_complex)
    return partial(make_tensor, device=device, dtype=dtype, requires_grad=grad, **kwargs)


# Small magnitudes keep bfloat16 products and sums representable to within a few units in the last place.
def _mm_maker(device, dtype, requires_grad, **kwargs):
    return _maker(device, dtype, requires_grad, low=-3, high=3, **kwargs)


# bfloat16: the decomposition rounds the product before scaling and adding (torch's gemm rounds once).
_MM_TOL = {torch.bfloat16: (2e-2, 5e-2)}


def matmul_samples(op, device, dtype, requires_grad, **kwargs):
    make = _mm_maker(device, dtype, requires_grad)
    for sa, sb in (((4,), (4,)), ((3, 4), (4,)), ((4,), (4, 5)), ((3, 4), (4, 5)), ((2, 3, 4), (4, 5)),
                   ((2, 3, 4), (4,)), ((5,), (2, 5, 3)), ((2, 1, 3, 4), (5, 4, 2)), ((3, 4), (2, 4, 5)),
                   ((0, 4), (4, 3)), ((3, 0), (0, 5)), ((2, 0, 3), (3, 4))):
        yield SampleInput(make(sa), make(sb))
    yield SampleInput(make((4, 3), noncontiguous=True), make((3, 5), noncontiguous=True))
    yield SampleInput(make((5, 3)).mT, make((2, 5, 4)))


def matmul_errors(op, device, **kwargs):
    make = partial(make_tensor, device=device, dtype=torch.float32)
    yield (SampleInput(make(()), make((3, 4))), RuntimeError,
           "both arguments to matmul need to be at least 1D, but they are 0D and 2D")
    yield SampleInput(make((3, 4)), make((3, 4))), RuntimeError, r"shapes cannot be multiplied \(3x4 and 3x4\)"
    yield SampleInput(make((3, 4)), make((3,))), RuntimeError, r"size mismatch, got input \(3\), mat \(3x4\), vec \(3\)"
    yield SampleInput(make((4,)), make((3,))), RuntimeError, "inconsistent tensor size"
    yield (SampleInput(make((3, 4)), make((4, 2), dtype=torch.float64)), RuntimeError,
           "expected m1 and m2 to have the same dtype, but got: float != double")
    yield (SampleInput(make((2, 3, 4)), make((5, 4, 2))), RuntimeError,
           r"The size of tensor a \(2\) must match the size of tensor b \(5\)")


matmul_opinfo = OpInfo(ltorch.matmul, sample_input_generator=matmul_samples, error_input_generator=matmul_errors,
                       torch_reference=torch.matmul, **_MM, tolerance=_MM_TOL)


def mm_samples(op, device, dtype, requires_grad, **kwargs):
    make = _mm_maker(device, dtype, requires_grad)
    yield SampleInput(make((3, 4)), make((4, 5)))
    yield SampleInput(make((3, 4), noncontiguous=True), make((5, 4)).mT)
    yield SampleInput(make((0, 4)), make((4, 2)))
    yield SampleInput(make((2, 0)), make((0, 3)))


def mm_errors(op, device, **kwargs):
    make = partial(make_tensor, device=device, dtype=torch.float32)
    yield SampleInput(make((4,)), make((4, 3))), RuntimeError, "self must be a matrix"
    yield SampleInput(make((3, 4)), make((4,))), RuntimeError, "mat2 must be a matrix"
    yield SampleInput(make((3, 4)), make((3, 4))), RuntimeError, r"mat1 and mat2 shapes cannot be multiplied \(3x4 and"
    yield (SampleInput(make((3, 4)), make((4, 2), dtype=torch.float64)), RuntimeError,
           "expected m1 and m2 to have the same dtype")
    yield (SampleInput(make((3, 4), dtype=torch.bool), make((4, 2), dtype=torch.bool)), NotImplementedError,
           "not implemented for 'Bool'")


mm_opinfo = OpInfo(ltorch.mm, sample_input_generator=mm_samples, error_input_generator=mm_errors,
                   torch_reference=torch.mm, **_MM, tolerance=_MM_TOL)


def bmm_samples(op, device, dtype, requires_grad, **kwargs):
    make = _mm_maker(device, dtype, requires_grad)
    yield SampleInput(make((2, 3, 4)), make((2, 4, 5)))
    yield SampleInput(make((2, 3, 4), noncontiguous=True), make((2, 5, 4)).mT)
    yield SampleInput(make((0, 3, 4)), make((0, 4, 2)))
    yield SampleInput(make((2, 3, 0)), make((2, 0, 4)))


def bmm_errors(op, device, **kwargs):
    make = partial(make_tensor, device=device, dtype=torch.float32)
    yield SampleInput(make((3, 4)), make((2, 4, 3))), RuntimeError, "batch1 must be a 3D tensor"
    yield SampleInput(make((2, 3, 4)), make((4, 3))), RuntimeError, "batch2 must be a 3D tensor"
    yield (SampleInput(make((2, 3, 4)), make((3, 4, 5))), RuntimeError,
           r"Expected size for first two dimensions of batch2 tensor to be: \[2, 4\] but got: \[3, 4\]")
    yield (SampleInput(make((2, 3, 4)), make((2, 4, 5), dtype=torch.float64)), RuntimeError,
           "expected scalar type Float but found Double")


bmm_opinfo = OpInfo(ltorch.bmm, sample_input_generator=bmm_samples, error_input_generator=bmm_errors,
                    torch_reference=torch.bmm, **_MM, tolerance=_MM_TOL)


def mv_samples(op, device, dtype, requires_grad, **kwargs):
    make = _mm_maker(device, dtype, requires_grad)
    yield SampleInput(make((3, 4)), make((4,)))
    yield SampleInput(make((3, 4), noncontiguous=True), make((4,), noncontiguous=True))
    yield SampleInput(make((0, 4)), make((4,)))
    yield SampleInput(make((3, 0)), make((0,)))


def mv_errors(op, device, **kwargs):
    make = partial(make_tensor, device=device, dtype=torch.float32)
    yield SampleInput(make((3, 4)), make((3, 4))), RuntimeError, "vector \\+ matrix @ vector expected, got 1, 2, 2"
    yield SampleInput(make((3, 4)), make((3,))), RuntimeError, r"size mismatch, got input \(3\), mat \(3x4\), vec \(3\)"


mv_opinfo = OpInfo(ltorch.mv, sample_input_generator=mv_samples, error_input_generator=mv_errors,
                   torch_reference=torch.mv, **_MM, tolerance=_MM_TOL)


def dot_samples(op, device, dtype, requires_grad, **kwargs):
    make = _mm_maker(device, dtype, requires_grad)
    yield SampleInput(make((5,)), make((5,)))
    yield SampleInput(make((5,), noncontiguous=True), make((5,), noncontiguous=True))
    yield SampleInput(make((0,)), make((0,)))


def dot_errors(op, device, **kwargs):
    make = partial(make_tensor, device=device, dtype=torch.float32)
    yield SampleInput(make((3, 4)), make((4,))), RuntimeError, "1D tensors expected, but got 2D and 1D tensors"
    yield SampleInput(make((3,)), make((4,))), RuntimeError, r"inconsistent tensor size, expected tensor \[3\]"
    yield (SampleInput(make((3,)), make((3,), dtype=torch.float64)), RuntimeError,
           "dot : expected both vectors to have same dtype, but found Float and Double")


dot_opinfo = OpInfo(ltorch.dot, sample_input_generator=dot_samples, error_input_generator=dot_errors,
                    torch_reference=torch.dot, **_MM, tolerance=_MM_TOL)
vdot_opinfo = OpInfo(ltorch.vdot, sample_input_generator=dot_samples, error_input_generator=dot_errors,
                     torch_reference=torch.vdot, dtypes=(torch.float32, torch.float64, torch.int64),
                     cuda_dtypes=(torch.float32, torch.float64))


def outer_samples(op, device, dtype, requires_grad, **kwargs):
    make = _mm_maker(device, dtype, requires_grad)
    yield SampleInput(make((3,)), make((4,)))
    yield SampleInput(make((3,), noncontiguous=True), make((0,)))
    yield SampleInput(make((1,)), make((5,), noncontiguous=True))
    yield SampleInput(make((2,)), make_tensor((3,), device=device, dtype=torch.int64, low=-3, high=3))


def outer_errors(op, device, **kwargs):
    make = partial(make_tensor, device=device, dtype=torch.float32)
    yield SampleInput(make((3, 4)), make((4,))), RuntimeError, "outer: Expected 1-D argument self, but got 2-D"
    yield SampleInput(make((3,)), make(())), RuntimeError, "outer: Expected 1-D argument vec2, but got 0-D"


outer_opinfo = OpInfo(ltorch.outer, sample_input_generator=outer_samples, error_input_generator=outer_errors,
                      torch_reference=torch.outer, dtypes=_MM_DTYPES)


def linear_samples(op, device, dtype, requires_grad, **kwargs):
    make = _mm_maker(device, dtype, requires_grad)
    yield SampleInput(make((3, 4)), make((5, 4)))
    yield SampleInput(make((3, 4)), make((5, 4)), make((5,)))
    yield SampleInput(make((2, 3, 4), noncontiguous=True), make((5, 4)), bias=make((1,)))
    yield SampleInput(make((4,)), make((5, 4)), make((5,)))
    yield SampleInput(make((3, 4)), make((4,)))
    yield SampleInput(make((0, 4)), make((2, 4)), make((2,)))
    yield SampleInput(make((3, 4)), make((4, 5)).mT, make((5,)))


def linear_errors(op, device, **kwargs):
    make = partial(make_tensor, device=device, dtype=torch.float32)
    yield SampleInput(make((3, 4)), make((5, 3))), RuntimeError, r"mat1 and mat2 shapes cannot be multiplied \(3x4"
    yield (SampleInput(make(()), make((5, 3))), RuntimeError,
           "both arguments to linear need to be at least 1D, but they are 0D and 2D")
    yield (SampleInput(make((3, 4)), make((5, 4)), make((3,))), RuntimeError,
           r"The expanded size of the tensor \(5\) must match the existing size \(3\) at non-singleton dimension 1")
    yield (SampleInput(make((3, 4)), make((5, 4), dtype=torch.float64)), RuntimeError,
           "expected m1 and m2 to have the same dtype")


linear_opinfo = OpInfo(ltorch.linear, sample_input_generator=linear_samples, error_input_generator=linear_errors,
                       torch_reference=F.linear, dtypes=(torch.float32, torch.float64, torch.bfloat16),
                       tolerance=_MM_TOL)


def _add_product_samples(op, device, dtype, requires_grad, *, shapes):
    """Samples for addmm/addmv/baddbmm/addbmm: (input shape, first operand, second operand)."""
    make = _mm_maker(device, dtype, requires_grad)
    fractional = dtype.is_floating_point
    for si, s1, s2 in shapes:
        yield SampleInput(make(si), make(s1), make(s2))
    si, s1, s2 = shapes[0]
    yield SampleInput(make(si, noncontiguous=True), make(s1, noncontiguous=True), make(s2), beta=2, alpha=3)
    yield SampleInput(make(si), make(s1), make(s2), beta=0.5 if fractional else 2, alpha=-1.5 if fractional else 0)
    yield SampleInput(make(()), make(s1), make(s2), alpha=2)  # input broadcasts to the product
    if fractional:  # beta=0 ignores the input entirely: its NaNs do not propagate
        yield SampleInput(torch.full(si, float("nan"), device=device, dtype=dtype), make(s1), make(s2), beta=0)


def addmm_samples(op, device, dtype, requires_grad, **kwargs):
    yield from _add_product_samples(op, device, dtype, requires_grad,
                                    shapes=(((3, 5), (3, 4), (4, 5)), ((5,), (3, 4), (4, 5)), ((3, 1), (3, 0), (0, 1))))


def addmm_errors(op, device, **kwargs):
    make = partial(make_tensor, device=device, dtype=torch.float32)
    yield SampleInput(make((3, 3)), make((3, 4)), make((3, 4))), RuntimeError, "mat1 and mat2 shapes cannot be"
    yield SampleInput(make((3,)), make((3,)), make((3, 4))), RuntimeError, "mat1 must be a matrix, got 1-D tensor"
    yield (SampleInput(make((2, 4)), make((3, 5)), make((5, 4))), RuntimeError,
           r"The expanded size of the tensor \(3\) must match the existing size \(2\) at non-singleton dimension 0")
    yield (SampleInput(make((3, 4), dtype=torch.float64), make((3, 5)), make((5, 4))), RuntimeError,
           "self and mat2 must have the same dtype, but got Double and Float")


addmm_opinfo = OpInfo(ltorch.addmm, sample_input_generator=addmm_samples, error_input_generator=addmm_errors,
                      torch_reference=torch.addmm, **_MM, tolerance=_MM_TOL)


def addmv_samples(op, device, dtype, requires_grad, **kwargs):
    yield from _add_product_samples(op, device, dtype, requires_grad,
                                    shapes=(((3,), (3, 4), (4,)), ((1,), (3, 4), (4,)), ((2,), (2, 0), (0,))))


def addmv_errors(op, device, **kwargs):
    make = partial(make_tensor, device=device, dtype=torch.float32)
    yield (SampleInput(make((3,)), make((3, 4)), make((3,))), RuntimeError,
           r"size mismatch, got input \(3\), mat \(3x4\), vec \(3\)")
    yield (SampleInput(make((3, 1)), make((3, 4)), make((4,))), RuntimeError,
           "vector \\+ matrix @ vector expected, got 2, 2, 1")


addmv_opinfo = OpInfo(ltorch.addmv, sample_input_generator=addmv_samples, error_input_generator=addmv_errors,
                      torch_reference=torch.addmv, **_MM, tolerance=_MM_TOL)


def baddbmm_samples(op, device, dtype, requires_grad, **kwargs):
    yield from _add_product_samples(op, device, dtype, requires_grad, shapes=(
        ((2, 3, 5), (2, 3, 4), (2, 4, 5)), ((3, 5), (2, 3, 4), (2, 4, 5)), ((2, 1, 1), (2, 1, 0), (2, 0, 1))))


def baddbmm_errors(op, device, **kwargs):
    make = partial(make_tensor, device=device, dtype=torch.float32)
    yield SampleInput(make((3, 3)), make((3, 4)), make((2, 4, 3))), RuntimeError, "batch1 must be a 3D tensor"
    yield (SampleInput(make((2, 3, 3)), make((2, 3, 4)), make((2, 3, 4))), RuntimeError,
           "Expected size for first two dimensions of batch2 tensor")
    yield (SampleInput(make((2, 3, 3)), make((2, 3, 4)), make((2, 4, 4))), RuntimeError,
           r"The expanded size of the tensor \(4\) must match the existing size \(3\) at non-singleton dimension 2")


baddbmm_opinfo = OpInfo(ltorch.baddbmm, sample_input_generator=baddbmm_samples, error_input_generator=baddbmm_errors,
                        torch_reference=torch.baddbmm, **_MM, tolerance=_MM_TOL)


def addbmm_samples(op, device, dtype, requires_grad, **kwargs):
    yield from _add_product_samples(op, device, dtype, requires_grad, shapes=(
        ((3, 5), (2, 3, 4), (2, 4, 5)), ((5,), (2, 3, 4), (2, 4, 5)), ((3, 2), (0, 3, 4), (0, 4, 2))))


def addbmm_errors(op, device, **kwargs):
    make = partial(make_tensor, device=device, dtype=torch.float32)
    yield (SampleInput(make((3, 3)), make((2, 3, 4)), make((3, 4, 3))), RuntimeError,
           "batch1 and batch2 must have same number of batches, got 2 and 3")
    yield (SampleInput(make((3, 3)), make((2, 3, 4)), make((2, 3, 3))), RuntimeError,
           r"Incompatible matrix sizes for bmm \(3x4 and 3x3\)")
    yield SampleInput(make((3, 3)), make((3, 4)), make((2, 4, 3))), RuntimeError, "batch1 must be a 3D tensor"


addbmm_opinfo = OpInfo(ltorch.addbmm, sample_input_generator=addbmm_samples, error_input_generator=addbmm_errors,
                       torch_reference=torch.addbmm, **_MM, tolerance=_MM_TOL)


def einsum_samples(op, device, dtype, requires_grad, **kwargs):
    make = _mm_maker(device, dtype, requires_grad)
    cases = (
        ("ij,jk->ik", (3, 4), (4, 5)),
        ("ij,jk", (3, 4), (4, 5)),  # implicit output: subscripts seen once, sorted
        ("bij,bjk->bik", (2, 3, 4), (2, 4, 5)),
        ("bij,bkj->bik", (2, 3, 4), (2, 5, 4)),
        ("bhqd,bhkd->bhqk", (2, 2, 3, 4), (2, 2, 5, 4)),
        ("ij->ji", (3, 4)),
        ("ij->", (3, 4)),
        ("ij", (3, 4)),
        ("i,i->", (5,), (5,)),
        ("i,j->ij", (3,), (4,)),
        ("ij,ij->ij", (3, 4), (3, 4)),
        ("ii->i", (3, 3)),  # diagonal
        ("ii", (4, 4)),  # trace
        ("iij->j", (3, 3, 2)),
        ("...ij->...ji", (2, 3, 4)),
        ("...ij,...jk->...ik", (2, 3, 4), (4, 5)),  # ellipsis broadcasting
        ("b...,b...->b", (2, 3, 4), (2, 1, 4)),
        ("ij,jk->ik", (3, 4), (1, 5)),  # a length-1 subscript broadcasts
        ("ij,jk,kl->il", (2, 3), (3, 4), (4, 5)),
        ("bn,anm,bm->ba", (2, 3), (4, 3, 5), (2, 5)),  # bilinear
        ("Ab,bA", (3, 4), (4, 3)),
        ("i j , k j -> i k", (3, 4), (5, 4)),
        ("->", ()),
        ("ij,jk", (2, 0), (0, 3)),
    )
    for eq, *shapes in cases:
        yield SampleInput(eq, *(make(s) for s in shapes))
    yield SampleInput("ij,jk->ik", make((4, 3), noncontiguous=True), make((5, 3)).mT)
    yield SampleInput(make((3, 4)), [0, 1], make((5, 4)), [2, 1], [0, 2])  # the sublist form


def einsum_errors(op, device, **kwargs):
    make = partial(make_tensor, device=device, dtype=torch.float32)
    a, b = make((3, 4)), make((4, 5))
    yield SampleInput("ij,jk", a), RuntimeError, "fewer operands were provided than specified in the equation"
    yield SampleInput("ij", a, a), RuntimeError, "more operands were provided than specified in the equation"
    yield SampleInput("i$", a), RuntimeError, r"invalid subscript given at index 1 in the equation string"
    yield SampleInput("i.j", a), RuntimeError, "found '.' for operand 0 that is not part of any ellipsis"
    yield (SampleInput("i", a), RuntimeError,
           r"the number of subscripts in the equation \(1\) does not match the number of dimensions \(2\)")
    yield (SampleInput("ij,jk->ik", a, a), RuntimeError,
           "subscript j has size 3 for operand 1 which does not broadcast with previously seen size 4")
    yield SampleInput("ij->k", a), RuntimeError, "output subscript k does not appear in the equation"
    yield SampleInput("ij->ii", a), RuntimeError, "output subscript i appears more than once in the output"
    yield SampleInput("ii->i", a), RuntimeError, "subscript i is repeated for operand 0 but the sizes don't match"
    yield SampleInput("ij,jk", a, b.double()), RuntimeError, "expected scalar type Float but found Double"


einsum_opinfo = OpInfo(ltorch.einsum, sample_input_generator=einsum_samples, error_input_generator=einsum_errors,
                       torch_reference=torch.einsum, **_MM, tolerance=_MM_TOL)


def tensordot_samples(op, device, dtype, requires_grad, **kwargs):
    make = _mm_maker(device, dtype, requires_grad)
    yield SampleInput(make((3, 4)), make((3, 4)))
    yield SampleInput(make((2, 3, 4)), make((4, 5)), 1)
    yield SampleInput(make((3, 4)), make((5, 6)), 0)
    yield SampleInput(make((3, 4, 5), noncontiguous=True), make((4, 3, 2)), dims=([0, 1], [1, 0]))
    yield SampleInput(make((3, 4)), make((5, 3)), ([0], [1]))


def tensordot_errors(op, device, **kwargs):
    make = partial(make_tensor, device=device, dtype=torch.float32)
    a = make((3, 4))
    yield SampleInput(a, a, -1), RuntimeError, "tensordot expects dims >= 0, but got dims=-1"
    yield SampleInput(a, a, 3), RuntimeError, "tensordot expects dims < ndim_a or ndim_b, but got dims=3"
    yield SampleInput(a, a, ([0], [0, 1])), RuntimeError, "both dimension lists should have same length"
    yield (SampleInput(a, make((5, 3)), ([0], [0])), RuntimeError,
           "contracted dimensions need to match, but first has size 3 in dim 0 and second has size 5 in dim 0")
    yield SampleInput(a, a.double(), 1), RuntimeError, "both inputs should have same dtype"


tensordot_opinfo = OpInfo(ltorch.tensordot, sample_input_generator=tensordot_samples,
                          error_input_generator=tensordot_errors, torch_reference=torch.tensordot, **_MM,
                          tolerance=_MM_TOL)

__all__ += [name for name in list(globals()) if name.endswith("_opinfo")]
