"""Moving a scalar factor past the matrix products that read it (``fulmen.transforms.scale_pushdown``).

The rewrite runs on every backward trace. Models compare gradients with eager PyTorch and, in float64, with
finite differences; trace-level tests check when it applies and that the rewritten trace computes the same
values."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fulmen
import fulmen.torch as ltorch
from fulmen import prims
from fulmen.executors import TORCH
from fulmen.frontend.compile import execution_pipeline
from fulmen.frontend.tracing import trace_program
from fulmen.transforms.scale_pushdown import push_scale_past_matmuls

GRAD_TOL = dict(rtol=1e-4, atol=1e-5)
PROVENANCE = "Scalar factors moved past matrix products"


class _Head(nn.Module):
    """Hidden states -> logits -> cross-entropy, returning the logits too (as GPT-2 does)."""

    def __init__(self, dim=16, vocab=64, bias=False, reduction="mean"):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=bias)
        self.reduction = reduction

    def forward(self, h, targets):
        logits = self.head(torch.tanh(self.proj(h)))
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-1,
                               reduction=self.reduction)
        return logits, loss


def _big_scalar_products(trace) -> list:
    """The top-level multiplications of a tensor of the logits' size by a 0-d tensor."""
    return [b for b in trace.bound_symbols if b.sym.id == ltorch.mul.id and b.output.numel() >= 64 * 6
            and any(getattr(a, "ndim", None) == 0 for a in b.args)]


def _targets(batch=2, seq=3, vocab=64, ignored=True):
    targets = torch.randint(0, vocab, (batch, seq))
    if ignored:
        targets[0, 1] = -1
    return targets


def _after_pushdown(jitted):
    """The last backward trace the push_scale_past_matmuls step built (the pipeline keeps it under its name)."""
    steps = fulmen.compile_stats(jitted).last_backward_trace_steps
    return fulmen.last_backward_traces(jitted)[steps.index("push_scale_past_matmuls")]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_lm_head_gradient_matches_eager_without_a_logits_sized_multiply(reduction):
    torch.manual_seed(0)
    model = _Head(reduction=reduction)
    reference = copy.deepcopy(model)
    jitted = fulmen.jit(model, executors=[])
    h, targets = torch.randn(2, 3, 16), _targets()
    for step in range(2):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        logits, loss = jitted(h, targets)
        ref_logits, ref_loss = reference(h, targets)
        torch.testing.assert_close(loss, ref_loss)
        torch.testing.assert_close(logits, ref_logits)
        loss.backward()
        ref_loss.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **GRAD_TOL, msg=lambda m: f"step {step}, {name}: {m}")
    # the backward for the loss's cotangent alone (the logits get none) no longer scales a logits-sized tensor
    first = _after_pushdown(jitted)
    assert first.provenance == PROVENANCE
    assert not _big_scalar_products(first)


def test_lm_head_gradient_with_inductor_regions_matches_eager():
    torch.manual_seed(0)
    model = _Head(dim=32, vocab=256)
    reference = copy.deepcopy(model)
    jitted = fulmen.jit(model, compile="sync")
    h, targets = torch.randn(4, 8, 32), _targets(4, 8, 256)
    jitted(h, targets)[1].backward()
    reference(h, targets)[1].backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **GRAD_TOL)
    assert _after_pushdown(jitted).provenance == PROVENANCE


def test_lm_head_gradient_matches_finite_differences():
    torch.manual_seed(0)
    w = torch.randn(64, 16, dtype=torch.float64, requires_grad=True)
    h = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    targets = _targets(1, 6).view(-1)

    def loss(h, w):
        return F.cross_entropy(h @ w.t(), targets, ignore_index=-1)

    jitted = fulmen.jit(loss, executors=[])
    assert torch.autograd.gradcheck(jitted, (h, w))
    assert _after_pushdown(jitted).provenance == PROVENANCE


def test_bias_gradient_keeps_the_multiply():
    # the head's bias gradient sums the scaled tensor over its rows: a reader that is no matrix product
    torch.manual_seed(0)
    model = _Head(bias=True)
    reference = copy.deepcopy(model)
    jitted = fulmen.jit(model, executors=[])
    h, targets = torch.randn(2, 3, 16), _targets()
    jitted(h, targets)[1].backward()
    reference(h, targets)[1].backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **GRAD_TOL)
    assert _after_pushdown(jitted).provenance != PROVENANCE


# ---- the pass on traces ----

def _run(trace, args):
    fn, _ = execution_pipeline(trace, [TORCH], {})
    return fn(*args)


def _both_ways(a, s, w, x):
    t = a * s
    y = prims.matmul(prims.reshape(t, (2, 8, 32)), w)  # the result (64 elements) is smaller than w (128)
    z = prims.matmul(prims.transpose(t, (1, 0)), x)  # x (64) is smaller than the result (128)
    return y, z


def test_pass_scales_the_smaller_side_and_computes_the_same_values():
    args = (torch.randn(16, 32, dtype=torch.float64), torch.tensor(0.37, dtype=torch.float64),
            torch.randn(32, 4, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64))
    trace, _ = trace_program(_both_ways, args, {})
    rewritten = push_scale_past_matmuls(trace)
    assert rewritten.provenance == PROVENANCE
    muls = [b for b in rewritten.bound_symbols if b.sym.id == ltorch.mul.id]
    # (2, 8, 4) result scaled rather than w (32, 4); x (16, 4) scaled rather than the (32, 4) result
    assert sorted(tuple(b.output.shape) for b in muls) == [(2, 8, 4), (16, 4)]
    for got, want in zip(_run(rewritten, args), _run(trace, args)):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=0)


def _other_reader(a, s, w):
    t = a * s
    return prims.matmul(t, w), t.sum()


def _both_operands(a, s):
    t = a * s
    return prims.matmul(t, prims.transpose(t, (1, 0)))


def _returned_view(a, s, w):
    t = a * s
    r = prims.reshape(t, (4, 8, 32))
    return prims.matmul(r, w), r


def _no_saving(a, s, w):
    t = a * s  # (32, 32): the product's other operand and result are no smaller
    return prims.matmul(t, w)


@pytest.mark.parametrize("fn, shapes", [
    (_other_reader, [(32, 32), (), (32, 4)]),
    (_both_operands, [(32, 32), ()]),
    (_returned_view, [(32, 32), (), (32, 4)]),
    (_no_saving, [(32, 32), (), (32, 64)]),
], ids=["other-reader", "both-operands", "returned-view", "no-saving"])
def test_pass_leaves_the_multiply_where_moving_it_does_not_pay_or_is_not_sound(fn, shapes):
    trace, _ = trace_program(fn, tuple(torch.randn(s) for s in shapes), {})
    assert push_scale_past_matmuls(trace) is trace


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pass_leaves_half_types_alone(dtype):
    # the unscaled product is larger by 1 / s, which float16's range may not hold
    args = (torch.randn(16, 32, dtype=dtype), torch.tensor(1e-3, dtype=dtype), torch.randn(32, 4, dtype=dtype),
            torch.randn(16, 4, dtype=dtype))
    trace, _ = trace_program(_both_ways, args, {})
    assert push_scale_past_matmuls(trace) is trace
