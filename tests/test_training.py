"""Training through fulmen.jit: loss.backward() fills .grad exactly as eager does.

Whole models (an MLP, the built-in GPT, a LLaMA-style model with RMSNorm, rotary embeddings, SwiGLU and
grouped-query attention) train for several optimizer steps side by side with eager; the loss and every
parameter's gradient must match at every step. Then the autograd contract: accumulation, retain_graph,
inputs that do not require grad, several and unused outputs, non-tensor and integer outputs, hooks,
double backward, no_grad inference, and what the forward saves.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fulmen
from fulmen.bench.models import build
from fulmen.core.trace import check_trace

# float32 gradients through different (but exact) kernels and summation orders
GRAD_TOL = dict(rtol=1e-4, atol=1e-5)


def _assert_grads_match(model, reference, step):
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert (p.grad is None) == (q.grad is None), f"step {step}: {name}.grad is {p.grad} but eager has {q.grad}"
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **GRAD_TOL, msg=lambda m: f"step {step}, {name}: {m}")


def _train_side_by_side(name, steps=3, batch=2, lr=1e-2, **overrides):
    model, make_inputs = build(name, **overrides)
    reference = copy.deepcopy(model)
    jitted = fulmen.jit(model, executors=[])
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr)
    inputs = make_inputs(batch, targets=True)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        out, loss = jitted(*inputs)
        ref_out, ref_loss = reference(*inputs)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
        loss.backward()
        ref_loss.backward()
        _assert_grads_match(model, reference, step)
        opt.step()
        ref_opt.step()
    assert fulmen.cache_misses(jitted) == 1
    for t in fulmen.last_traces(jitted) + fulmen.last_backward_traces(jitted):
        check_trace(t)
    return jitted


def test_mlp_trains_like_eager():
    _train_side_by_side("mlp-tiny", steps=4)


def test_gpt_trains_like_eager():
    jitted = _train_side_by_side("gpt-tiny", steps=3)
    backward = str(fulmen.last_backward_traces(jitted)[-1])
    # the heavy ops' own backward kernels, not their decompositions
    for kernel in ("native_layer_norm_backward", "embedding_dense_backward"):
        assert kernel in backward, kernel
    # the loss's backward is one pass, softmax - onehot rebuilt from the logits the forward returns, not aten's
    # log-softmax backward over saved log-probabilities
    assert "_log_softmax_backward_data" not in backward


def test_llama_trains_like_eager():
    # RMSNorm (computed in float32 by hand), rotary embeddings, SwiGLU, grouped-query attention (n_kv_head < n_head)
    _train_side_by_side("llama-tiny", steps=3)


def test_gpt_with_dropout_matches_eager_under_the_same_seed():
    model, make_inputs = build("gpt-tiny", dropout=0.1)
    reference = copy.deepcopy(model)
    model.train()
    reference.train()
    jitted = fulmen.jit(model, executors=[])
    inputs = make_inputs(2, targets=True)
    for step in range(2):
        torch.manual_seed(100 + step)
        _, loss = jitted(*inputs)
        torch.manual_seed(100 + step)
        _, ref_loss = reference(*inputs)
        torch.testing.assert_close(loss, ref_loss)
        loss.backward()
        ref_loss.backward()
        _assert_grads_match(model, reference, step)


def _transformer_layer(kind: str, norm_first: bool) -> tuple[nn.Module, tuple, dict]:
    """An encoder or decoder layer (float64, no dropout), its inputs, and causal and key-padding masks."""
    torch.manual_seed(0)
    cls = nn.TransformerEncoderLayer if kind == "encoder" else nn.TransformerDecoderLayer
    layer = cls(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True, norm_first=norm_first).double()
    x, memory = torch.randn(2, 6, 16, dtype=torch.float64), torch.randn(2, 7, 16, dtype=torch.float64)
    causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=torch.float64)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, -2:] = True
    if kind == "encoder":
        return layer, (x,), {"src_mask": causal, "src_key_padding_mask": padding}
    memory_padding = torch.zeros(2, 7, dtype=torch.bool)
    memory_padding[0, -1] = True
    return layer, (x, memory), {"tgt_mask": causal, "tgt_key_padding_mask": padding,
                                "memory_key_padding_mask": memory_padding}


@pytest.mark.parametrize("entry", ["jit", "torch.compile"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_transformer_layer_trains_like_eager(kind, norm_first, masked, entry):
    """nn.TransformerEncoderLayer / DecoderLayer (nn.MultiheadAttention inside) train for 3 SGD steps with eager's
    losses and parameters; then in eval mode, where eager may take its fused fast path, the outputs still match."""
    layer, inputs, masks = _transformer_layer(kind, norm_first)
    kwargs = masks if masked else {}
    reference = copy.deepcopy(layer)
    if entry == "jit":
        # sync: a lowering left running in the background races Dynamo in the torch.compile cases (FX's tracer
        # patches nn.Module.__call__ process-wide while it runs)
        compiled = fulmen.jit(layer, compile="sync")
    else:
        torch._dynamo.reset()
        compiled = torch.compile(layer, backend="fulmen")
    opt, ref_opt = torch.optim.SGD(layer.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        loss = compiled(*inputs, **kwargs).square().mean()
        ref_loss = reference(*inputs, **kwargs).square().mean()
        torch.testing.assert_close(loss, ref_loss, msg=lambda m: f"step {step}: {m}")
        opt.zero_grad()
        ref_opt.zero_grad()
        loss.backward()
        ref_loss.backward()
        opt.step()
        ref_opt.step()
    for (name, p), (_, q) in zip(layer.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, msg=lambda m: f"{name}: {m}")
    layer.eval()
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs, **kwargs), reference(*inputs, **kwargs))


# ---------------------------------------------------------------------------------------------------------
# the autograd contract


def _pair(*shapes, dtype=torch.float64):
    a = [torch.randn(*s, dtype=dtype) for s in shapes]
    return [t.clone().requires_grad_() for t in a], [t.clone().requires_grad_() for t in a]


def test_gradients_accumulate_over_calls():
    def f(x, w):
        return (x @ w).tanh().sum()

    (x, w), (xe, we) = _pair((3, 4), (4, 5))
    jfn = fulmen.jit(f)
    for _ in range(3):
        jfn(x, w).backward()
        f(xe, we).backward()
    torch.testing.assert_close(x.grad, xe.grad)
    torch.testing.assert_close(w.grad, we.grad)
    assert fulmen.cache_hits(jfn) == 2


def test_retain_graph_and_second_backward():
    def f(x):
        return (x.exp() * x).sum()

    (x,), (xe,) = _pair((6,))
    jfn = fulmen.jit(f)
    loss, ref = jfn(x), f(xe)
    loss.backward(retain_graph=True)
    loss.backward()
    ref.backward(retain_graph=True)
    ref.backward()
    torch.testing.assert_close(x.grad, xe.grad)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_inputs_that_do_not_require_grad():
    def f(x, w, b):
        return F.linear(x, w, b).relu().sum()

    x = torch.randn(4, 3)
    w = torch.randn(5, 3, requires_grad=True)
    b = torch.randn(5)  # no grad
    jfn = fulmen.jit(f)
    jfn(x, w, b).backward()
    we = w.detach().clone().requires_grad_()
    f(x, we, b).backward()
    torch.testing.assert_close(w.grad, we.grad)
    assert b.grad is None and x.grad is None
    # gradients nobody asked for are not computed
    assert str(fulmen.last_backward_traces(jfn)[-1]).count("return (None, ") == 1


def test_several_outputs_some_unused():
    def f(x, y):
        h = x * y
        return h.sin(), h.cos().sum(), (x + 1).exp()

    (x, y), (xe, ye) = _pair((3, 3), (3, 3))
    jfn = fulmen.jit(f)
    a, b, c = jfn(x, y)
    ae, be, ce = f(xe, ye)
    b.backward()  # only the second output: the others reach the backward as None
    be.backward()
    torch.testing.assert_close(x.grad, xe.grad)
    torch.testing.assert_close(y.grad, ye.grad)
    a2, _, c2 = jfn(x, y)
    (a2.sum() + c2.sum()).backward()
    ae2, _, ce2 = f(xe, ye)
    (ae2.sum() + ce2.sum()).backward()
    torch.testing.assert_close(x.grad, xe.grad)
    torch.testing.assert_close(y.grad, ye.grad)


def test_non_tensor_and_integer_outputs():
    def f(x):
        return {"loss": (x ** 2).sum(), "argmax": x.argmax(), "n": 3, "name": "ok", "same": x}

    (x,), (xe,) = _pair((5,))
    out = fulmen.jit(f)(x)
    assert out["n"] == 3 and out["name"] == "ok"
    assert out["argmax"].dtype == torch.int64 and not out["argmax"].requires_grad
    assert out["same"].requires_grad
    (out["loss"] + out["same"].sum()).backward()
    ref = f(xe)
    (ref["loss"] + ref["same"].sum()).backward()
    torch.testing.assert_close(x.grad, xe.grad)


def test_output_not_depending_on_grad_inputs_does_not_require_grad():
    def f(x, c):
        return x * 2, c + 1

    x, c = torch.randn(3, requires_grad=True), torch.randn(3)
    a, b = fulmen.jit(f)(x, c)
    assert a.requires_grad and not b.requires_grad


def test_hooks_on_parameters_and_optimizer():
    layer = nn.Linear(4, 3)
    reference = copy.deepcopy(layer)
    seen = []
    layer.weight.register_hook(lambda g: seen.append(g.clone()) or g * 2)
    reference.weight.register_hook(lambda g: g * 2)
    jitted = fulmen.jit(layer)
    opt, ref_opt = torch.optim.SGD(layer.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    for _ in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        jitted(x).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()
        torch.testing.assert_close(layer.weight.grad, reference.weight.grad)
        torch.testing.assert_close(layer.bias.grad, reference.bias.grad)
        opt.step()
        ref_opt.step()
    assert len(seen) == 2
    torch.testing.assert_close(layer.weight, reference.weight)


def test_double_backward_is_a_clear_error():
    x = torch.randn(3, requires_grad=True)
    y = fulmen.jit(lambda x: (x ** 3).sum())(x)
    (g,) = torch.autograd.grad(y, x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward.*not supported"):
        g.sum().backward()


def test_no_grad_uses_the_inference_program():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    jitted = fulmen.jit(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        out = jitted(x)
    assert not out.requires_grad
    assert fulmen.last_backward_traces(jitted) == []
    out = jitted(x)  # grad mode is part of the cache key: a training program now
    assert out.requires_grad and fulmen.last_backward_traces(jitted)
    torch.testing.assert_close(out, model(x))


def test_returning_an_input_and_a_view():
    def f(x):
        return x, x.view(-1) * 2

    (x,), (xe,) = _pair((2, 3))
    a, b = fulmen.jit(f)(x)
    (a.sum() + b.sum()).backward()
    ae, be = f(xe)
    (ae.sum() + be.sum()).backward()
    torch.testing.assert_close(x.grad, xe.grad)


def test_buffers_updated_in_place_while_training():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    reference = copy.deepcopy(model)
    jitted = fulmen.jit(model)
    x = torch.randn(8, 4)
    jitted(x).sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(model[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad, rtol=1e-4, atol=1e-5)


def test_intermediates_are_freed_after_backward():
    """Saved activations (not inputs or outputs) live on ctx in a list the backward empties."""
    jfn = fulmen.jit(lambda x, w: (x @ w).sin().sum())
    x, w = torch.randn(16, 16), torch.randn(16, 16, requires_grad=True)
    loss = jfn(x, w)
    program = next(iter(jfn._cache.values())).program
    runtime = program.runtime
    assert runtime.list_saved, "the matmul's output should be saved as an intermediate"
    refs = [weakref.ref(t) for t in loss.grad_fn.fulmen_saved]
    loss.backward()
    gc.collect()
    assert all(r() is None for r in refs)
    assert loss.grad_fn.fulmen_saved is None


def test_forward_saves_only_what_the_backward_reads():
    def f(x, w1, w2):
        h = x @ w1
        return (h.relu() @ w2).sum()

    x, w1, w2 = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True), torch.randn(8, 2, requires_grad=True)
    jfn = fulmen.jit(f)
    jfn(x, w1, w2).backward()
    backward = fulmen.last_backward_traces(jfn)[-1]
    saved = {p.name for p in backward.bound_symbols[0].output}
    read = {p.name for b in backward.bound_symbols[1:] for p in b.flat_args}
    assert saved <= read, f"saved but never read: {saved - read}"
    assert "x" in saved and "w2" in saved and "w1" not in saved  # w1's own gradient needs x, not w1


def test_closure_tensors_get_gradients_and_untouched_inputs_come_back_as_is():
    w = torch.randn(3, requires_grad=True)
    c = torch.randn(3)
    jfn = fulmen.jit(lambda x, c: ((x * w).sin().sum(), c))
    x = torch.randn(2, 3)
    loss, same = jfn(x, c)
    assert same is c  # an input returned unchanged is returned itself, as eager does
    loss.backward()
    expected = torch.autograd.grad((x * w).sin().sum(), w)[0]
    torch.testing.assert_close(w.grad, expected)


class _TiedLM(nn.Module):
    """Token embedding shared with the output projection, as GPT-2 ties them."""

    def __init__(self, vocab=50, dim=16, padding_idx=None):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.norm = nn.LayerNorm(dim)

    def forward(self, idx, targets):
        logits = F.linear(self.norm(self.wte(idx)), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_tied_embedding_gradient_is_added_in_place(padding_idx, monkeypatch):
    torch.manual_seed(0)
    model = _TiedLM(padding_idx=padding_idx)
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 50, (4, 12))
    idx[0, :4] = 3  # repeated tokens, and the padding token when there is one
    targets = torch.randint(0, 50, (4, 12))
    added = []
    original = torch.Tensor.index_add_
    monkeypatch.setattr(torch.Tensor, "index_add_", lambda t, *a: added.append(t.data_ptr()) or original(t, *a))
    jitted = fulmen.jit(model, executors=[])
    for step in range(2):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        jitted(idx, targets).backward()
        reference(idx, targets).backward()
        _assert_grads_match(model, reference, step)
    assert "embedding_grad_add_" in str(fulmen.last_backward_traces(jitted)[-1])
    # one index_add_ a step, into the buffer that becomes the weight's .grad (the other gradient's, no new one)
    assert len(added) == 2 and added[-1] == model.wte.weight.grad.data_ptr()


def test_embedding_grad_add_never_writes_a_buffer_it_does_not_own():
    from fulmen.transforms.accumulate import _embedding_grad_add

    grad, idx = torch.randn(3, 5, 4), torch.tensor([[0, 2, 2, 7, 1], [7, 7, 0, 3, 2], [1, 1, 1, 1, 9]])
    expected = lambda acc: acc + torch.ops.aten.embedding_dense_backward(grad, idx, 10, 1, False)  # noqa: E731
    acc = torch.randn(10, 4)
    before = acc.clone()
    # another name for it, a view of it, and autograd recording: each time a new tensor, acc as it was
    for hold in (lambda t: [t], lambda t: t[2:], lambda t: t.detach()):
        held = hold(acc)
        with torch.no_grad():
            out = _embedding_grad_add(acc, grad, idx, 1)
        assert out is not acc and torch.equal(acc, before)
        torch.testing.assert_close(out, expected(acc))
        del held
    out = _embedding_grad_add(acc, grad, idx, 1)  # grad mode on
    assert out is not acc and torch.equal(acc, before)
    with torch.no_grad():  # owned outright: written in place, skipping the padding token
        out = _embedding_grad_add(acc, grad, idx, 1)
    assert out is acc
    torch.testing.assert_close(out, expected(before))


def test_embedding_grad_add_owns_its_buffer_after_a_failed_torch_compile():
    # A backend that raises leaves Dynamo's frame hook holding every call's arguments twice; ownership is judged
    # against a probe passed along the same calls, so the in-place path survives it (a fixed count did not).
    from fulmen.transforms.accumulate import _embedding_grad_add

    def broken_backend(gm, example_inputs):
        raise TypeError("this backend always fails")

    with pytest.raises(Exception, match="always fails"):
        torch.compile(lambda x: x.sin() * 2, backend=broken_backend)(torch.randn(3))
    grad, idx = torch.randn(2, 4, 4), torch.tensor([[0, 2, 2, 7], [7, 1, 0, 3]])
    acc = torch.randn(10, 4)
    expected = acc + torch.ops.aten.embedding_dense_backward(grad, idx, 10, -1, False)
    held = [acc]
    with torch.no_grad():
        out = _embedding_grad_add(acc, grad, idx, -1)  # another name holds it: out of place, even here
    assert out is not acc
    del held
    with torch.no_grad():
        out = _embedding_grad_add(acc, grad, idx, -1)
    assert out is acc
    torch.testing.assert_close(out, expected)
