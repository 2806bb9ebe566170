"""Regressions for the soundness leftovers of the fuzzing campaigns (session 34's "found and left open"): each test
failed before its fix."""

from __future__ import annotations

import pytest
import torch

import fulmen


def _jit(fn):
    return fulmen.jit(fn, executors=["torch"])


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


_REQUIRES_GRAD_CASES = {
    "fill": lambda x: torch.fill(x, 2.0),
    "fill_tensor": lambda x: torch.fill(x, torch.tensor(2.0)),
    "floor_divide": lambda x: x // 2,
    "rfloor_divide": lambda x: 2.0 // x,
    "div_floor": lambda x: torch.div(x, 2, rounding_mode="floor"),
    "lu_unpack": lambda x: torch.lu_unpack(*torch.linalg.lu_factor(x)),
    "fill_then_use": lambda x: (torch.fill(x, 1.5) * x).sum(),
}


@pytest.mark.parametrize("case", sorted(_REQUIRES_GRAD_CASES))
def test_requires_grad_of_outputs_is_eager_s_on_every_call(case):
    # the compiled program (second call on) marked outputs by its own gradient graph: fill and floor division gave
    # results that did not require grad, lu_unpack's permutation one that did
    fn = _REQUIRES_GRAD_CASES[case]
    x = torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) + 3 * torch.eye(3)
    x.requires_grad_()
    expected = _outputs(fn(x))
    jitted = _jit(fn)
    for _ in range(3):
        got = _outputs(jitted(x))
        assert [t.requires_grad for t in got] == [t.requires_grad for t in expected]
    if case in ("floor_divide", "rfloor_divide"):
        return  # eager's floor_divide has no backward ("derivative ... is not implemented")
    outs = [(e, g) for e, g in zip(expected, got) if e.requires_grad]
    cotangents = [torch.linspace(-1, 1, e.numel(), dtype=e.dtype).reshape(e.shape) for e, _ in outs]
    want = torch.autograd.grad([e for e, _ in outs], x, cotangents, materialize_grads=True)
    have = torch.autograd.grad([g for _, g in outs], x, cotangents, materialize_grads=True)
    torch.testing.assert_close(have, want)
