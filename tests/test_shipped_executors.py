"""The shipped operator executors ``sdpa``, ``cross_entropy`` and ``fused_linear_ce`` against eager PyTorch."""

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.executors import cross_entropy as ce_module
from fulmen.executors import fused_linear_ce
from fulmen.executors.base import get_executor
from fulmen.executors.cross_entropy import cross_entropy_ex
from fulmen.executors.sdpa import sdpa_ex


def _grads(fn, args, cotangent_seed=0):
    args = [a.detach().clone().requires_grad_() if a.is_floating_point() else a for a in args]
    out = fn(*args)
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(cotangent_seed))
    diff = [a for a in args if a.requires_grad]
    return out.detach(), torch.autograd.grad(out, diff, g)


def _compare(jfn, fn, args, atol=1e-6, rtol=1e-5):
    out, grads = _grads(jfn, args)
    ref, ref_grads = _grads(fn, args)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=atol, rtol=rtol)


def test_registered_by_name():
    assert get_executor("sdpa") is sdpa_ex
    assert get_executor("cross_entropy") is cross_entropy_ex
    assert get_executor("fused_linear_ce") is fused_linear_ce.fused_linear_ce_ex


# ---- sdpa ----

def attention(q, k, v, mask=None, causal=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


@pytest.mark.parametrize("mask_kind,causal", [(None, False), (None, True), ("bool", False), ("float", False)])
def test_sdpa_matches_eager_and_saves_lse(mask_kind, causal):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)
    mask = None if mask_kind is None else (torch.randn(5, 7) if mask_kind == "float" else torch.rand(5, 7) > 0.4)
    if mask_kind == "bool":
        mask[:, 0] = True
    jfn = fulmen.jit(lambda q, k, v: attention(q, k, v, mask, causal), executors=["sdpa"])
    _compare(jfn, lambda q, k, v: attention(q, k, v, mask, causal), (q, k, v))
    forward = str(fulmen.last_traces(jfn)[-1])
    assert "sdpa_fused_forward(" in forward
    assert "sdpa_fused_backward(" in str(fulmen.last_backward_traces(jfn)[-1])
    saved = fulmen.last_traces(jfn)[-1].output[1:]
    assert all(tuple(p.shape) != (2, 3, 5, 7) for p in saved)  # never the attention matrix


def test_sdpa_declines_dropout_and_gqa():
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    jfn = fulmen.jit(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), executors=["sdpa"])
    torch.testing.assert_close(jfn(q, k, v), F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    assert "sdpa_fused_forward" not in str(fulmen.last_traces(jfn)[-1])
    jfn = fulmen.jit(lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5), executors=["sdpa"])
    jfn(q)
    assert "sdpa_fused_forward" not in str(fulmen.last_traces(jfn)[-1])


# ---- cross_entropy ----

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_cross_entropy_matches_eager(reduction, label_smoothing, monkeypatch):
    monkeypatch.setattr(ce_module, "CHUNK_ELEMENTS", 40)  # several chunks of rows
    torch.manual_seed(1)
    x, t = torch.randn(13, 9, dtype=torch.float64), torch.randint(0, 9, (13,))
    t[[2, 7]] = 4

    def f(x, t):
        return F.cross_entropy(x, t, reduction=reduction, ignore_index=4, label_smoothing=label_smoothing)

    _compare(fulmen.jit(f, executors=[cross_entropy_ex]), f, (x, t), atol=1e-12, rtol=1e-10)


def test_cross_entropy_seed_001_traces_show_fwd_and_bwd():
    logits, labels = torch.randn(32, 50), torch.randint(0, 50, (32,))

    def foo(logits, labels):
        return F.cross_entropy(logits, labels, reduction="mean", ignore_index=-1)

    cfoo = fulmen.jit(foo, executors=[cross_entropy_ex])
    torch.testing.assert_close(cfoo(logits, labels), foo(logits, labels))
    assert "cross_entropy_fwd(logits, labels, 'mean', -1, 0.0)" in str(fulmen.last_traces(cfoo)[-1])
    cfoo_grad = fulmen.grad(cfoo)
    (g_logits, _) = cfoo_grad(logits, labels)
    text = str(fulmen.last_traces(cfoo_grad)[-1])
    assert "cross_entropy_fwd(" in text and "cross_entropy_bwd(" in text
    x = logits.clone().requires_grad_()
    foo(x, labels).backward()
    torch.testing.assert_close(g_logits, x.grad)


def test_cross_entropy_declines_weights_and_probabilities():
    x, p = torch.randn(4, 5), torch.softmax(torch.randn(4, 5), -1)
    jfn = fulmen.jit(lambda x, p: F.cross_entropy(x, p), executors=[cross_entropy_ex])
    torch.testing.assert_close(jfn(x, p), F.cross_entropy(x, p))
    assert "cross_entropy_fwd" not in str(fulmen.last_traces(jfn)[-1])


# ---- fused linear + cross_entropy ----

def lm_head(h, w, b, t, reduction="mean"):
    logits = F.linear(h, w, b)
    return F.cross_entropy(logits.reshape(-1, w.shape[0]), t, reduction=reduction, ignore_index=3,
                           label_smoothing=0.1)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fused_linear_cross_entropy_matches_eager(reduction, monkeypatch):
    monkeypatch.setattr(fused_linear_ce, "CHUNK_ELEMENTS", 30)
    torch.manual_seed(2)
    h, w, b = torch.randn(2, 6, 8, dtype=torch.float64), torch.randn(11, 8, dtype=torch.float64), torch.randn(
        11, dtype=torch.float64)
    t = torch.randint(0, 11, (12,))
    t[5] = 3

    def f(h, w, b, t):
        return lm_head(h, w, b, t, reduction)

    jfn = fulmen.jit(f, executors=["fused_linear_ce"])
    _compare(jfn, f, (h, w, b, t), atol=1e-12, rtol=1e-10)
    forward = str(fulmen.last_traces(jfn)[-1])
    assert "linear_cross_entropy_fwd" in forward and "torch.nn.functional.linear(" not in forward
    saved = fulmen.last_traces(jfn)[-1].output
    assert all(tuple(p.shape) != (12, 11) for p in saved if hasattr(p, "shape"))  # logits never leave a chunk


def test_fusion_skips_logits_used_elsewhere():
    def f(h, w, t):
        logits = F.linear(h, w)
        return F.cross_entropy(logits, t), logits.sum()

    jfn = fulmen.jit(f, executors=["fused_linear_ce"])
    h, w, t = torch.randn(4, 3), torch.randn(5, 3), torch.randint(0, 5, (4,))
    torch.testing.assert_close(jfn(h, w, t), f(h, w, t))
    assert "linear_cross_entropy_fwd" not in str(fulmen.last_traces(jfn)[-1])
