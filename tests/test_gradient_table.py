"""The gradient table (``fulmen.transforms.grad_table``): one place that says how each symbol is differentiated.

- every registration API (``register_grad``, seed 000's augmented forward/backward, an executor's
  ``grad_transform=``, fulmen's own rules, the prims' VJPs) writes an entry there, keyed by symbol id;
- ``linearize`` takes the first entry that accepts a call, in the documented order: executors (in the
  compilation's order), ``register_grad``, augmented, builtin, prim VJP;
- passes match on ids and tags: a new op that carries the right tags is fused and rematerialized like its peers.
"""

from __future__ import annotations

import pytest
import torch

import fulmen
import fulmen.torch as ltorch
from fulmen import prims
from fulmen.extend import OperatorExecutor
from fulmen.transforms import grad_table
from fulmen.transforms.autodiff import get_grad, put_grad, register_augmented_forward, register_backward, register_grad
from fulmen.transforms.grad_table import Convention, Source


def _scaled_grad_rule(scale: float):
    """A grad transform for ``torch.sin`` whose gradient is ``scale * cos(a) * g``: which rule ran shows in
    the gradient."""

    def rule(a):
        out = ltorch.sin(a)
        put_grad(a, ltorch.mul(ltorch.mul(get_grad(out), ltorch.cos(a)), scale))
        return out

    return rule


def _sin_grad(x: torch.Tensor, executors) -> torch.Tensor:
    x = x.clone().requires_grad_()
    fulmen.jit(lambda a: torch.sin(a), executors=executors)(x).sum().backward()
    return x.grad


@pytest.fixture
def x():
    return torch.linspace(-2.0, 2.0, 7, dtype=torch.float64)


def test_every_prim_has_an_entry():
    for prim in prims.all_prims():
        entry = grad_table.get(prim.id, Source.PRIM)
        assert entry is not None, f"prims.{prim.name} has no entry in the gradient table"
        assert entry.convention in (Convention.VJP, Convention.NONE), prim.name


def test_registration_apis_write_into_the_table(x):
    sym_id = "torch.sin"
    rule = _scaled_grad_rule(2.0)
    register_grad(sym_id, rule)
    try:
        entry = grad_table.get(sym_id, Source.REGISTER_GRAD)
        assert entry.rule is rule and entry.convention is Convention.TRANSFORM
        assert grad_table.has_user_rule(sym_id)
        torch.testing.assert_close(_sin_grad(x, []), 2.0 * torch.cos(x))
    finally:
        assert register_grad(sym_id) is rule  # removing returns the rule
    assert grad_table.get(sym_id, Source.REGISTER_GRAD) is None and not grad_table.has_user_rule(sym_id)
    torch.testing.assert_close(_sin_grad(x, []), torch.cos(x))


def test_builtin_rules_and_vjps_are_entries():
    from fulmen.transforms.autodiff import vjp_rules

    assert grad_table.get("torch.nn.functional.layer_norm", Source.BUILTIN).convention is Convention.RULE_ARGS
    assert grad_table.get(prims.PrimIDs.MUL, Source.PRIM).rule is vjp_rules[prims.PrimIDs.MUL]
    assert grad_table.is_non_differentiable(prims.PrimIDs.EQ) and prims.PrimIDs.EQ not in vjp_rules
    assert grad_table.is_non_differentiable("torch.detach")


def test_executor_rule_comes_first_for_the_executors_of_the_compilation(x):
    ex = OperatorExecutor("grad_table_test_ex", version="0")
    ex.register_implementation(ltorch.sin, grad_transform=_scaled_grad_rule(3.0))
    register_grad("torch.sin", _scaled_grad_rule(2.0))
    try:
        assert grad_table.get(ltorch.sin, ex).rule is ex.get_grad_transform(ltorch.sin)
        torch.testing.assert_close(_sin_grad(x, [ex]), 3.0 * torch.cos(x))  # the executor's entry first
        torch.testing.assert_close(_sin_grad(x, []), 2.0 * torch.cos(x))  # not used: register_grad's
    finally:
        register_grad("torch.sin", None)
        grad_table.put(ltorch.sin, ex, None)


def test_a_checker_that_declines_hands_over_to_the_next_entry(x):
    first = OperatorExecutor("grad_table_test_declines", version="0")
    second = OperatorExecutor("grad_table_test_accepts", version="0")
    first.register_implementation(ltorch.sin, grad_transform=_scaled_grad_rule(5.0), checker=lambda a: False)
    second.register_implementation(ltorch.sin, grad_transform=_scaled_grad_rule(7.0), checker=lambda a: True)
    try:
        order = list(grad_table.candidates(ltorch.sin.id, [first, second]))
        assert [e.rule for e in order[:2]] == [first.get_grad_transform(ltorch.sin),
                                                second.get_grad_transform(ltorch.sin)]
        torch.testing.assert_close(_sin_grad(x, [first, second]), 7.0 * torch.cos(x))
    finally:
        for ex in (first, second):
            grad_table.put(ltorch.sin, ex, None)


def test_augmented_forward_and_backward_are_one_entry_and_what_it_saves_reaches_the_backward(x):
    """The saved cos(a) is not needed by the primal: it must still be computed in the forward."""
    sym_id = "torch.sin"

    @register_augmented_forward(sym_id)
    def fwd(a):
        return ltorch.sin(a), (ltorch.cos(a),)

    try:
        entry = grad_table.get(sym_id, Source.AUGMENTED)
        assert entry.rule is fwd and entry.backward is None
        with pytest.raises(RuntimeError, match="not both"):
            _sin_grad(x, [])

        @register_backward(sym_id)
        def bwd(cos, g):
            return ltorch.mul(ltorch.mul(g, cos), 4.0)

        entry = grad_table.get(sym_id, Source.AUGMENTED)
        assert (entry.rule, entry.backward, entry.convention) == (fwd, bwd, Convention.AUGMENTED)
        torch.testing.assert_close(_sin_grad(x, []), 4.0 * torch.cos(x))
    finally:
        grad_table.put(sym_id, Source.AUGMENTED, None)
