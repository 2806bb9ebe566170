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
from fulmen.core.codeutils import outputs_of
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import OpTags, Symbol
from fulmen.extend import OperatorExecutor
from fulmen.transforms import grad_table
from fulmen.transforms.autodiff import get_grad, put_grad, register_augmented_forward, register_backward, register_grad
from fulmen.transforms.grad_table import Convention, GradEntry, Source


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
        assert [e.rule for e in order[:2]] == [
            first.get_grad_transform(ltorch.sin),
            second.get_grad_transform(ltorch.sin),
        ]
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


# ---------------------------------------------------------------------------------------------------------
# passes match on ids and tags: a new op that carries its peers' tags is handled like them, with no edit there


def _new_prim(name: str, tags: tuple, meta, impl) -> Symbol:
    """A prim declared as ``make_prim`` declares one (meta, torch implementation, tags), under a test id so the
    table of real prims stays as it is."""
    sym = Symbol(name=name, meta=meta, id=f"test_gradient_table.{name}", is_prim=True, tags=tags, module="prims")
    sym.torch_impl = impl
    return sym


def _ones_meta(shape, *, device, dtype):
    return TensorProxy(shape=tuple(shape), device=device, dtype=dtype)


ones_prim = _new_prim(
    "ones_prim",
    (OpTags.CREATION,),
    _ones_meta,
    lambda shape, *, device, dtype: torch.ones(shape, device=device, dtype=dtype),
)
cube_prim = _new_prim(
    "cube_prim", (OpTags.ELEMENTWISE,), lambda a: TensorProxy(like=a), lambda a: a * a * a
)
grad_table.put(
    cube_prim,
    Source.PRIM,
    GradEntry(lambda b, g: (ltorch.mul(ltorch.mul(g, 3.0), ltorch.mul(b.args[0], b.args[0])),), Convention.VJP),
)


def _saved_for_backward(jfn) -> int:
    forward = fulmen.last_traces(jfn)[-1]
    return len(outputs_of(forward.output)) - 1  # the program's one output, then what the backward reads


def test_a_new_creation_prim_is_recomputed_like_full():
    x = torch.randn(64, 64, dtype=torch.float64, requires_grad=True)
    saved = {}
    for name, make in (
        ("full", lambda s, d, t: prims.full(s, 1.0, device=d, dtype=t)),
        ("new", lambda s, d, t: ones_prim(s, device=d, dtype=t)),
    ):
        jfn = fulmen.jit(
            lambda a, make=make: ltorch.mul(a, ltorch.exp(make(tuple(a.shape), a.device, a.dtype))), executors=[]
        )
        out = jfn(x)
        torch.testing.assert_close(out, x * torch.e)
        (g,) = torch.autograd.grad(out.sum(), x)
        torch.testing.assert_close(g, torch.full_like(x, torch.e))
        saved[name] = _saved_for_backward(jfn)
    assert saved["new"] == saved["full"] == 0, saved  # both recomputed in the backward, nothing saved


def test_a_new_elementwise_prim_fuses_and_differentiates_like_its_peers():
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    jfn = fulmen.jit(lambda a: ltorch.exp(cube_prim(prims.sin(a))), executors=["inductor"])
    out = jfn(x)
    expected = torch.exp(torch.sin(x) ** 3)
    torch.testing.assert_close(out, expected)
    (g,), (e,) = torch.autograd.grad(out.sum(), x), torch.autograd.grad(expected.sum(), x)
    torch.testing.assert_close(g, e)
    regions = [b for b in fulmen.last_traces(jfn)[-1].bound_symbols if b.sym.name.startswith("inductor_fusion")]
    assert len(regions) == 1 and "cube_prim" in str(regions[0]), "sin, cube_prim and exp make one region"


def test_a_new_bookkeeping_symbol_is_carried_by_every_pass():
    from fulmen.core.codegen import python_source

    note = Symbol(
        name="note",
        meta=lambda text: None,
        id="test_gradient_table.note",
        is_prim=True,
        tags=(OpTags.BOOKKEEPING,),
        python_printer=lambda bsym, printer: f"# note: {bsym.args[0]}",
    )

    def fn(a):
        note("before the exp")
        return ltorch.exp(ltorch.sin(a))

    x = torch.randn(4)
    jfn = fulmen.jit(fn, executors=["inductor"])
    torch.testing.assert_close(jfn(x), torch.exp(torch.sin(x)))
    final = fulmen.last_traces(jfn)[-1]
    regions = [b for b in final.bound_symbols if b.sym.name.startswith("inductor_fusion")]
    assert len(regions) == 1, "a bookkeeping line does not split a region"
    assert "# note: before the exp" in python_source(final)[0]


# ---------------------------------------------------------------------------------------------------------
# the aten operations fulmen's rules call are declared like any symbol and claimed through the normal path


def test_rule_ops_are_declared_symbols_that_executors_claim():
    from fulmen.executors.inductor import ex as inductor_ex
    from fulmen.executors.torchex import ex as torch_ex
    from fulmen.transforms import grad_ops

    ops = [v for v in vars(grad_ops).values() if isinstance(v, Symbol) and v.module == "torch.ops.aten"]
    assert len(ops) >= 20
    for sym in ops:
        assert sym.id == f"aten.{sym.name}" and sym.executor is None and sym.impl is None, sym
        assert sym.torch_impl is getattr(torch.ops.aten, sym.name)
    g = TensorProxy(shape=(2, 3), dtype=torch.float32, device="cpu")
    bsym = grad_ops.gelu_backward.bind(g, g, output=TensorProxy(like=g))
    assert torch_ex.can_execute(bsym)
    exec_sym = torch_ex.execution_symbol(bsym)
    assert exec_sym.qualified_name == "torch.ops.aten.gelu_backward" and exec_sym.impl is torch.ops.aten.gelu_backward
    assert inductor_ex.can_fuse(bsym)  # by the path every prim takes, no special case
    unfold = grad_ops.unfold_backward.bind(g, (2, 3), 0, 1, 1, output=TensorProxy(like=g))
    assert not inductor_ex.can_fuse(unfold)  # kept out by its id (an Inductor miscompilation)


def _hardsigmoid_backward_meta(g, a):
    return TensorProxy(like=g, requires_grad=False)


def test_a_new_aten_backward_op_runs_unfused_and_fused():
    from fulmen.transforms import grad_ops

    hardsigmoid_backward = grad_ops.aten_op("hardsigmoid_backward", _hardsigmoid_backward_meta)

    def rule(a):
        out = ltorch.hardsigmoid(a)
        put_grad(a, hardsigmoid_backward(get_grad(out), a))
        return out

    x = torch.linspace(-4.0, 4.0, 17, dtype=torch.float64)
    expected = torch.where((x > -3) & (x < 3), 1.0 / 6, 0.0).to(x.dtype)
    register_grad("torch.nn.functional.hardsigmoid", rule)
    try:
        for executors in (["torch"], ["inductor"]):
            a = x.clone().requires_grad_()
            jfn = fulmen.jit(lambda t: torch.nn.functional.hardsigmoid(t).exp(), executors=executors)
            out = jfn(a)
            (g,) = torch.autograd.grad(out, a, torch.ones_like(out))
            torch.testing.assert_close(g, expected * out.detach())
            text = str(fulmen.last_backward_traces(jfn)[-1])
            assert "torch.ops.aten.hardsigmoid_backward(" in text
            assert ("inductor_fusion" in text) == (executors == ["inductor"])
    finally:
        register_grad("torch.nn.functional.hardsigmoid", None)
