"""What passes know about a symbol is declared: typed fields of ``Symbol`` and the groups in ``OpTags``.

- a misspelt field is an error, read or written (no string-keyed side dictionary to miss in);
- a new prim that carries its peers' tags is fused, rematerialized and printed like them, with no edit to a pass;
- lines that compute nothing are recognised by their tag, not by an id string.
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

import fulmen
import fulmen.torch as ltorch
from fulmen import prims
from fulmen.core.codeutils import outputs_of
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import OpTags, Symbol
from fulmen.transforms import grad_table
from fulmen.transforms.grad_table import Convention, GradEntry, Source


def test_symbol_facts_are_declared_fields():
    names = {f.name for f in dataclasses.fields(Symbol)}
    assert {"torch_impl", "torch_executable", "skip_meta_check", "like", "view_meta_fn", "always_alias"} <= names
    sym = Symbol(name="facts", id="test_symbol_metadata.facts", is_prim=True, torch_impl=torch.neg)
    assert sym.torch_impl is torch.neg and not sym.torch_executable and not sym.skip_meta_check
    with pytest.raises(AttributeError):
        sym.torch_iml = torch.neg  # a typo is an error, not a new key nobody reads
    with pytest.raises(AttributeError):
        sym.extra  # noqa: B018


def test_declared_facts_are_set_where_symbols_are_made():
    assert prims.sin.torch_impl is torch.sin and prims.sin.doc
    assert ltorch.add.torch_executable and ltorch.add.torch_impl is None
    assert ltorch.transpose.view_meta_fn is None or callable(ltorch.transpose.view_meta_fn)
    assert OpTags.VIEW in ltorch.transpose.tags


def _unary_prim(name: str, tags: tuple) -> Symbol:
    """An elementwise unary prim declared as ``make_prim`` declares one (id, meta, torch implementation, tags),
    with its VJP in the gradient table: the three places a new prim takes."""
    sym = Symbol(
        name=name,
        meta=lambda a: TensorProxy(like=a),
        id=f"test_symbol_metadata.{name}",
        is_prim=True,
        tags=tags,
        module="prims",
        torch_impl=lambda a: a * a * a,
    )
    vjp = lambda bsym, g: (ltorch.mul(ltorch.mul(g, 3.0), ltorch.mul(bsym.args[0], bsym.args[0])),)  # noqa: E731
    grad_table.put(sym, Source.PRIM, GradEntry(vjp, Convention.VJP))
    return sym


cube = _unary_prim("cube", (OpTags.ELEMENTWISE,))
untagged_cube = _unary_prim("untagged_cube", ())


def _program(op):
    return lambda a, b: ltorch.mul(ltorch.exp(op(a)), b)


def _run(op, executors):
    a = torch.randn(8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(8, dtype=torch.float64, requires_grad=True)
    jfn = fulmen.jit(_program(op), executors=executors)
    out = jfn(a, b)
    expected = torch.exp(torch.sin(a) if op is prims.sin else a**3) * b
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.sum(), (a, b))
    torch.testing.assert_close(grads, torch.autograd.grad(expected.sum(), (a, b)))
    return jfn


def _saved_names(jfn) -> list[str]:
    forward = fulmen.last_traces(jfn)[-1]
    return [p.name for p in outputs_of(forward.output)][1:]  # the program's one output, then what it saves


def test_a_new_elementwise_prim_is_rematerialized_like_its_peers():
    peer, new, untagged = (_run(op, ["torch"]) for op in (prims.sin, cube, untagged_cube))
    # elementwise ops are recomputed in the backward rather than saved: only the inputs a and b are kept
    assert len(_saved_names(peer)) == len(_saved_names(new)) == 2, (_saved_names(peer), _saved_names(new))
    assert "torchex.cube(a)" in str(fulmen.last_backward_traces(new)[-1])
    # without the tag, nothing says the op is cheap: its output is saved, the backward does not run it again
    assert len(_saved_names(untagged)) == 3
    assert "untagged_cube(" not in str(fulmen.last_backward_traces(untagged)[-1])


def test_a_new_elementwise_prim_is_fused_and_printed_like_its_peers():
    jfn = _run(cube, ["inductor"])
    computation = str(fulmen.last_traces(jfn)[0])
    assert "prims.cube(a)" in computation
    regions = [b for b in fulmen.last_traces(jfn)[-1].bound_symbols if b.sym.is_fusion]
    assert len(regions) == 1 and "prims.cube(a)" in str(regions[0]), "cube, exp and mul make one region"
    backward = [b for b in fulmen.last_backward_traces(jfn)[-1].bound_symbols if b.sym.is_fusion]
    assert any("prims.cube(a)" in str(b) for b in backward), "recomputed inside the backward's fused region"


def test_a_new_bookkeeping_symbol_is_not_counted_as_an_operation():
    from fulmen.bench.summary import summarize

    note = Symbol(
        name="note",
        meta=lambda text: None,
        id="test_symbol_metadata.note",
        is_prim=True,
        tags=(OpTags.BOOKKEEPING,),
        python_printer=lambda bsym, printer: f"# note: {bsym.args[0]}",
    )

    def fn(a):
        note("two operations follow")
        return ltorch.exp(ltorch.sin(a))

    x = torch.randn(4)
    jfn = fulmen.jit(fn, executors=["torch"])
    torch.testing.assert_close(jfn(x), torch.exp(torch.sin(x)))
    text = io.StringIO()
    summarize(jfn, name="fn", out=text)
    assert "fn: 2 ops in the computation trace" in text.getvalue(), text.getvalue()
