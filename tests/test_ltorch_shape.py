"""Shape, indexing, creation and conversion ops of the torch language against eager PyTorch.

Every sample of the OpInfos in ``fulmen/tests/opinfos/shape.py`` runs through ``fulmen.jit`` and through
``fulmen.testing.run_decomposed`` (prims only); outputs *and* the caller's tensors afterwards must match eager.
The torch callables must reach the torch-language symbols (not the opaque fallback), and error inputs must
raise the exception eager raises. Then the behaviours the OpInfos cannot express: layouts made inside the
traced program, random streams, captured factory calls, clear errors.
"""

from __future__ import annotations

import pytest
import torch

import fulmen
import fulmen.tests.opinfos.shape as shape_opinfos
import fulmen.torch as ltorch
from fulmen.core.proxies import DataDependentError
from fulmen.core.symbol import OpTags, Symbol
from fulmen.core.trace import check_trace
from fulmen.testing import assert_close, run_decomposed
from fulmen.testing import clone_args as _clone
from fulmen.tests.opinfos.base import OpInfo

OPINFOS = [v for v in vars(shape_opinfos).values() if isinstance(v, OpInfo)]
DTYPES = (torch.float32, torch.int64)
_FULMEN_ONLY = (NotImplementedError, DataDependentError)


def _dtypes(op):
    chosen = [d for d in DTYPES if op.supports_dtype(d)]
    return chosen or list(op.dtypes)[:1]


def _params():
    return [pytest.param(op, d, id=f"{op.name}-{str(d).replace('torch.', '')}") for op in OPINFOS for d in _dtypes(op)]


def _run(fn, op, sample):
    args, kwargs = _clone(sample.args), _clone(sample.kwargs)
    if op.is_random:
        torch.manual_seed(1234)
    return fn(*args, **kwargs), (args, kwargs)


@pytest.mark.parametrize("op, dtype", _params())
def test_jit_and_decomposed_match_torch(op, dtype):
    for sample in op.sample_inputs("cpu", dtype):
        expected, e_inputs = _run(op.torch_reference, op, sample)
        jfn = fulmen.jit(op.op)
        actual, a_inputs = _run(jfn, op, sample)
        assert_close(actual, expected, equal_nan=True, msg=lambda m, s=sample: f"jit {s}: {m}")
        assert_close(a_inputs, e_inputs, msg=lambda m, s=sample: f"inputs after jit {s}: {m}")
        for trace in fulmen.last_traces(jfn):
            check_trace(trace)
        fallbacks = [b for b in fulmen.last_traces(jfn)[0].bound_symbols if OpTags.FALLBACK in b.sym.tags]
        assert not fallbacks, f"{op.name} fell back to opaque torch calls: {fallbacks}"
        decomposed, d_inputs = _run(lambda *a, **k: run_decomposed(op.op, *a, **k), op, sample)
        assert_close(decomposed, expected, equal_nan=True, msg=lambda m, s=sample: f"decomposed {s}: {m}")
        assert_close(d_inputs, e_inputs, msg=lambda m, s=sample: f"inputs after decomposed {s}: {m}")


def _routed():
    """OpInfos whose torch reference is a torch callable that should map onto the op's symbol."""
    out = []
    for op in OPINFOS:
        if isinstance(op.op, Symbol) and op.torch_reference in op.op.torch_fns:
            out.append(pytest.param(op, id=op.name))
    return out


@pytest.mark.parametrize("op", _routed())
def test_torch_callables_reach_the_symbol(op):
    sample = next(iter(op.sample_inputs("cpu", _dtypes(op)[0])))
    if not any(isinstance(a, torch.Tensor) for a in sample.args):
        pytest.skip("factory calls without tensor arguments do not go through __torch_function__")
    ref = op.torch_reference
    if getattr(torch.Tensor, getattr(ref, "__name__", ""), None) is ref:  # unbound methods need a real self
        name = ref.__name__

        def ref(a, *args, **kwargs):
            return getattr(a, name)(*args, **kwargs)

    jfn = fulmen.jit(ref)
    _run(jfn, op, sample)
    ids = [b.sym.id for b in fulmen.last_traces(jfn)[0].bound_symbols]
    assert op.op.id in ids, f"{op.torch_reference} recorded {ids}, not {op.op.id}"


@pytest.mark.parametrize("op", [pytest.param(op, id=op.name) for op in OPINFOS if op.error_input_generator])
def test_error_inputs(op):
    for sample, exc, regex in op.error_inputs("cpu"):
        with pytest.raises(exc, match=regex):
            _run(fulmen.jit(op.op), op, sample)
        if not issubclass(exc, _FULMEN_ONLY):
            with pytest.raises(exc):
                _run(op.torch_reference, op, sample)


def test_every_symbol_of_these_files_has_an_opinfo():
    covered = {op.name for op in OPINFOS}
    modules = ("fulmen.torch.shape", "fulmen.torch.rearrange", "fulmen.torch.indexing", "fulmen.torch.creation",
               "fulmen.torch.conversion")
    missing = sorted(name for name, v in vars(ltorch).items() if isinstance(v, Symbol) and v.module == "ltorch"
                     and getattr(v.meta, "__module__", None) in modules and v.name not in covered
                     and v.name != "cuda")  # Tensor.cuda needs a GPU; test_type_and_cuda covers its error
    assert not missing, f"symbols without an OpInfo: {missing}"


# ---------------------------------------------------------------------------------------------------------
# layouts made inside the program


def test_view_of_a_transposed_tensor_fails_as_in_eager():
    def f(x):
        return x.t().view(-1)

    with pytest.raises(RuntimeError, match="view size is not compatible with input tensor's size and stride"):
        f(torch.randn(2, 3))
    with pytest.raises(RuntimeError, match="view size is not compatible with input tensor's size and stride"):
        fulmen.jit(f)(torch.randn(2, 3))


def test_reshape_and_contiguous_alias_only_when_eager_does():
    def f(x):
        a = x.reshape(-1)  # contiguous input: a view, so the update reaches x
        a[0] = 100.0
        b = x.t().reshape(-1)  # transposed: a copy, the update stays in b
        b[1] = -100.0
        c = x.t().contiguous()  # a copy
        c.zero_()
        d = x.contiguous()  # x itself
        d[1, 1] = 7.0
        return a, b, c, d

    x_eager, x_jit = torch.randn(2, 3), None
    x_jit = x_eager.clone()
    expected = f(x_eager)
    assert_close(fulmen.jit(f)(x_jit), expected)
    assert_close(x_jit, x_eager)


def test_view_dtype_is_a_clear_not_implemented_error():
    with pytest.raises(NotImplementedError, match="view\\(dtype\\)"):
        fulmen.jit(lambda x: x.view(torch.int32))(torch.randn(4))


# ---------------------------------------------------------------------------------------------------------
# indexing


def test_boolean_mask_read_traces_with_a_data_dependent_size_and_masked_write_traces():
    x = torch.randn(4, 5)
    assert_close(fulmen.jit(lambda t: t[t > 0])(x), x[x > 0])  # tests/test_data_dependent.py covers more

    def clip(t):
        t[t < 0] = 0.0
        t[:, t[0] > 0.5] = 1.0
        return t

    expected = clip(x.clone())
    y = x.clone()
    assert_close(fulmen.jit(clip)(y), expected)
    assert_close(y, expected)


def test_advanced_index_placement_matches_torch():
    x = torch.arange(120.0).reshape(2, 3, 4, 5)
    i, j = torch.tensor([0, 1]), torch.tensor([[2], [3]])

    def f(t):
        return t[:, i, :, i], t[1, :, i], t[..., j, i], t[None, i, 1:, j], t[:, [0, 2]][..., ::2]

    assert_close(fulmen.jit(f)(x), f(x))
    assert_close(run_decomposed(f, x), f(x))


# ---------------------------------------------------------------------------------------------------------
# creation and randomness


def test_random_ops_follow_the_default_generator_bit_for_bit():
    def f(x):
        return torch.rand_like(x), torch.randn_like(x), torch.randint_like(x, 10), torch.bernoulli(x.sigmoid()), \
            ltorch.rand(3), ltorch.randn(2, 2), ltorch.randint(-4, 4, (5,))

    def eager(x):
        return torch.rand_like(x), torch.randn_like(x), torch.randint_like(x, 10), torch.bernoulli(x.sigmoid()), \
            torch.rand(3), torch.randn(2, 2), torch.randint(-4, 4, (5,))

    x = torch.randn(3, 4)
    jfn = fulmen.jit(f)
    for run in (jfn, lambda x: run_decomposed(f, x)):
        for seed in (0, 7):
            torch.manual_seed(seed)
            expected, after_eager = eager(x), torch.rand(2)
            torch.manual_seed(seed)
            actual, after = run(x), torch.rand(2)
            assert_close(actual, expected, rtol=0, atol=0)
            assert_close(after, after_eager, rtol=0, atol=0)  # the stream continues where eager's does
    torch.manual_seed(0)
    first = jfn(x)
    assert not torch.equal(first[0], jfn(x)[0]), "each call must draw new numbers"


def test_factory_calls_inside_jit_are_captured_constants():
    def f(x):
        return x + torch.ones(3), x * torch.arange(3)

    x = torch.randn(2, 3)
    jfn = fulmen.jit(f)
    assert_close(jfn(x), f(x))
    assert_close(jfn(x + 1), f(x + 1))


def test_ltorch_factories_are_symbols_with_torch_ids():
    assert ltorch.zeros.id == "torch.zeros" and ltorch.arange.id == "torch.arange"
    assert OpTags.RANDOM_OP in ltorch.rand.tags and OpTags.RANDOM_OP not in ltorch.zeros.tags

    def f(x):
        return x + ltorch.zeros(x.shape, dtype=x.dtype), ltorch.full((2,), 3), ltorch.eye(2, device=x.device)

    x = torch.randn(2, 2)
    assert_close(fulmen.jit(f)(x), (x.clone(), torch.full((2,), 3), torch.eye(2)))


def test_default_dtype_is_respected():
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        out = fulmen.jit(lambda x: (x.new_tensor([1.5]), ltorch.arange(0.0, 1.0, 0.5), ltorch.zeros(2)))(
            torch.ones(1, dtype=torch.float32))
        assert [t.dtype for t in out] == [torch.float32, torch.float64, torch.float64]
    finally:
        torch.set_default_dtype(old)


# ---------------------------------------------------------------------------------------------------------
# conversion and detach


def test_detach_is_a_distinct_symbol_that_stops_gradient():
    assert ltorch.detach.id == "torch.Tensor.detach"
    assert OpTags.NON_DIFFERENTIABLE in ltorch.detach.tags
    jfn = fulmen.jit(lambda x: x.detach())
    with torch.no_grad():
        jfn(torch.randn(3))
    trace = fulmen.last_traces(jfn)[0]
    assert trace.bound_symbols[-1].sym is ltorch.detach


def test_conversion_that_changes_nothing_returns_the_input():
    def f(x):
        y = x.to(torch.float32)  # x itself, as in eager: the update below reaches x
        y.add_(1)
        z = x.to(torch.float32, copy=True)
        z.add_(100)
        return x.double(), x.long().float()

    x = torch.randn(3)
    x_jit = x.clone()
    expected = f(x)
    assert_close(fulmen.jit(f)(x_jit), expected)
    assert_close(x_jit, x)


def test_type_and_cuda():
    x = torch.randn(2)
    assert fulmen.jit(lambda t: t.type(torch.float64))(x).dtype == torch.float64
    assert fulmen.jit(lambda t: t.type("torch.IntTensor"))(x).dtype == torch.int32
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            fulmen.jit(lambda t: t.cuda())(x)
