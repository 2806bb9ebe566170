"""Gradients eager PyTorch defines by convention rather than by the chain rule alone.

- Complex inputs: for a holomorphic f, PyTorch's gradient is ``g * conj(f'(z))``; every VJP rule that multiplies
  the cotangent by a derivative conjugates it for complex dtypes (and adds nothing to real traces).
- Norms at zero: ``vector_norm``, ``std``, ``F.normalize`` and ``cosine_similarity`` decompose into sqrt or
  pow(s, 1 / p), whose derivative at 0 is infinite; eager masks the gradient there to 0, and so does fulmen.

Every comparison runs fulmen's own backward (``compile="sync"``, two calls) against eager autograd.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fulmen

C128 = torch.complex128
TIGHT = dict(rtol=1e-10, atol=1e-12)


def _randn(*shape, dtype=C128, seed=0):
    return torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def _assert_grads_match_eager(f, args, *, exact=False, gradcheck=True):
    """fulmen's backward (first and second call) equals eager's, for one random cotangent; then gradcheck."""
    eager_in = [a.clone().requires_grad_() for a in args]
    out = f(*eager_in)
    ct = _randn(*out.shape, dtype=out.dtype, seed=1)
    expected = torch.autograd.grad(out, eager_in, ct, allow_unused=True)
    expected = [torch.zeros_like(a) if e is None else e for a, e in zip(args, expected)]
    jf = fulmen.jit(f, compile="sync", executors=["torch"])
    for call in range(2):
        inputs = [a.clone().requires_grad_() for a in args]
        actual = torch.autograd.grad(jf(*inputs), inputs, ct)
        for i, (a, e) in enumerate(zip(actual, expected)):
            tol = dict(rtol=0, atol=0) if exact else TIGHT if e.dtype in (torch.float64, C128) else {}
            torch.testing.assert_close(a, e, **tol, equal_nan=True,
                                       msg=lambda m: f"call {call}, gradient {i}: {m}")
    if gradcheck:
        assert torch.autograd.gradcheck(jf, [a.clone().requires_grad_() for a in args])


# ---------------------------------------------------------------------------------------------------------
# complex gradients: the conjugate

_Z = (_randn(3, seed=2),)
_ZZ = (_randn(3, seed=3), _randn(3, seed=4))
COMPLEX_CASES = {
    "view_as_complex_mul": (lambda a: torch.view_as_real(torch.view_as_complex(a) * 2j),
                            (torch.tensor([[1.0, 2.0]], dtype=torch.float64),)),
    "mul": (torch.mul, _ZZ),
    "mul_complex_number": (lambda a: a * (2 - 3j), _Z),
    "div": (torch.div, _ZZ),
    "number_div": (lambda a: (1 + 2j) / a, _Z),
    "real_times_complex": (lambda x, z: x * z, (_randn(3, dtype=torch.float64, seed=5), _randn(3, seed=6))),
    "chain": (lambda a, b: (a.exp() * b).sin() / (a + 2), _ZZ),
    "pow": (torch.pow, _ZZ),
    "pow_number": (lambda a: a ** 3, _Z),
    "pow_complex_number": (lambda a: a ** (0.5 + 1j), _Z),
    "number_pow": (lambda a: 2.0 ** a, _Z),
    "negative_number_pow": (lambda a: (-2.0) ** a, _Z),
    "complex_number_pow": (lambda a: (1 + 1j) ** a, _Z),
    "matmul": (torch.matmul, (_randn(2, 3, seed=7), _randn(3, 4, seed=8))),
    "matmul_batched": (torch.matmul, (_randn(2, 2, 3, seed=9), _randn(3, 4, seed=10))),
    "matmul_vectors": (torch.matmul, (_randn(3, seed=11), _randn(3, seed=12))),
    "matmul_matrix_vector": (torch.matmul, (_randn(2, 3, seed=13), _randn(3, seed=14))),
    "linear": (F.linear, (_randn(2, 3, seed=15), _randn(4, 3, seed=16), _randn(4, seed=17))),
    "conv1d": (F.conv1d, (_randn(1, 2, 5, seed=18), _randn(3, 2, 2, seed=19), _randn(3, seed=20))),
    "abs": (torch.abs, _Z),
    "abs_of_rfft": (lambda a: torch.fft.rfft(a).abs().sum(), (_randn(6, dtype=torch.float64, seed=21),)),
    "real_imag": (lambda a: torch.real(a * a) + torch.imag(a).exp(), _Z),
    "cumsum": (lambda a: (a * a).cumsum(0), _Z),
    "complex_std_norm": (lambda a: a.std(1) + torch.linalg.vector_norm(a, 3, 1), (_randn(2, 3, seed=22),)),
}
COMPLEX_CASES.update({name: (getattr(torch, name), _Z) for name in (
    "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sin", "cos", "tan", "asin", "acos", "atan", "sinh",
    "cosh", "tanh", "asinh", "acosh", "atanh", "sqrt", "rsqrt", "reciprocal", "sigmoid", "square")})


@pytest.mark.parametrize("name", list(COMPLEX_CASES))
def test_complex_gradients_match_eager(name):
    f, args = COMPLEX_CASES[name]
    _assert_grads_match_eager(f, args)


def test_complex_multiplication_gradient_after_the_warm_start_call():
    # the default (async) mode runs eager autograd on the first call and fulmen's backward from the second
    def f(a):
        return torch.view_as_real(torch.view_as_complex(a) * 2j)

    jf = fulmen.jit(f, executors=["torch"])
    for _ in range(2):
        a = torch.tensor([[1.0, 2.0]], requires_grad=True)
        (g,) = torch.autograd.grad(jf(a), a, torch.tensor([[1.0, 0.0]]))
    assert g.tolist() == [[0.0, -2.0]]


def test_real_backward_traces_have_no_conjugate():
    def f(a, b):
        return (torch.sin(a * b) / b).exp() @ a.T

    jf = fulmen.jit(f, compile="sync", executors=["torch"])
    a, b = torch.randn(3, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)
    jf(a, b).sum().backward()
    assert "conj" not in str(fulmen.last_backward_traces(jf)[-1])


# ---------------------------------------------------------------------------------------------------------
# norms and standard deviations at zero

ORDS = [2, 1, math.inf, -math.inf, 0, 3, 1.5, 0.5, -1]
DIMS = [(None, False), (1, False), ((0, 2), True)]


def _zero_rows(dtype, seed=0):
    """A (2, 3, 4) tensor with whole slices of zeros along each dim: some norms 0, some not."""
    x = _randn(2, 3, 4, dtype=dtype, seed=seed)
    x[1] = 0
    x[:, 1] = 0
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, C128], ids=str)
@pytest.mark.parametrize("ord", ORDS, ids=str)
def test_vector_norm_gradient_at_zero_matches_eager(ord, dtype):
    for dim, keepdim in DIMS:
        def f(a):
            return torch.linalg.vector_norm(a, ord, dim, keepdim)

        _assert_grads_match_eager(f, (torch.zeros(2, 3, 4, dtype=dtype),), exact=True, gradcheck=False)
        _assert_grads_match_eager(f, (_zero_rows(dtype),), gradcheck=False)


@pytest.mark.parametrize("dtype", [torch.float64, C128], ids=str)
@pytest.mark.parametrize("ord", [2, 1, 3, 1.5], ids=str)
def test_vector_norm_gradcheck(ord, dtype):
    for dim, keepdim in DIMS:
        _assert_grads_match_eager(lambda a: torch.linalg.vector_norm(a, ord, dim, keepdim),
                                  (_randn(2, 3, 4, dtype=dtype),))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_norm_forms_at_zero_match_eager(dtype):
    zero = torch.zeros(2, 3, dtype=dtype)
    for f in (lambda a: a.norm(), lambda a: torch.norm(a, p=3, dim=1), lambda a: torch.norm(a, dim=0, keepdim=True),
              lambda a: torch.linalg.vector_norm(a, dtype=torch.float64)):
        _assert_grads_match_eager(f, (zero,), exact=True, gradcheck=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, C128], ids=str)
@pytest.mark.parametrize("name", ["std", "std_mean"])
def test_std_gradient_at_zero_matches_eager(name, dtype):
    def f(a, correction, dim, keepdim):
        if name == "std":
            return torch.std(a, dim, correction=correction, keepdim=keepdim)
        std, mean = torch.std_mean(a, dim, correction=correction, keepdim=keepdim)
        return std * 2 + (mean.abs() if mean.is_complex() else mean)

    for correction, dim, keepdim in ((1, None, False), (0, 1, False), (1, 1, True), (2, (0, 1), False)):
        def fn(a):
            return f(a, correction, dim, keepdim)

        constant_rows = _randn(3, 4, dtype=dtype)
        constant_rows[1] = 2.0
        _assert_grads_match_eager(fn, (torch.zeros(3, 4, dtype=dtype),), exact=True, gradcheck=False)
        _assert_grads_match_eager(fn, (constant_rows,), gradcheck=False)
        if dtype is not torch.float32:
            _assert_grads_match_eager(fn, (_randn(3, 4, dtype=dtype),))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_normalize_and_cosine_similarity_at_zero_match_eager(dtype):
    x = _randn(3, 4, dtype=dtype)
    x[1] = 0
    for p in (2, 1, 3, math.inf):
        _assert_grads_match_eager(lambda a: F.normalize(a, p=p, dim=1), (x,), gradcheck=False)
    _assert_grads_match_eager(lambda a: F.cosine_similarity(a, a.flip(0)), (x,), gradcheck=False)
    _assert_grads_match_eager(lambda a: F.cosine_similarity(a, a), (torch.zeros(2, 3, dtype=dtype),), exact=True,
                              gradcheck=False)
    if dtype is torch.float64:
        _assert_grads_match_eager(lambda a: F.normalize(a, dim=1), (_randn(3, 4, dtype=dtype),))
        _assert_grads_match_eager(lambda a: F.cosine_similarity(a, a.flip(0) * 2 + 1), (_randn(3, 4, dtype=dtype),))
