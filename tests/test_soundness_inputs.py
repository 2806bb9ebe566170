"""Unusual inputs: NumPy arrays and scalars as operands (as eager treats them: results, dtypes and errors), and
tensor kinds fulmen does not compile (nested, quantized), which raise a NotImplementedError naming the argument."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fulmen

ARRAY = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
ARRAY64 = np.linspace(-2, 2, 4)  # float64
INTS = np.arange(1, 5)  # int64
BOOLS = np.array([True, False, True, True])

# expressions of x (a float32 tensor of shape (3, 4)), xi (int64) and xb (bool); each is compared with eager
NUMPY_CASES = [
    "x * np.float32(2)", "x + np.bool_(True)", "xi + np.bool_(True)", "xb + np.bool_(False)", "x + np.int64(3)",
    "xi * np.float32(2)", "xi * np.float16(2)", "xi.to(torch.int8) + np.int64(300)", "x.half() * np.float64(2)",
    "np.float32(2) * x", "np.int64(3) - x", "np.float64(0.5) / xi", "x.reshape(np.int64(4), 3)",
    "x.sum(np.int64(0))", "x[np.int64(1)]", "torch.full((2,), np.bool_(True))", "torch.full((2,), np.int32(1))",
    "torch.where(xb, np.float32(1), x)", "torch.clamp(xi, np.float32(0.5))",
    "torch.as_tensor(ARRAY) + x", "torch.tensor(ARRAY) + x", "torch.from_numpy(ARRAY) + x",
    "torch.as_tensor(INTS, dtype=torch.float64)", "torch.tensor(ARRAY64, dtype=torch.float32)",
    "torch.tensor(np.bool_(True))", "torch.tensor(np.float32(1.5))", "torch.tensor([np.float32(1), 2])",
    "torch.tensor([np.bool_(True), np.bool_(False)])", "torch.as_tensor(np.float64(2))",
    "x + ARRAY", "x + ARRAY64", "xi + ARRAY64", "x - INTS", "x / INTS", "xi / INTS", "xi // INTS", "x % INTS",
    "x ** INTS", "x * np.array(2.0)", "x[0] @ np.ones((4, 2))", "x == ARRAY", "x != ARRAY", "ARRAY == x", "xi + INTS",
    "x.half() + ARRAY64",
    # eager raises on these; fulmen must raise too
    "ARRAY + x", "x < ARRAY", "torch.add(x, ARRAY)", "x.sub(ARRAY)", "x.bfloat16() + ARRAY64",
    "x.sum(0, keepdim=np.bool_(True))",
]


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=g)
    return x, torch.randint(-3, 4, (3, 4), generator=g), torch.rand(3, 4, generator=g) > 0.5


def _run(expr: str, compiled: bool):
    namespace = {"torch": torch, "np": np, "ARRAY": ARRAY, "ARRAY64": ARRAY64, "INTS": INTS, "BOOLS": BOOLS}
    fn = eval(f"lambda x, xi, xb: {expr}", namespace)
    if compiled:
        fn = fulmen.jit(fn, executors=["torch"])
    try:
        return fn(*_inputs())
    except Exception as e:
        return e


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("expr", NUMPY_CASES)
def test_numpy_operands_match_eager(expr):
    expected, got = _run(expr, False), _run(expr, True)
    if isinstance(expected, Exception):
        assert isinstance(got, Exception), f"eager raised {type(expected).__name__}: {expected}; fulmen returned {got}"
        return
    assert not isinstance(got, Exception), f"fulmen raised {type(got).__name__}: {got}"
    assert type(got) is type(expected)
    if not isinstance(expected, torch.Tensor):  # eager's tensor != array is Python's identity test
        assert got == expected
        return
    assert got.dtype == expected.dtype and got.shape == expected.shape and got.device == expected.device
    assert got.requires_grad == expected.requires_grad
    torch.testing.assert_close(got, expected, equal_nan=True)


def test_a_numpy_array_requires_grad_tensor_raises_as_eager():
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="requires grad"):
        x + ARRAY64
    with pytest.raises(RuntimeError, match="requires grad"):
        fulmen.jit(lambda x: x + ARRAY64, executors=["torch"])(x)


def test_numpy_array_argument_and_later_writes_to_it():
    # the array is read on every call (its memory is a captured input), as eager reads it on every call
    a = np.arange(4, dtype=np.float64)

    def f(x, arr):
        return x + arr, torch.as_tensor(arr) * 2

    jitted = fulmen.jit(f, executors=["torch"])
    x = torch.ones(4)
    for _ in range(2):
        for got, expected in zip(jitted(x, a), f(x, a)):
            assert got.dtype == expected.dtype
            torch.testing.assert_close(got, expected)
        a += 10
    other = np.full(4, -1.0)
    torch.testing.assert_close(jitted(x, other)[0], f(x, other)[0])


def test_numpy_global_array_rebound_is_seen():
    namespace = {"torch": torch, "W": np.ones(3)}
    exec("def f(x):\n    return x * W\n", namespace)
    f = namespace["f"]
    jitted = fulmen.jit(f, executors=["torch"])
    x = torch.randn(3)
    torch.testing.assert_close(jitted(x), f(x))
    namespace["W"] = np.full(3, 5.0)
    torch.testing.assert_close(jitted(x), f(x))


def test_numpy_scalar_argument_values_are_keyed():
    jitted = fulmen.jit(lambda x, s: x * s, executors=["torch"])
    x = torch.randn(3)
    for s in (np.float32(2), np.float32(3), np.bool_(True), np.int64(4)):
        expected = x * s
        got = jitted(x, s)
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected)


def test_np_asarray_of_a_traced_tensor_is_a_clear_error():
    with pytest.raises(fulmen.DataDependentError, match="NumPy"):
        fulmen.jit(lambda x: torch.as_tensor(np.asarray(x)) + 1, executors=["torch"])(torch.randn(3))


# ---- tensor kinds fulmen does not compile: a NotImplementedError naming the argument and the way out ----


def _nested():
    return torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])


def _quantized():
    return torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.quint8)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("make, kind, way_out", [(_nested, "nested", "to_padded_tensor"),
                                                 (_quantized, "quantized", "dequantize")])
def test_unsupported_tensor_arguments_raise_clearly(make, kind, way_out):
    def f(x, scale):
        return x * scale

    def g(xs):
        return xs[0] * 2

    for fn, args, name in ((f, (make(), 2.0), r"argument x"), (g, ([make()],), r"argument xs(\[0\]|_0)")):
        with pytest.raises(NotImplementedError, match=rf"{name} is a {kind} tensor.*{way_out}"):
            fulmen.jit(fn, executors=["torch"])(*args)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("make, kind", [(_nested, "nested"), (_quantized, "quantized")])
def test_unsupported_tensors_in_a_module_call_raise_clearly(make, kind):
    class M(torch.nn.Module):
        def forward(self, inp):
            return inp * 2

    with pytest.raises(NotImplementedError, match=f"argument inp is a {kind} tensor"):
        fulmen.jit(M(), executors=["torch"])(make())


@pytest.mark.filterwarnings("ignore")
def test_a_nested_tensor_read_from_a_global_raises_clearly():
    namespace = {"G": _nested()}
    exec("def h(x):\n    return G * x\n", namespace)
    with pytest.raises(NotImplementedError, match="global or closure variable is a nested tensor"):
        fulmen.jit(namespace["h"], executors=["torch"])(torch.tensor(2.0))
