"""Dynamo graphs the backend retraces with ``make_fx`` (a ``torch.func`` transform inside, as Mamba's
``associative_scan`` runs vmap) are aten graphs. Their aten operations used to reach fulmen's tracer as opaque
operations: nothing fused them and PyTorch's autograd differentiated them one by one (Mamba's backend train step was
several times eager's). They now run as their torch-level forms (``fulmen.frontend.aten_graph.TorchCalls``), which
fulmen traces through its own symbols. A factory call such a graph makes (``aten.zeros`` for a state buffer) was
made by fulmen's interpreter, so it ran once while tracing and its tensor was captured: every call returned that
same tensor, and the next call overwrote the result the caller held.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.frontend.dynamo import backend_stats, reset_backend_stats

OPTIONS = {"executors": ["torch"], "compile": "off"}


def _compiled(fn, options=OPTIONS):
    reset_backend_stats()
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        from fulmen.frontend.dynamo import fulmen_backend

        compiled = fulmen_backend(gm, example_inputs, options=options)
        graphs.append(compiled._fulmen_jitted)
        return compiled

    return torch.compile(fn, backend=backend), graphs


def _opaque_lines(jitted) -> list[str]:
    """The lines of the last forward and backward traces that run an aten op as one opaque call (or its gradient
    as PyTorch autograd's)."""
    traces = [fulmen.last_traces(jitted)[-1], *fulmen.last_backward_traces(jitted)[-1:]]
    return [
        line
        for t in traces
        for line in str(t).splitlines()
        if not line.lstrip().startswith("#") and ("fallback: no fulmen rule" in line or "autograd_vjp" in line)
    ]


def _with_state_buffers(x):
    n = x.shape[0]
    # buffers the program fills and returns (Mamba's conv state), made by each factory
    made = [
        torch.zeros(n, 2),
        torch.ones(n, 2),
        torch.full((n, 2), 3.0),
        torch.empty(n, 2),
        x.new_zeros(n, 2),
        torch.ones_like(x[:, :2]),
        torch.arange(2 * n, dtype=x.dtype).view(n, 2),
    ]
    for state in made:
        state.add_(x[:, -2:])
    made[3].copy_(x[:, -2:])
    return made, torch.vmap(torch.sin)(x) * 2


def test_buffers_made_in_a_retraced_graph_are_new_tensors_on_every_call():
    compiled, _ = _compiled(_with_state_buffers)
    x1, x2 = torch.randn(3, 4), torch.randn(3, 4)
    expected1, expected2 = _with_state_buffers(x1), _with_state_buffers(x2)
    first = compiled(x1)
    second = compiled(x2)
    for a, b in zip(first[0], second[0]):
        assert a is not b
    for got, expected in ((first, expected1), (second, expected2)):  # the first not overwritten by the second call
        for g, e in zip(got[0], expected[0]):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
        torch.testing.assert_close(got[1], expected[1])
    assert backend_stats().eager_graphs == 0
    torch._dynamo.reset()


def _scan_like(x, w, conv_w):
    """The operations Mamba's retraced graph holds: vmap, strided slices, cat/stack, a grouped conv1d, softplus,
    split, log_softmax and nll_loss."""
    y = torch.vmap(lambda r: r * w)(x)  # (B, C, L)
    pairs = y[..., ::2] * y[..., 1::2]
    scanned = torch.cat([y[..., :1], pairs], -1)
    stacked = torch.stack([scanned, scanned.exp()], 1).sum(1)
    conv = F.conv1d(F.pad(stacked, (1, 0)), conv_w, groups=stacked.shape[1])
    a, b = F.softplus(conv).split(2, dim=1)
    logits = (a * b).flatten(1)
    return F.cross_entropy(logits, torch.arange(x.shape[0]) % logits.shape[1])


def test_a_retraced_graph_runs_fulmens_own_operations_and_gradients():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 6, dtype=torch.float64, generator=gen)
    w = torch.randn(6, dtype=torch.float64, generator=gen, requires_grad=True)
    conv_w = torch.randn(4, 1, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    compiled, graphs = _compiled(_scan_like)
    expected = _scan_like(x, w, conv_w)
    grads_expected = torch.autograd.grad(expected, (w, conv_w))
    for _ in range(2):
        got = compiled(x, w, conv_w)
        grads = torch.autograd.grad(got, (w, conv_w))
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        for g, e in zip(grads, grads_expected):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    stats = backend_stats()
    assert stats.graphs == 1 and stats.eager_graphs == 0 and stats.compilations == 1, stats
    assert _opaque_lines(graphs[0]) == []
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.usefixtures("quiet_transformers")
def test_mamba_train_step_through_the_backend_is_fulmens_own_program():
    pytest.importorskip("transformers")
    from fulmen.bench.hf_families import FAMILIES
    from fulmen.bench.hf_matrix import compare_grads, compare_outputs

    family = FAMILIES["mamba"]
    reference, model = family.build(), family.build()
    kwargs = family.inputs(reference.config)
    expected = reference(**kwargs)
    expected.loss.backward()
    compiled, graphs = _compiled(model)
    params = list(model.parameters())
    for _ in range(3):
        for p in params:
            p.grad = None
        out = compiled(**kwargs)
        out.loss.backward()
        compare_outputs(out, expected, "mamba")
        compare_grads(model, reference, "mamba")
    stats = backend_stats()
    assert stats.eager_graphs == 0 and stats.compilations == stats.graphs == 1, stats
    assert _opaque_lines(graphs[0]) == []
    torch._dynamo.reset()
