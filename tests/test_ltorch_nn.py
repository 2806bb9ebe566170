"""torch.nn.functional through fulmen: activations, normalization, embedding, dropout, convolution, pooling,
interpolation, losses and attention.

``tests/test_ops.py`` runs the OpInfos of these ops for every dtype through the symbols themselves. Here each
sample goes through the *torch* callable users write (``F.cross_entropy``, ``F.relu(x, inplace=True)``), so
the routing from ``__torch_function__`` to the torch language is tested too: the trace must hold no opaque
fallback op, the jitted result and the prims-only decomposition must match eager, and so must the caller's
tensors after the call (in-place forms, batch-norm running statistics). Then the things a sample cannot
express: ``nn.BatchNorm`` modules across calls, seeded dropout, and gradients through the decompositions.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fulmen
import fulmen.tests.opinfos.nn as nn_opinfos
import fulmen.tests.opinfos.nn_conv as conv_opinfos
import fulmen.tests.opinfos.nn_losses as loss_opinfos
from fulmen.core.proxies import DataDependentError
from fulmen.core.symbol import OpTags
from fulmen.testing import clone_args as _clone
from fulmen.testing import run_decomposed
from fulmen.tests.opinfos.base import OpInfo

OPINFOS = [v for m in (nn_opinfos, conv_opinfos, loss_opinfos) for v in vars(m).values() if isinstance(v, OpInfo)]
OPINFOS = list({id(o): o for o in OPINFOS}.values())
_SEED = 1234


def _run(fn, op, sample):
    args, kwargs = _clone(sample.args), _clone(sample.kwargs)
    if op.is_random:
        torch.manual_seed(_SEED)
    return fn(*args, **kwargs), (args, kwargs)


def _assert_close(actual, expected, op, what):
    if isinstance(expected, torch.Tensor):
        rtol, atol = op.tolerances(torch.float32) or (1.3e-6, 1e-5)
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m: f"{op.name} {what}: {m}")
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _assert_close(a, e, op, what)
    elif isinstance(expected, dict):
        for k in expected:
            _assert_close(actual[k], expected[k], op, what)
    else:
        assert actual == expected, f"{op.name} {what}: {actual!r} != {expected!r}"


def _opaque_ops(trace) -> list[str]:
    found = []

    def visit(bsyms):
        for b in bsyms:
            if OpTags.FALLBACK in b.sym.tags:
                found.append(b.sym.qualified_name)
            visit(b.subsymbols)

    visit(trace.bound_symbols)
    return found


@pytest.mark.parametrize("op", OPINFOS, ids=lambda o: o.name)
def test_torch_callable_through_jit_and_decomposition(op):
    """Every float32 sample through the torch callable: jit, then prims only, both against eager."""
    for sample in op.sample_inputs("cpu", torch.float32):
        expected, eager_inputs = _run(op.torch_reference, op, sample)
        jfn = fulmen.jit(op.torch_reference)
        actual, jit_inputs = _run(jfn, op, sample)
        _assert_close(actual, expected, op, f"jit output for {sample}")
        _assert_close(jit_inputs, eager_inputs, op, f"inputs after the jitted call for {sample}")
        opaque = _opaque_ops(fulmen.last_traces(jfn)[0])
        allowed = ["torch.nn.functional.interpolate"] if sample.kwargs.get("mode") == "bicubic" else []
        assert opaque == allowed, f"{op.name} fell back to opaque torch calls {opaque} for {sample}"
        decomposed, dec_inputs = _run(lambda *a, **k: run_decomposed(op.torch_reference, *a, **k), op, sample)
        _assert_close(decomposed, expected, op, f"decomposed output for {sample}")
        _assert_close(dec_inputs, eager_inputs, op, f"inputs after the decomposed call for {sample}")


@pytest.mark.parametrize("op", [o for o in OPINFOS if o.error_input_generator is not None], ids=lambda o: o.name)
def test_error_inputs(op):
    """Bad inputs raise torch's exception type with a message naming the problem, as eager does."""
    for sample, exc_type, regex in op.error_inputs("cpu"):
        with pytest.raises(exc_type, match=regex):
            fulmen.jit(op.torch_reference)(*_clone(sample.args), **_clone(sample.kwargs))
        if not issubclass(exc_type, (NotImplementedError, DataDependentError)):
            with pytest.raises(exc_type):
                op.torch_reference(*_clone(sample.args), **_clone(sample.kwargs))


def test_symbol_ids_and_routing():
    import fulmen.torch as ltorch

    assert ltorch.cross_entropy.id == "torch.nn.functional.cross_entropy"
    assert ltorch.scaled_dot_product_attention.id == "torch.nn.functional.scaled_dot_product_attention"
    assert ltorch.layer_norm.id == "torch.nn.functional.layer_norm"

    def f(x, t):
        return F.cross_entropy(F.gelu(F.layer_norm(x, (5,))), t)

    jf = fulmen.jit(f)
    jf(torch.randn(4, 5), torch.randint(0, 5, (4,)))
    names = [b.sym.qualified_name for b in fulmen.last_traces(jf)[0].bound_symbols]
    assert names == ["ltorch.layer_norm", "ltorch.gelu", "ltorch.cross_entropy"]


# ---------------------------------------------------------------------------------------------------------
# batch norm modules: running statistics across calls


@pytest.mark.parametrize("cls, shape", [(nn.BatchNorm1d, (6, 4)), (nn.BatchNorm1d, (5, 4, 7)),
                                        (nn.BatchNorm2d, (3, 4, 5, 5))])
def test_batch_norm_module_updates_running_stats_like_eager(cls, shape):
    torch.manual_seed(0)
    eager, compiled = cls(4, momentum=0.2), cls(4, momentum=0.2)
    compiled.load_state_dict(eager.state_dict())
    jm = fulmen.jit(compiled)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(*shape)
            torch.testing.assert_close(jm(x), eager(x))
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                assert torch.equal(getattr(compiled, name), getattr(eager, name)), name
        eager.eval()
        jm.eval()
        x = torch.randn(*shape)
        torch.testing.assert_close(jm(x), eager(x))
        assert torch.equal(compiled.running_mean, eager.running_mean)  # eval leaves them alone
    assert int(compiled.num_batches_tracked) == 2


def test_batch_norm_module_with_grad_matches_eager():
    """Training with autograd: the forward runs the decomposition; the statistics match to the last ulp or so."""
    torch.manual_seed(0)
    eager, compiled = nn.BatchNorm2d(3), nn.BatchNorm2d(3)
    jm = fulmen.jit(compiled)
    for _ in range(2):
        x = torch.randn(4, 3, 5, 5)
        e, a = eager(x), jm(x)
        torch.testing.assert_close(a, e)
        (e * e).sum().backward()
        (a * a).sum().backward()
        torch.testing.assert_close(compiled.running_mean, eager.running_mean, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(compiled.running_var, eager.running_var, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(compiled.weight.grad, eager.weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(compiled.bias.grad, eager.bias.grad, rtol=1e-4, atol=1e-5)


def test_functional_batch_norm_training_records_a_functional_update():
    x, rm, rv = torch.randn(6, 3), torch.zeros(3), torch.ones(3)

    def f(x, rm, rv):
        return F.batch_norm(x, rm, rv, training=True, momentum=0.5)

    jf = fulmen.jit(f)
    out = jf(x, rm, rv)
    trace = fulmen.last_traces(jf)[0]
    names = [b.sym.qualified_name for b in trace.bound_symbols]
    assert names == ["ltorch.batch_norm_with_update", "prims.copy_", "prims.copy_"]
    rm_e, rv_e = torch.zeros(3), torch.ones(3)
    torch.testing.assert_close(out, F.batch_norm(x, rm_e, rv_e, training=True, momentum=0.5))
    assert torch.equal(rm, rm_e) and torch.equal(rv, rv_e)


# ---------------------------------------------------------------------------------------------------------
# dropout and attention dropout under a seed


@pytest.mark.parametrize("make", [
    lambda: (lambda x: F.dropout(x, 0.3), (torch.randn(64, 33),)),
    lambda: (lambda x: F.dropout(x, 0.5) * F.dropout(x, 0.5), (torch.randn(16, 16),)),  # two draws, in order
    lambda: (lambda x: F.dropout2d(x, 0.4), (torch.randn(4, 6, 3, 3),)),
    lambda: (lambda x: F.dropout(x.to(torch.bfloat16), 0.2), (torch.randn(32, 8),)),
    lambda: (lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.25), (torch.randn(2, 3, 9, 8),)),
], ids=["dropout", "two-dropouts", "dropout2d", "dropout-bf16", "sdpa-dropout"])
def test_seeded_dropout_matches_eager(make):
    fn, args = make()
    torch.manual_seed(_SEED)
    expected = fn(*args)
    jfn = fulmen.jit(fn)
    for _ in range(2):  # the first call compiles; neither may draw anything extra
        torch.manual_seed(_SEED)
        assert torch.equal(jfn(*args), expected)
    torch.manual_seed(_SEED)
    decomposed = run_decomposed(fn, *args)
    if "scaled_dot_product_attention" in str(fulmen.last_traces(jfn)[0]):
        torch.testing.assert_close(decomposed, expected)  # same mask; the math differs in the last bits
    else:
        assert torch.equal(decomposed, expected)
    torch.manual_seed(_SEED)
    fn(*args)
    after = torch.rand(3)
    torch.manual_seed(_SEED)
    jfn(*args)
    assert torch.equal(torch.rand(3), after), "the compiled call drew a different amount of randomness"


def test_dropout_decomposition_on_a_transposed_input():
    """Eager draws the mask in the input's memory order (empty_like keeps a transposed layout), and so does the
    decomposition: the same mask, the same number of draws."""
    x = torch.randn(40, 30).t()
    torch.manual_seed(_SEED)
    eager = F.dropout(x, 0.5)
    after = torch.rand(3)
    torch.manual_seed(_SEED)
    out = run_decomposed(lambda t: F.dropout(t, 0.5), x)
    assert torch.equal(out, eager)
    assert torch.equal(torch.rand(3), after)


def test_dropout_is_identity_when_not_training_or_p_zero():
    x = torch.randn(5, 5)
    for fn in (lambda t: F.dropout(t, 0.5, training=False), lambda t: F.dropout(t, 0.0)):
        jfn = fulmen.jit(fn)
        assert torch.equal(jfn(x), x)
        assert "bernoulli" not in str(fulmen.last_traces(jfn)[-1])


# ---------------------------------------------------------------------------------------------------------
# semantics samples cannot show


def test_inplace_activation_returns_the_input_and_updates_views():
    def f(x):
        v = x[1]
        F.relu(v, inplace=True)
        return F.leaky_relu_(x, 0.5)

    x = torch.randn(3, 4)
    xe = x.clone()
    out = fulmen.jit(f)(x)
    ref = f(xe)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x, xe)


def test_cross_entropy_weighted_mean_divides_by_the_weights_of_kept_targets():
    x = torch.randn(5, 4)
    t = torch.tensor([0, 3, -100, 3, 1])
    w = torch.tensor([0.5, 1.0, 2.0, 4.0])
    got = fulmen.jit(lambda x, t, w: F.cross_entropy(x, t, w))(x, t, w)
    kept = t != -100
    manual = -(w[t[kept]] * x.log_softmax(1)[kept, t[kept]]).sum() / w[t[kept]].sum()
    torch.testing.assert_close(got, manual)
    assert math.isnan(float(run_decomposed(lambda x, t: F.cross_entropy(x, t), x, torch.full((5,), -100))))


def test_one_hot_without_num_classes_needs_values():
    with pytest.raises(DataDependentError, match="num_classes"):
        fulmen.jit(lambda t: F.one_hot(t))(torch.tensor([0, 2]))


def test_l1_loss_weight_is_not_lost():
    # torch's F.l1_loss does not forward ``weight`` to __torch_function__; fulmen must still apply it
    x, y, w = torch.randn(4, 3), torch.randn(4, 3), torch.rand(4, 3)
    got = fulmen.jit(lambda x, y, w: F.l1_loss(x, y, weight=w))(x, y, w)
    torch.testing.assert_close(got, F.l1_loss(x, y, weight=w))


@pytest.mark.parametrize("fn, make_args", [
    (lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), lambda: (torch.randn(6, 5), torch.randint(0, 5, (6,)))),
    (lambda x, w, b: F.layer_norm(x, (5,), w, b), lambda: (torch.randn(4, 5), torch.randn(5), torch.randn(5))),
    (lambda q, k: F.scaled_dot_product_attention(q, k, k, is_causal=True),
     lambda: (torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8))),
    (lambda x, w: F.conv2d(x, w, padding="same"), lambda: (torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3))),
    (lambda x: F.avg_pool2d(F.max_pool2d(x, 3, 2, 1), 2, count_include_pad=False), lambda: (torch.randn(2, 3, 9, 9),)),
    (lambda x: F.interpolate(x, scale_factor=1.5, mode="bilinear"), lambda: (torch.randn(2, 3, 5, 5),)),
    (lambda x, y: F.binary_cross_entropy_with_logits(x, y), lambda: (torch.randn(4, 3), torch.rand(4, 3))),
], ids=["cross_entropy", "layer_norm", "sdpa", "conv2d", "pooling", "interpolate", "bce_logits"])
def test_gradients_match_eager(fn, make_args):
    args = make_args()
    eager_args = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    jit_args = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    expected, actual = fn(*eager_args), fulmen.jit(fn)(*jit_args)
    torch.testing.assert_close(actual, expected)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    actual.backward(grad)
    for a, e in zip(jit_args, eager_args):
        if e.requires_grad:
            torch.testing.assert_close(a.grad, e.grad, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# nn.MultiheadAttention: torch's multi_head_attention_forward traced through (masks, options, gradients)

_E, _HEADS, _L, _S, _N = 8, 2, 4, 5, 3


def _mha_masks() -> dict[str, torch.Tensor]:
    per_head = torch.rand(_N * _HEADS, _L, _S) > 0.7
    per_head[..., 0] = False  # every query keeps a key: a fully masked row is NaN in eager
    padding = torch.zeros(_N, _S, dtype=torch.bool)
    padding[0, -2:] = True
    return {"bool_2d": torch.triu(torch.ones(_L, _S, dtype=torch.bool), 1), "float_2d": torch.randn(_L, _S),
            "bool_3d": per_head, "float_3d": torch.randn(_N * _HEADS, _L, _S), "padding": padding,
            "float_padding": torch.where(padding, -1e9, 0.0)}


_MHA_CALLS = {
    "no_mask": {},
    "bool_2d": {"attn_mask": "bool_2d"},
    "float_2d": {"attn_mask": "float_2d"},
    "bool_3d": {"attn_mask": "bool_3d"},
    "float_3d": {"attn_mask": "float_3d"},
    "key_padding": {"key_padding_mask": "padding"},
    "bool_2d_and_key_padding": {"attn_mask": "bool_2d", "key_padding_mask": "padding"},
    "float_2d_and_key_padding": {"attn_mask": "float_2d", "key_padding_mask": "float_padding"},
    "no_weights": {"attn_mask": "bool_2d", "need_weights": False},
    "no_weights_key_padding": {"key_padding_mask": "padding", "need_weights": False},
    "weights_per_head": {"attn_mask": "bool_3d", "average_attn_weights": False},
}

_MHA_MODULES = {
    "batch_first": {"batch_first": True},
    "sequence_first": {},
    "kdim_vdim": {"kdim": 6, "vdim": 5, "batch_first": True},
    "kdim_vdim_sequence_first": {"kdim": 6, "vdim": 5},
    "no_bias": {"bias": False},
    "bias_kv": {"add_bias_kv": True, "batch_first": True},
    "zero_attn": {"add_zero_attn": True},
}


def _mha_inputs(m: nn.MultiheadAttention) -> list[torch.Tensor]:
    def make(length, features):
        shape = (_N, length, features) if m.batch_first else (length, _N, features)
        return torch.randn(shape, dtype=torch.float64)

    return [make(_L, _E), make(_S, m.kdim), make(_S, m.vdim)]


def _assert_mha_matches_eager(m: nn.MultiheadAttention, inputs, kwargs, what: str) -> None:
    """Outputs, input gradients and parameter gradients of ``m`` through fulmen.jit against eager (float64)."""
    reference = copy.deepcopy(m)
    actual_inputs = [x.clone().requires_grad_() for x in inputs]
    expected_inputs = [x.clone().requires_grad_() for x in inputs]
    actual = fulmen.jit(m, executors=[])(*actual_inputs, **kwargs)
    expected = reference(*expected_inputs, **kwargs)
    assert (actual[1] is None) == (expected[1] is None), what
    torch.testing.assert_close(actual, expected, msg=lambda s: f"{what} outputs: {s}")
    ct = torch.randn_like(expected[0])

    def loss(out):
        return (out[0] * ct).sum() + (out[1].square().sum() if out[1] is not None else 0)

    loss(actual).backward()
    loss(expected).backward()
    for i, (a, e) in enumerate(zip(actual_inputs, expected_inputs)):
        torch.testing.assert_close(a.grad, e.grad, msg=lambda s: f"{what} gradient of input {i}: {s}")
    for (name, p), (_, q) in zip(m.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda s: f"{what} gradient of {name}: {s}")
    m.zero_grad()


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("module", list(_MHA_MODULES))
def test_multihead_attention_matches_eager(module, training):
    """Bool and float masks (2-D, 3-D, key padding, both), need_weights and average_attn_weights, for several
    module layouts: outputs and all gradients as eager's (dropout off)."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(_E, _HEADS, **_MHA_MODULES[module]).double().train(training)
    inputs, masks = _mha_inputs(m), _mha_masks()
    for call, options in _MHA_CALLS.items():
        kwargs = {k: (masks[v] if isinstance(v, str) else v) for k, v in options.items()}
        kwargs = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                  for k, v in kwargs.items()}
        _assert_mha_matches_eager(m, inputs, kwargs, f"{module}, {call}")


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_is_causal_with_a_mask(need_weights):
    torch.manual_seed(0)
    m = nn.MultiheadAttention(_E, _HEADS, batch_first=True).double()
    x = torch.randn(2, _S, _E, dtype=torch.float64)
    mask = nn.Transformer.generate_square_subsequent_mask(_S, dtype=torch.float64)
    padding = torch.zeros(2, _S, dtype=torch.float64)
    padding[1, -1] = -1e9
    _assert_mha_matches_eager(m, [x, x, x], {"attn_mask": mask, "is_causal": True, "need_weights": need_weights},
                              "is_causal")
    _assert_mha_matches_eager(m, [x, x, x], {"attn_mask": mask, "key_padding_mask": padding, "is_causal": True,
                                             "need_weights": need_weights}, "is_causal and key padding")


def test_multihead_attention_unbatched_and_default_executors():
    torch.manual_seed(0)
    m = nn.MultiheadAttention(_E, _HEADS).requires_grad_(False)
    x = torch.randn(_S, _E)
    mask = torch.triu(torch.ones(_S, _S, dtype=torch.bool), 1)
    jm = fulmen.jit(m)
    torch.testing.assert_close(jm(x, x, x, attn_mask=mask), m(x, x, x, attn_mask=mask))
    assert _opaque_ops(fulmen.last_traces(jm)[0]) == []


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_dropout_matches_eager_under_the_same_seed(need_weights):
    """Dropout on the attention weights is drawn once, in the forward, as eager draws it: the gradient is that of
    the output returned (a backward that reran the op would draw another mask)."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(_E, _HEADS, dropout=0.3, batch_first=True).double()
    reference = copy.deepcopy(m)
    jm = fulmen.jit(m)
    x = torch.randn(2, _S, _E, dtype=torch.float64)
    mask = torch.triu(torch.ones(_S, _S, dtype=torch.bool), 1)
    xa, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(3)
    actual = jm(xa, xa, xa, attn_mask=mask, need_weights=need_weights)[0]
    torch.manual_seed(3)
    expected = reference(xe, xe, xe, attn_mask=mask, need_weights=need_weights)[0]
    torch.testing.assert_close(actual, expected)
    actual.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(xa.grad, xe.grad)
    for p, q in zip(m.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    again = jm(x, x, x, attn_mask=mask, need_weights=need_weights)[0]
    assert again.shape == actual.shape and not torch.equal(again, actual)


def test_multihead_attention_still_scripts():
    """fulmen changes nothing TorchScript reads while scripting the module (``F._none_or_dtype`` is torch's own)."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(_E, _HEADS, batch_first=True)
    x = torch.randn(2, _S, _E)
    mask = torch.triu(torch.ones(_S, _S, dtype=torch.bool), 1)
    torch.testing.assert_close(torch.jit.script(m)(x, x, x, attn_mask=mask), m(x, x, x, attn_mask=mask))
