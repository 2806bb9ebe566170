"""Regressions found by running PyTorch's op_db through fulmen.jit (``benchmarks/op_db_coverage.py``): checks that
were stricter than eager's, and random ops that must draw eager's numbers exactly with the torch executor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.testing import clone_args, run_decomposed


def _jit(fn):
    return fulmen.jit(fn, executors=["torch"])


def _grads(out, inputs):
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if o.requires_grad]
    cotangents = [torch.linspace(-1, 1, o.numel(), dtype=o.dtype).reshape(o.shape) for o in outs]
    return torch.autograd.grad(outs, inputs, cotangents, allow_unused=True, materialize_grads=True)


def check_vs_eager(fn, *args, rtol=None, atol=None, grad=True):
    """fulmen.jit(fn) (torch executor) against eager: outputs and, for float inputs that require grad, gradients."""
    e_args, a_args = clone_args(args), clone_args(args)
    expected, actual = fn(*e_args), _jit(fn)(*a_args)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
    diff = [i for i, x in enumerate(args) if isinstance(x, torch.Tensor) and x.requires_grad]
    if grad and diff:
        torch.testing.assert_close(_grads(actual, [a_args[i] for i in diff]),
                                   _grads(expected, [e_args[i] for i in diff]), rtol=rtol, atol=atol,
                                   equal_nan=True)


# ---------------------------------------------------------------------------------------------------------
# checks no stricter than eager's


@pytest.mark.parametrize("op", ["gather", "scatter", "scatter_value", "scatter_add", "scatter_"])
def test_gather_scatter_int32_index(op):
    fns = {
        "gather": lambda x, i, s: torch.gather(x, 1, i),
        "scatter": lambda x, i, s: torch.scatter(x, 1, i, s),
        "scatter_value": lambda x, i, s: torch.scatter(x, 1, i, 2.5),
        "scatter_add": lambda x, i, s: torch.scatter_add(x, 1, i, s),
        "scatter_": lambda x, i, s: (x * 1).scatter_(1, i, s),
    }
    x = torch.randn(3, 5, requires_grad=True)
    src = torch.randn(3, 2, requires_grad=True)
    index = torch.tensor([[0, 4], [2, 2], [1, 3]], dtype=torch.int32)
    check_vs_eager(fns[op], x, index, src)


def test_gather_scatter_int16_index_is_rejected_as_eager_does():
    x, index = torch.randn(3, 5), torch.zeros(3, 2, dtype=torch.int16)
    for fn in (lambda x, i: torch.gather(x, 1, i), lambda x, i: torch.scatter_add(x, 1, i, x[:, :2])):
        with pytest.raises(RuntimeError, match="Expected dtype int32/int64 for index"):
            fn(x, index)
        with pytest.raises(RuntimeError, match="Expected dtype int32/int64 for index"):
            _jit(fn)(x, index)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64])
def test_gather_scatter_empty_index_of_any_shape(dtype):
    # eager checks neither the dtype nor the number of dimensions of an index with no entries
    x = torch.randn(5, requires_grad=True)
    index = torch.zeros(2, 0, dtype=dtype)
    check_vs_eager(lambda x, i: torch.gather(x, 0, i) * 2, x, index)
    check_vs_eager(lambda x, i: torch.scatter(x, 0, i, 1.0) * 2, x, index)
    check_vs_eager(lambda x, i: torch.scatter_add(x, 0, i, x.detach().reshape(1, 5)) * 2, x, index)



def test_batch_norm_1d_input_as_eager():
    # eager reads a 1-D input's channel count as 0: an empty input gives an empty copy, any other raises
    for training in (True, False):
        fn = lambda x, m, v: F.batch_norm(x, m, v, training=training)  # noqa: E731
        check_vs_eager(fn, torch.randn(0), torch.zeros(0), torch.ones(0))
        with pytest.raises(IndexError, match="Dimension out of range"):
            _jit(fn)(torch.randn(3), torch.zeros(0), torch.ones(0))
        with pytest.raises(RuntimeError, match="running_mean should contain 0 elements not 3"):
            _jit(fn)(torch.randn(0), torch.zeros(3), torch.ones(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("steps", [0, 1, 2, 7, 50])
def test_linspace_logspace_tensor_endpoints(dtype, steps):
    fns = [lambda s, e: torch.linspace(s, e, steps, dtype=dtype), lambda s, e: torch.linspace(-2.5, e, steps,
                                                                                              dtype=dtype),
           lambda s, e: torch.logspace(s, e, steps, base=2.0, dtype=dtype)]
    for fn in fns:
        jitted = _jit(fn)
        # the endpoints are read on every call: new values need no recompilation and give eager's numbers
        for start, end in ((torch.tensor(-3.25), torch.tensor(4)), (torch.tensor(1.5), torch.tensor(-2))):
            expected = fn(start, end)
            actual = jitted(start, end)
            assert actual.dtype == expected.dtype
            torch.testing.assert_close(actual, expected, rtol=0, atol=0)
        assert fulmen.cache_misses(jitted) == 1


# ---------------------------------------------------------------------------------------------------------
# random ops draw eager's numbers with the torch executor


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)), requires_grad=True)


_MHA_GEN = torch.Generator().manual_seed(3)
_MHA_B, _MHA_WO, _MHA_BO = (torch.randn(24, generator=_MHA_GEN), torch.randn(8, 8, generator=_MHA_GEN),
                            torch.randn(8, generator=_MHA_GEN))


def _mha(x, w):
    return F.multi_head_attention_forward(x, x, x, 8, 2, w, _MHA_B, None, None, False, 0.3, _MHA_WO, _MHA_BO,
                                          training=True)[0]


RANDOM_PROGRAMS = {
    "dropout": (lambda x: F.dropout(x, 0.3), lambda: (_x(2, 3, 8, 8),)),
    "dropout2d": (lambda x: F.dropout2d(x, 0.3), lambda: (_x(2, 3, 8, 8),)),
    "sdpa_dropout": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.4),
                     lambda: (_x(2, 3, 4, 8), _x(2, 3, 5, 8), _x(2, 3, 5, 7))),
    "sdpa_dropout_causal": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True),
                            lambda: (_x(1, 2, 6, 8), _x(1, 2, 7, 8), _x(1, 2, 7, 3))),
    "mha_dropout": (_mha, lambda: (_x(3, 2, 8), _x(24, 8))),
    "fractional_max_pool2d": (lambda x: F.fractional_max_pool2d(x, 2, output_size=(3, 2)), lambda: (_x(2, 3, 7, 7),)),
    # the pooling regions depend on the draw: the backward (PyTorch's, recomputing the op) must replay it
    "fractional_max_pool3d": (lambda x: F.fractional_max_pool3d(x, 2, output_size=(2, 3, 2)),
                              lambda: (_x(2, 3, 5, 5, 5),)),
    # two identical calls draw twice: they must not be merged into one
    "fractional_max_pool3d_twice": (lambda x: F.fractional_max_pool3d(x, 2, output_size=(2, 3, 2))
                                    - F.fractional_max_pool3d(x, 2, output_size=(2, 3, 2)),
                                    lambda: (_x(2, 3, 5, 5, 5),)),
    "rrelu": (lambda x: F.rrelu(x, training=True), lambda: (_x(4, 5),)),
    "rand_randn_randint": (lambda x: x * torch.rand(x.shape) + torch.randn_like(x) + torch.randint(0, 5, x.shape),
                           lambda: (_x(4, 5),)),
    "bernoulli": (lambda x: torch.bernoulli(torch.sigmoid(x)) * x, lambda: (_x(4, 5),)),
    "multinomial": (lambda x: x[torch.multinomial(torch.softmax(x.detach().flatten(), 0), 6)], lambda: (_x(20),)),
    # eager gives a sample's parameters zero gradient (not the reparameterized one)
    "normal_tensor_params": (lambda m, s: torch.normal(m, s.abs() + 0.1) + torch.normal(m, 2.0),
                             lambda: (_x(4, 5), _x(5))),
    "bernoulli_probabilities": (lambda x: torch.bernoulli(torch.sigmoid(x)), lambda: (_x(4, 5),)),
    "normal_": (lambda x: torch.empty_like(x).normal_() * x + torch.normal(0.5, 2.0, (5,)), lambda: (_x(4, 5),)),
}


@pytest.mark.parametrize("name", sorted(RANDOM_PROGRAMS))
def test_random_ops_draw_eagers_numbers(name):
    """Bit-exact, forward and backward, on the first call and on cache hits, and the generator is left where eager
    leaves it."""
    fn, make_args = RANDOM_PROGRAMS[name]
    jitted = _jit(fn)
    for call in range(3):
        results = []
        for f in (fn, jitted):
            args = make_args()
            torch.manual_seed(1234 + call)
            out = f(*args)
            after = torch.rand(3)  # where the generator was left
            grads = torch.autograd.grad(out, args, torch.ones_like(out), allow_unused=True, materialize_grads=True)
            results.append((out, after, grads))
        (out, after, grads), (e_out, e_after, e_grads) = results[1], results[0]
        assert torch.equal(out, e_out), f"call {call}: outputs differ from eager's"
        assert torch.equal(after, e_after), f"call {call}: the generator is not where eager leaves it"
        for g, e in zip(grads, e_grads):
            assert torch.equal(g, e), f"call {call}: gradients differ from eager's"


def _seeded_inside(x):
    torch.manual_seed(42)
    return F.dropout(x, 0.5) + torch.rand(x.shape)


def _frozen_state_inside(x):
    state = torch.get_rng_state()
    torch.manual_seed(7)
    y = F.dropout(x, 0.5)
    torch.set_rng_state(state)  # the caller's generator as it was (torch.testing's freeze_rng_state)
    return y + torch.randn(x.shape)


def _state_from_outside(x, state):
    torch.set_rng_state(state)
    return x * torch.rand(x.shape)


@pytest.mark.parametrize("fn", [_seeded_inside, _frozen_state_inside])
def test_generator_calls_inside_the_function_run_on_every_call(fn):
    jitted = _jit(fn)
    x = torch.randn(6, 6)
    for call in range(3):
        torch.manual_seed(call)
        expected, e_after = fn(x), torch.rand(4)
        torch.manual_seed(call)
        actual, a_after = jitted(x), torch.rand(4)
        assert torch.equal(actual, expected), f"call {call}"
        assert torch.equal(a_after, e_after), f"call {call}: the generator is not where eager leaves it"


def test_set_rng_state_with_a_state_passed_in():
    jitted = _jit(_state_from_outside)
    x = torch.randn(3)
    for seed in (1, 2):
        torch.manual_seed(seed)
        state = torch.get_rng_state()
        torch.manual_seed(99)
        assert torch.equal(jitted(x, state), _state_from_outside(x, state))


def test_an_unrecorded_generator_change_while_tracing_warns():
    def fn(x):
        torch.default_generator.manual_seed(3)  # not a call fulmen can see: made once, while tracing
        return x * 2

    with pytest.warns(UserWarning, match="random generator changed while the function was traced"):
        _jit(fn)(torch.randn(3))


def test_tensordot_broadcasts_contracted_dims_of_size_one():
    a, b = torch.randn(1, 3, 1, requires_grad=True), torch.randn(2, 1, 4, requires_grad=True)
    check_vs_eager(lambda a, b: torch.tensordot(a, b, dims=([0, 2], [2, 0])), a, b)
    check_vs_eager(lambda a, b: torch.tensordot(a, b, dims=([1, 0], [1, 2])), a, torch.randn(1, 3, 2))


@pytest.mark.parametrize("args", [("nuc",), ("nuc", (1, 2)), ("nuc", (2, 0), True)])
def test_matrix_norms_run_as_eager(args):
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    check_vs_eager(lambda x: torch.norm(x[0] if len(args) == 1 else x, *args), x)


def test_a_matrix_norm_eager_rejects_raises_eagers_error():
    with pytest.raises(RuntimeError, match="dim must be a 2-tuple"):
        _jit(lambda x: torch.norm(x, "fro", (0, 1, 2)))(torch.randn(2, 3, 4))


@pytest.mark.parametrize("data", [float("nan"), [float("nan")] * 3, [0.0, -0.0], [-0.0, -0.0], [[1.5, 1.5]]])
def test_tensor_of_python_constants(data):
    # torch.tensor(nan) once failed with an IndexError (NaN != NaN), and [0.0, -0.0] became two 0.0
    fn = lambda x: torch.tensor(data) + x  # noqa: E731
    x = torch.tensor(-0.0)  # adding -0.0 keeps the sign of every zero
    jitted = _jit(fn)
    expected = fn(x)
    # the first call, a cache hit, and the prims the decomposition is made of (what fusion compiles)
    for actual in (jitted(x), jitted(x), run_decomposed(fn, x)):
        torch.testing.assert_close(actual, expected, equal_nan=True, rtol=0, atol=0)
        assert torch.equal(torch.signbit(actual), torch.signbit(expected))


def test_masked_median():
    x, mask = torch.randn(4, 5), torch.rand(4, 5) > 0.3
    check_vs_eager(lambda x, m: torch.masked.median(x, 1, mask=m), x, mask)


def test_opaque_op_returning_a_structseq_holding_a_list_of_tensors():
    # torch.histogramdd (no fulmen rule) returns (hist, bin_edges: list of tensors); the list's tensors are outputs
    fn = lambda x: torch.histogramdd(x, (2, 3), weight=x[:, 0].abs())  # noqa: E731
    x = torch.randn(7, 2)
    expected, jitted = fn(x), _jit(fn)
    for _ in range(2):
        actual = jitted(x)
        assert type(actual) is type(expected)
        torch.testing.assert_close(actual.hist, expected.hist)
        torch.testing.assert_close(actual.bin_edges, expected.bin_edges)


def test_with_fusion_random_ops_stay_outside_regions_and_draw_eagers_numbers():
    """Default executors (Inductor): the draws are eager's and the generator is left where eager leaves it; only the
    rounding of the fused arithmetic around them may differ (a different dropout mask would differ by O(1))."""
    fn = lambda x: F.dropout(torch.sin(x) * 2, 0.4).cos() + torch.rand(x.shape)  # noqa: E731
    jitted = fulmen.jit(fn, compile="sync")
    x = torch.randn(8, 16)
    for call in range(2):
        torch.manual_seed(call)
        expected, e_after = fn(x), torch.rand(3)
        torch.manual_seed(call)
        actual, a_after = jitted(x), torch.rand(3)
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
        assert torch.equal(a_after, e_after)
    lines = str(fulmen.last_traces(jitted)[-1]).splitlines()
    assert any("inductor_fusion" in line for line in lines)
    # the draws are top-level calls of the torch executor, not operations of a fused region (printed as comments)
    top_level = [line for line in lines if not line.lstrip().startswith("#")]
    for names in (("bernoulli", "dropout"), ("uniform", "rand")):
        assert any(name in line for line in top_level for name in names), (names, "\n".join(lines))


@pytest.mark.parametrize("shape", [(5,), (3, 6), (1, 4), (4, 1)])
@pytest.mark.parametrize("correction", [0, 1, 2])
def test_cov_corrcoef_unweighted(shape, correction):
    # eager's cov reads its degrees of freedom with .item(): unweighted they are known, so it traces
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    with pytest.warns(UserWarning) if shape[-1] - correction <= 0 else _no_warning():
        check_vs_eager(lambda x: torch.cov(x, correction=correction), x)
    check_vs_eager(torch.corrcoef, x)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        y = (torch.randn(*shape) * 4).to(dtype)
        check_vs_eager(lambda y: (torch.cov(y, correction=correction), y.corrcoef()), y)


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _narrow_then_write(x, s):
    y = x * 1
    y.narrow(1, s, 2).add_(10)  # a write through the narrowed view reaches y, as in eager
    return y, x.narrow(0, s, 1) * 2


def test_narrow_with_a_tensor_start():
    x = torch.randn(4, 5, requires_grad=True)
    jitted = _jit(_narrow_then_write)
    for start in (1, -2, 0, 3):
        s = torch.tensor(start)
        check_vs_eager(_narrow_then_write, x, s)
        expected = _narrow_then_write(x, s)
        torch.testing.assert_close(jitted(x, s), expected, rtol=0, atol=0)
        # the decomposition (what fusion compiles) reads the start's value on every call too
        torch.testing.assert_close(run_decomposed(_narrow_then_write, x, s), expected, rtol=0, atol=0)
    assert fulmen.cache_misses(jitted) == 1
