"""Every OpInfo through the inductor executor: Inductor's compiled kernels against the torch executor.

For each op, the first float32 sample runs through ``fulmen.jit(op, executors=["inductor"])`` with every region
compiled before it runs (``compile_mode`` "sync", regions of a single operation included), forward and, for
differentiable ops, backward. Results are compared with the torch executor's. Inductor reorders reductions and
contracts multiply-adds, so the tolerance is a few float32 ulps wider than test_ops' (rtol 1e-4 where test_ops uses
1.3e-6, atol 1e-4): a kernel that computes the wrong function is off by far more.
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


def _first_sample(op, requires_grad=False):
    for sample in op.sample_inputs("cpu", torch.float32, requires_grad=requires_grad):
        return sample
    pytest.skip("no float32 sample")


def _tensors(x):
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _fused(jfn) -> int:
    return sum(1 for b in fulmen.last_traces(jfn)[-1].bound_symbols if b.sym.is_fusion)


@pytest.mark.parametrize("op", OPINFOS, ids=[op.name for op in OPINFOS])
def test_inductor_forward_matches_torch_executor(op):
    sample = _first_sample(op)
    expected = fulmen.jit(op.op, executors=["torch"])(*clone_args(sample.args), **clone_args(sample.kwargs))
    jfn = fulmen.jit(op.op, executors=["inductor"])
    out = jfn(*clone_args(sample.args), **clone_args(sample.kwargs))
    for o, e in zip(_tensors(out), _tensors(expected), strict=True):
        torch.testing.assert_close(o, e, rtol=RTOL, atol=ATOL, equal_nan=True)
    regions = [b.sym.impl for b in fulmen.last_traces(jfn)[-1].bound_symbols if b.sym.is_fusion]
    assert all(not r.failed for r in regions), f"Inductor failed to compile a region of {op.name}"


GRAD_OPINFOS = [op for op in OPINFOS if op.supports_grad]


@pytest.mark.parametrize("op", GRAD_OPINFOS, ids=[op.name for op in GRAD_OPINFOS])
def test_inductor_backward_matches_torch_executor(op):
    sample = _first_sample(op, requires_grad=True)
    grads = []
    for executors in (["torch"], ["inductor"]):
        args, kwargs = clone_args(sample.args), clone_args(sample.kwargs)
        leaves = [t for t in _tensors((args, kwargs)) if t.requires_grad]
        if not leaves:
            pytest.skip("the sample has no input that requires grad")
        outs = [o for o in _tensors(fulmen.jit(op.op, executors=executors)(*args, **kwargs))
                if o.requires_grad and o.dtype.is_floating_point]
        if not outs:
            pytest.skip("no differentiable output")
        gen = torch.Generator().manual_seed(0)
        cotangents = [torch.randn(o.shape, generator=gen) for o in outs]
        try:
            grads.append(torch.autograd.grad(outs, leaves, cotangents, allow_unused=True))
        except RuntimeError as e:
            if executors == ["torch"] and "derivative for" in str(e) and "is not implemented" in str(e):
                pytest.skip(f"not differentiable in PyTorch either: {e}")
            raise
    for g, e in zip(*grads, strict=True):
        if e is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL, equal_nan=True)
