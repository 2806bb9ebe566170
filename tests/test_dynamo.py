"""torch.compile(..., backend="fulmen"): the entry-point string works, graphs run through fulmen, graph
breaks are handled by Dynamo, and custom ops stay one call."""

import pytest
import torch

import fulmen  # noqa: F401


def test_backend_string_is_registered():
    from torch._dynamo import list_backends

    assert "fulmen" in list_backends(exclude_tags=())


def test_graph_runs_through_fulmen_and_matches_eager():
    torch._dynamo.reset()

    def f(x, w):
        return torch.nn.functional.gelu(x @ w).sum(-1)

    x, w = torch.randn(4, 8), torch.randn(8, 3)
    compiled = torch.compile(f, backend="fulmen")
    torch.testing.assert_close(compiled(x, w), f(x, w))


def test_data_dependent_control_flow_breaks_the_graph():
    torch._dynamo.reset()

    def f(x):
        y = x * 2
        if y.sum() > 0:  # Python needs a value: Dynamo breaks the graph here
            return y + 1
        return y - 1

    compiled = torch.compile(f, backend="fulmen")
    for x in (torch.ones(3), -torch.ones(3)):
        torch.testing.assert_close(compiled(x), f(x))


def test_autocast_matches_eager():
    def f(x, w):
        return torch.nn.functional.linear(x, w).relu().sum()

    x, w = torch.randn(4, 8), torch.randn(3, 8)
    jf = fulmen.jit(f)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, actual = f(x, w), jf(x, w)
    assert actual.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(actual, expected)


def test_dynamic_shapes_from_dynamo_do_not_recompile_fulmen_per_size():
    """Dynamo passes a graph compiled with dynamic shapes its sizes as int inputs; the backend reads them from the
    tensors instead, and the dims Dynamo made dynamic are symbolic in fulmen's first compilation of that graph: one
    compilation serves every later size."""
    from fulmen.frontend.dynamo import fulmen_backend

    made = []

    def backend(gm, example_inputs):
        made.append(fulmen_backend(gm, example_inputs))
        return made[-1]

    w = torch.randn(2, 5, requires_grad=True)

    def f(x):
        return (x.sin().view(x.shape[0], x.shape[1] // 2, 2) @ w).sum(-1)

    torch._dynamo.reset()
    cf = torch.compile(f, backend=backend)
    for n in (4, 6, 8, 10, 12):
        x = torch.randn(3, n, requires_grad=True)
        out = cf(x)
        torch.testing.assert_close(out, f(x))
        (gx, gw), (ex, ew) = (torch.autograd.grad(y.sum(), (x, w)) for y in (out, f(x)))
        torch.testing.assert_close(gx, ex)
        torch.testing.assert_close(gw, ew)
    jitted = made[-1]._fulmen_jitted  # Dynamo's graph with a symbolic size, used from n=6 on
    assert fulmen.cache_misses(jitted) == 1 and fulmen.cache_hits(jitted) == 3


def test_torch_compile_options_reach_fulmen_jit():
    made = []

    def backend(gm, example_inputs, **kwargs):
        from fulmen.frontend.dynamo import fulmen_backend

        made.append(fulmen_backend(gm, example_inputs, **kwargs))
        return made[-1]

    def f(x):
        return torch.nn.functional.gelu(x * 2).sum()

    torch._dynamo.reset()
    x = torch.randn(4, 3)
    torch.testing.assert_close(torch.compile(f, backend="fulmen", options={"executors": ["torch"]})(x), f(x))
    with pytest.raises(Exception, match="unexpected keyword argument"):
        torch._dynamo.reset()
        torch.compile(f, backend="fulmen", options={"executor": ["torch"]})(x)  # a misspelt option: a clear error
    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend, options={"executors": ["torch"], "compile": "sync"})
    torch.testing.assert_close(compiled(x), f(x))
    jitted = made[-1]._fulmen_jitted
    assert [ex.name for ex in jitted.executors] == ["torch"] and jitted.compile_mode == "sync"


def test_a_float_passed_as_a_tensor_runs_the_graph_eagerly(caplog):
    """Dynamo passes a Python float that changes between calls as a 0-d tensor read with ``.item()`` in the graph;
    fulmen has no symbolic floats, so that graph runs with eager PyTorch (logged) and every result is right."""
    torch._dynamo.reset()

    def f(x, k):
        return x.sin() * k + 1

    compiled = torch.compile(f, backend="fulmen")
    x = torch.randn(5)
    with caplog.at_level("WARNING", logger="fulmen.dynamo"):
        for k in (0.5, 0.7, -3.0):
            torch.testing.assert_close(compiled(x, k), f(x, k))
    assert "runs with eager PyTorch" in caplog.text


def test_a_graph_with_vmap_inside_is_compiled_with_the_batching_rules_applied():
    # torch.vmap inside a compiled function: Dynamo's graph holds functorch's batching primitives, which act on the
    # tensors they are given and which fulmen's traced tensors cannot stand for. make_fx retraces the graph on fake
    # copies of its inputs (batching rules applied, aten operations left), and fulmen compiles that graph.
    from fulmen.frontend.dynamo import backend_stats, reset_backend_stats

    def f(x, w):
        return torch.vmap(lambda r: (r * w).sin().sum() * 2)(x) + 1

    reset_backend_stats()
    torch._dynamo.reset()
    x, w = torch.randn(3, 4), torch.randn(4, requires_grad=True)
    compiled = torch.compile(f, backend="fulmen", options={"executors": ["torch"]})
    expected = f(x, w)
    (grad_expected,) = torch.autograd.grad(expected.sum(), w)
    out = compiled(x, w)
    (grad,) = torch.autograd.grad(out.sum(), w)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grad, grad_expected)
    stats = backend_stats()
    assert stats.graphs == 1 and stats.eager_graphs == 0 and stats.compilations == 1, stats
    torch._dynamo.reset()


def test_a_graph_with_vmap_and_dynamic_sizes_is_compiled_once_for_every_size():
    # with symbolic sizes, make_fx retraces the graph symbolically on Dynamo's fake values (its shape environment
    # records what the batching rules assume); it used to run eagerly (the HF matrix's Mamba prompt graph)
    from fulmen.frontend.dynamo import backend_stats, reset_backend_stats

    def f(x, y):
        return torch.vmap(lambda r, s: (r.sin() * s).cumsum(0))(x, y) + 1

    reset_backend_stats()
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="fulmen", options={"executors": ["torch"]}, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    for n in (3, 5, 9):
        x = torch.randn(n, 4, dtype=torch.float64, generator=gen, requires_grad=True)
        y = torch.randn(n, 4, dtype=torch.float64, generator=gen)
        x_eager = x.detach().clone().requires_grad_()
        expected, got = f(x_eager, y), compiled(x, y)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        weights = torch.randn(n, 4, dtype=torch.float64, generator=gen)
        (expected * weights).sum().backward()
        (got * weights).sum().backward()
        torch.testing.assert_close(x.grad, x_eager.grad, rtol=1e-12, atol=1e-12)
    stats = backend_stats()
    assert stats.graphs >= 1 and stats.eager_graphs == 0, stats.eager_reasons
    assert stats.compilations == stats.graphs  # sizes symbolic from the first trace: no program per size
    torch._dynamo.reset()
