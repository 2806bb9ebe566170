"""Every OpInfo through the inductor executor: Inductor's compiled kernels against the torch executor.

For each op, the first float32 sample runs through ``fulmen.jit(op, executors=["inductor"])`` with every region
compiled before it runs (``compile_mode`` "sync", regions of a single operation included): the forward and, for
differentiable ops, the backward of the same program. Results are compared with the torch executor's, and
every region must have compiled (a failed compile falls back silently to the torch executor, which would
hide the kernel). Inductor reorders reductions and contracts multiply-adds, so the tolerance is wider than
test_ops' (rtol 1e-4 where test_ops uses 1.3e-6, atol 1e-4): a kernel computing the wrong function is off by
far more.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_flatten

import fulmen
from fulmen.executors import inductor
from fulmen.testing import clone_args
from fulmen.tests.opinfos import all_opinfos

OPINFOS = [op for op in all_opinfos() if op.supports_dtype(torch.float32) and not op.is_random]
RTOL, ATOL = 1e-4, 1e-4


@pytest.fixture(autouse=True)
def every_region_compiled(monkeypatch):
    monkeypatch.setattr(inductor, "MIN_REGION_SIZE", 1)
    token = inductor.compile_mode.set("sync")
    yield
    inductor.compile_mode.reset(token)


def _first_sample(op, device, requires_grad=False):
    for sample in op.sample_inputs(device, torch.float32, requires_grad=requires_grad):
        return sample
    pytest.skip("no float32 sample")


def _tensors(x):
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _run(op, sample, executors):
    """Outputs, and the gradients of the differentiable ones (None when there are none)."""
    args, kwargs = clone_args(sample.args), clone_args(sample.kwargs)
    jfn = fulmen.jit(op.op, executors=executors)
    out = jfn(*args, **kwargs)
    leaves = [t for t in _tensors((args, kwargs)) if t.requires_grad]
    outs = [o for o in _tensors(out) if o.requires_grad and o.dtype.is_floating_point]
    if not leaves or not outs:
        regions = [b.sym.impl for b in fulmen.last_traces(jfn)[-1].bound_symbols if b.sym.is_fusion]
        assert all(not r.failed for r in regions), f"Inductor failed to compile a region of {op.name}"
        return out, None
    gen = torch.Generator().manual_seed(0)
    cotangents = [torch.randn(o.shape, generator=gen).to(o.device) for o in outs]
    try:
        grads = torch.autograd.grad(outs, leaves, cotangents, allow_unused=True)
    except RuntimeError as e:
        if executors == ["torch"] and "derivative for" in str(e) and "is not implemented" in str(e):
            return out, None  # not differentiable in PyTorch either
        raise
    if executors == ["inductor"]:
        traces = fulmen.last_traces(jfn)[-1:] + fulmen.last_backward_traces(jfn)[-1:]
        regions = [b.sym.impl for t in traces for b in t.bound_symbols if b.sym.is_fusion]
        assert all(not r.failed for r in regions), f"Inductor failed to compile a region of {op.name}"
    return out, grads


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("op", OPINFOS, ids=[op.name for op in OPINFOS])
def test_inductor_matches_torch_executor(op, device):
    """Forward outputs, and for differentiable ops the gradients, of one program compiled both ways."""
    sample = _first_sample(op, device, requires_grad=op.supports_grad)
    expected, expected_grads = _run(op, sample, ["torch"])
    out, grads = _run(op, sample, ["inductor"])
    for o, e in zip(_tensors(out), _tensors(expected), strict=True):
        torch.testing.assert_close(o.detach(), e.detach(), rtol=RTOL, atol=ATOL, equal_nan=True)
    if expected_grads is not None:
        for g, e in zip(grads, expected_grads, strict=True):
            if e is None:
                assert g is None or not g.any()
            else:
                torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL, equal_nan=True)
