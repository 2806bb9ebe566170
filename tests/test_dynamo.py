"""torch.compile(..., backend="fulmen"): the entry-point string works, graphs run through fulmen, graph
breaks are handled by Dynamo, and custom ops stay one call."""

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
