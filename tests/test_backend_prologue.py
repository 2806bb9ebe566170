"""The prologue's inference-tensor check with many tensors (a decode graph's 28): where the one C++ check of the
tensors (``TensorGuards``) passed, a comparison of the dispatch TLS with the one it was built under stands for
asking each tensor ``is_inference()``, since TensorGuards compares each tensor's autograd dispatch keys, which
inference tensors lack (``fulmen.frontend.prologue._Writer._inference_check``). Each case that the per-tensor
check rejects must still be rejected: an inference tensor where a normal one was compiled for and the reverse, the
C++ check failing for another reason, and a dispatch TLS that hides the autograd keys.
"""

from __future__ import annotations

import pytest
import torch

import fulmen
from fulmen.frontend.prologue import MIN_TENSORS_FOR_TLS

N = MIN_TENSORS_FOR_TLS + 2


def _f(*xs):
    return sum(x * (i + 1) for i, x in enumerate(xs))


def _tensors(inference: bool = False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    if inference:
        with torch.inference_mode():
            return [torch.randn(3, generator=gen) for _ in range(N)]
    return [torch.randn(3, generator=gen) for _ in range(N)]


def _compiled(xs):
    j = fulmen.jit(_f, executors=["torch"])
    torch.testing.assert_close(j(*xs), _f(*xs))
    (prologue,) = fulmen.last_prologue_traces(j)[-1:]
    assert "dispatch_include()" in str(prologue)  # the TLS comparison stands for the per-tensor check here
    return j, prologue


def test_an_inference_tensor_where_a_normal_one_was_compiled_for_recompiles():
    xs = _tensors()
    j, prologue = _compiled(xs)
    (inference,) = _tensors(inference=True)[:1]
    assert prologue.check((*xs,), {}) is not None
    assert prologue.check((inference, *xs[1:]), {}) is None
    assert prologue.check((*xs[:-1], inference), {}) is None
    out = j(inference, *xs[1:])
    assert fulmen.cache_misses(j) == 2
    torch.testing.assert_close(out, _f(inference, *xs[1:]))


def test_a_normal_tensor_where_inference_ones_were_compiled_for_recompiles():
    xs = _tensors(inference=True)
    j, prologue = _compiled(xs)
    normal = torch.randn(3)
    assert prologue.check(tuple(xs), {}) is not None
    assert prologue.check((*xs[:3], normal, *xs[4:]), {}) is None
    j(*xs[:3], normal, *xs[4:])
    assert fulmen.cache_misses(j) == 2


def test_an_inference_tensor_is_rejected_where_the_cpp_check_fails_for_another_reason():
    xs = _tensors()
    _, prologue = _compiled(xs)
    with torch.inference_mode():
        strided = torch.randn(3, 2)[:, 0]  # an inference tensor, and strides the C++ check does not take
    assert prologue.check((strided, *xs[1:]), {}) is None


def test_an_inference_tensor_is_rejected_under_a_dispatch_tls_that_adds_autograd_keys():
    # the TLS includes an autograd key: TensorGuards sees an inference tensor with it, like the normal tensor compiled
    # for; the TLS differs from the one it was built under, so each tensor is asked
    xs = _tensors()
    _, prologue = _compiled(xs)
    (inference,) = _tensors(inference=True)[:1]
    with torch._C._IncludeDispatchKeyGuard(torch._C.DispatchKey.AutogradCPU):
        assert prologue.check((inference, *xs[1:]), {}) is None


def test_inference_tensors_inside_inference_mode_are_told_apart():
    # inference mode excludes the autograd keys: the prologue built there asks each tensor
    normal = [torch.randn(3)]  # made outside inference mode
    with torch.inference_mode():
        xs = _tensors(inference=True)
        j = fulmen.jit(_f, executors=["torch"])
        j(*xs)
        (prologue,) = fulmen.last_prologue_traces(j)[-1:]
        assert prologue.check(tuple(xs), {}) is not None
        assert prologue.check((*xs[:-1], normal[0]), {}) is None
    assert "dispatch_include()" not in str(prologue)


@pytest.mark.slow
def test_a_transformers_llama_through_the_backend_is_the_same_with_the_tls_check_or_each_tensor_asked(monkeypatch):
    # the fast path (the TLS comparison standing for 28+ is_inference() calls) against the per-tensor check, on a
    # program we did not write: the same logits, bit for bit, and no recompilation on repeated calls, either way
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = [torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def logits(threshold: int) -> tuple[list[torch.Tensor], int]:
        import fulmen.frontend.prologue as prologue

        monkeypatch.setattr(prologue, "MIN_TENSORS_FOR_TLS", threshold)
        reads = []
        include_set = torch._C._dispatch_tls_local_include_set
        monkeypatch.setattr(torch._C, "_dispatch_tls_local_include_set", lambda: reads.append(1) or include_set())
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fulmen")
        with torch.no_grad():
            out = [compiled(ids[0]).logits]
            reads.clear()  # from here on cache hits only
            out += [compiled(x).logits for x in ids[1:]]
        monkeypatch.setattr(torch._C, "_dispatch_tls_local_include_set", include_set)
        return out, len(reads)

    fast, fast_reads = logits(MIN_TENSORS_FOR_TLS)
    slow, slow_reads = logits(10**9)
    # the prologue's TLS comparison ran once on each cache hit with the fast path, never without it (torch itself
    # reads the include set once a call either way)
    assert fast_reads == slow_reads + len(ids) - 1, (fast_reads, slow_reads)
    with torch.no_grad():
        eager = [model(x).logits for x in ids]
    for f, s, e in zip(fast, slow, eager):
        torch.testing.assert_close(f, s, rtol=0, atol=0)
        torch.testing.assert_close(f, e)
