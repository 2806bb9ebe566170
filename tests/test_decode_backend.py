"""Decoding through ``torch.compile(model, backend="fulmen")`` with fulmen's default executors (Inductor fusion):
attention that draws nothing (no dropout) is fused into the Inductor region with the operations around it, as
torch.compile's Inductor does (it calls the attention kernel from its generated code), so a decode step is one
region rather than one per stretch between attention calls; attention with dropout stays outside, drawing in
eager's order. ``generate()`` gives eager's tokens, every Dynamo graph compiled by fulmen (no eager fallback), each
compiled once.

Tiny random-config Hugging Face models from ``fulmen.bench.hf``; float32. Greedy tokens must equal eager's
exactly (the tiny models' top logits are far apart compared with the fused kernels' rounding differences), and so
must tokens sampled under the same seed (the sampling draws from the same generator state).
"""

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.core.bookkeeping import is_bookkeeping
from fulmen.core.symbol import OpTags

pytest.importorskip("transformers")

import torch._dynamo  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from fulmen.bench.hf import hf_model  # noqa: E402
from fulmen.frontend import dynamo  # noqa: E402

OPTIONS = {"compile": "sync"}  # fulmen's default executors: Inductor fusion
NEW_TOKENS = 5


def _block(x, wq, wk, wv, p: float):
    q, k, v = (x @ w for w in (wq, wk, wv))
    q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q.tanh(), k, v, dropout_p=p).transpose(1, 2).flatten(2) * 2 + x


def _top_level(jitted) -> list:
    return [b for b in fulmen.last_traces(jitted)[-1].bound_symbols if not is_bookkeeping(b)]


def test_attention_without_dropout_is_fused_with_its_neighbours():
    torch.manual_seed(0)
    x, *ws = torch.randn(2, 5, 16), *(torch.randn(16, 16) / 4 for _ in range(3))
    jitted = fulmen.jit(_block, compile="sync")
    with torch.no_grad():
        got = jitted(x, *ws, 0.0)
    torch.testing.assert_close(got, _block(x, *ws, 0.0), rtol=1e-5, atol=1e-5)
    ops = _top_level(jitted)
    assert len(ops) == 1 and ops[0].sym.is_fusion, [b.sym.name for b in ops]
    (region,) = [b.sym.impl for b in ops]
    assert region.kernels and all(k.fn is not None for k in region.kernels.values()), "Inductor compiled it"
    assert any("scaled_dot_product" in b.sym.name for b in ops[0].subsymbols)


def test_attention_with_dropout_stays_outside_the_regions_and_draws_as_eager():
    torch.manual_seed(0)
    x, *ws = torch.randn(2, 5, 16), *(torch.randn(16, 16) / 4 for _ in range(3))
    jitted = fulmen.jit(_block, compile="sync")
    with torch.no_grad():
        torch.manual_seed(3)
        got = jitted(x, *ws, 0.5)
        torch.manual_seed(3)
        want = _block(x, *ws, 0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ops = _top_level(jitted)
    attention = [b for b in ops if "scaled_dot_product" in b.sym.name]
    assert len(attention) == 1 and OpTags.RANDOM_OP in attention[0].sym.tags
    assert not any("scaled_dot_product" in s.sym.name for b in ops if b.sym.is_fusion for s in b.subsymbols)


def _model(name: str) -> torch.nn.Module:
    model = hf_model(name).eval()
    model.config.use_cache = True  # hf_model turns the cache off (training does not use it); generate does
    model.generation_config.use_cache = True
    return model


def _generate(model, ids, sample: bool, seed: int) -> torch.Tensor:
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=sample, pad_token_id=0)
    if sample:
        kwargs.update(top_k=0, top_p=1.0)  # the whole distribution: every logit matters
    if not model.config.is_encoder_decoder:
        kwargs["attention_mask"] = torch.ones_like(ids)
    torch.manual_seed(seed)
    return model.generate(ids, **kwargs)


def _check(name: str, sample: bool) -> None:
    ids = torch.randint(2, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    model = _model(name)
    with torch.no_grad():
        expected = [_generate(model, ids, sample, seed) for seed in (0, 1)]
        torch._dynamo.reset()
        dynamo.reset_backend_stats()
        counters.clear()
        model.forward = torch.compile(model.forward, backend="fulmen", options=OPTIONS)
        for seed in (0, 1):  # the second generate runs on what the first compiled
            torch.testing.assert_close(_generate(model, ids, sample, seed), expected[seed], rtol=0, atol=0)
    stats = dynamo.backend_stats()
    assert stats.eager_graphs == 0, stats.eager_reasons
    assert not counters["graph_break"], dict(counters["graph_break"])
    # the prompt, the first decode step, the decode graph with Dynamo's dynamic sizes (an encoder-decoder's
    # encoder is one more); each compiled by fulmen once
    assert 2 <= stats.graphs == counters["stats"]["unique_graphs"] <= 4
    assert stats.per_graph == [1] * stats.graphs
    with dynamo._records_lock:
        jitted = [r.jitted for r in dynamo._records.values()]
    for j in jitted:  # no attention call left outside the fused regions, and every region compiled
        ops = _top_level(j)
        assert not [b.sym.name for b in ops if "scaled_dot_product" in b.sym.name]
        regions = [b.sym.impl for b in ops if b.sym.is_fusion]
        assert regions and not any(r.failed for r in regions)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
def test_backend_generate_matrix(name, sample):
    _check(name, sample)
