"""Regressions for silently wrong results found by fuzzing (``fulmen.fuzz`` in its extended modes, PyTorch's op_db with
gradients, Hugging Face models with non-default configs): each test failed before its fix."""

from __future__ import annotations

import torch

import fulmen


def _jit(fn):
    return fulmen.jit(fn, executors=["torch"])


def test_view_of_a_view_written_before_sees_a_later_write_to_its_base():
    # fuzz seed 202251 (12 ops): a view made of a view after that view was written to was not refreshed by a later
    # write through the outer view (the proxies of one tensor kept separate lists of its views), so it read stale values
    def program(x):
        b = x * 1
        v1 = b[None]
        v1.mul_(2)
        v2 = v1.squeeze(0)
        v2.div_(3)
        v1[..., ::2] = 0.5
        return v2 * 1, b

    x = torch.linspace(-1, 1, 5, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        torch.testing.assert_close(_jit(program)(x), program(x), rtol=0, atol=0)
    expected, got = program(x), _jit(program)(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    cotangent = torch.linspace(1, 2, 5, dtype=torch.float64)
    (want,) = torch.autograd.grad(expected[0], x, cotangent)
    (have,) = torch.autograd.grad(got[0], x, cotangent)
    torch.testing.assert_close(have, want, rtol=0, atol=0)


def test_attention_gradient_with_a_fully_masked_row_is_eager_s():
    # Hugging Face GPT-2 with left padding (a padded query sees no key through the boolean causal + padding mask)
    # trained with NaN gradients in every parameter: the safe softmax zeroed the row's weights after a softmax whose
    # backward still multiplied by that row's NaN weights; eager's gradient there is zero
    import torch.nn.functional as F

    def attention(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    mask[:, 0] = False  # query 0 sees no key
    expected, got = attention(q, k, v, mask), _jit(attention)(q, k, v, mask)
    torch.testing.assert_close(got, expected)
    cotangent = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(expected, (q, k, v), cotangent)
    have = torch.autograd.grad(got, (q, k, v), cotangent)
    torch.testing.assert_close(have, want)
    assert torch.all(have[0][..., 0, :] == 0)
