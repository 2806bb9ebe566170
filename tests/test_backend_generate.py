"""Hugging Face ``generate()`` with ``backend="fulmen"``: the same tokens as eager, every Dynamo graph compiled by
fulmen (none left to eager PyTorch), and one fulmen compilation per Dynamo graph, the decode graph with Dynamo's
dynamic sizes reused for every later token.

The models are tiny random-config ones from ``fulmen.bench.hf`` (nothing is downloaded). The decode graphs reuse
one program as the cache grows, which is what the compilation counts check.
"""

import pytest
import torch

pytest.importorskip("transformers")

import torch._dynamo  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from fulmen.bench.hf import hf_model  # noqa: E402
from fulmen.frontend.dynamo import backend_stats, reset_backend_stats  # noqa: E402

OPTIONS = {"executors": ["torch"], "compile": "sync"}
NEW_TOKENS = 6


def _model(name: str) -> torch.nn.Module:
    model = hf_model(name).eval()
    model.config.use_cache = True  # hf_model turns the cache off (training does not use it); generate does
    model.generation_config.use_cache = True
    return model


def _generate_kwargs(model, ids: torch.Tensor, sample: bool, cache: str) -> dict:
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=sample, pad_token_id=0)
    if sample:
        kwargs.update(top_k=0, top_p=1.0)  # sample from the whole distribution: every logit matters
    if not model.config.is_encoder_decoder:
        kwargs["attention_mask"] = torch.ones_like(ids)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    return kwargs


def _generate(model, ids, kwargs, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return model.generate(ids, **kwargs)


def _check_generate(name: str, how: str, cache: str, sample: bool, options: dict = OPTIONS) -> None:
    ids = torch.randint(2, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    model = _model(name)
    kwargs = _generate_kwargs(model, ids, sample, cache)
    expected = [_generate(model, ids, kwargs, seed) for seed in (0, 1)]

    torch._dynamo.reset()
    reset_backend_stats()
    counters.clear()
    if how == "forward":
        model.forward = torch.compile(model.forward, backend="fulmen", options=options)
    else:  # nn.Module.compile: the module's own calls (generate calls self(...)) go through Dynamo
        model.compile(backend="fulmen", options=options)
    for seed in (0, 1):  # the second generate runs on the programs the first compiled
        torch.testing.assert_close(_generate(model, ids, kwargs, seed), expected[seed], rtol=0, atol=0)

    stats = backend_stats()
    assert stats.eager_graphs == 0, stats.eager_reasons  # no graph fell back to eager PyTorch
    assert not counters["graph_break"], dict(counters["graph_break"])
    # every graph Dynamo captured reached fulmen, and each compiled once: the prompt, the first decode step (Dynamo
    # compiles it before it sees a second size) and, for a growing cache, one graph with dynamic sizes for the rest
    assert stats.graphs == counters["stats"]["unique_graphs"] >= 2
    assert stats.per_graph == [1] * stats.graphs
    assert stats.graphs <= (2 if cache == "static" else 3)


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
def test_greedy_generate_matches_eager_and_compiles_each_graph_once(name):
    _check_generate(name, "forward", "dynamic", sample=False)


def test_sampling_with_a_static_cache_matches_eager():
    _check_generate("llama", "forward", "static", sample=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
@pytest.mark.parametrize("how", ["forward", "module"])
def test_generate_matrix(name, cache, sample, how):
    _check_generate(name, how, cache, sample)


@pytest.mark.slow
def test_generate_with_fulmens_default_executors():
    _check_generate("llama", "forward", "dynamic", sample=False, options={"compile": "sync"})


def test_a_dynamic_dynamo_graph_compiles_once():
    """A graph Dynamo compiled for every size of a dimension is traced by fulmen with that dimension symbolic from
    its first call: no second compilation when the size changes again."""
    torch._dynamo.reset()
    reset_backend_stats()

    def f(x, cache):
        return torch.cat([cache, x], dim=1).softmax(-1)

    compiled = torch.compile(f, backend="fulmen", options=OPTIONS)
    x = torch.randn(2, 1, 4)
    for n in (3, 4, 5, 6, 7):  # n=3: static graph; n=4: Dynamo's dynamic graph, then reused
        cache = torch.randn(2, n, 4)
        torch.testing.assert_close(compiled(x, cache), f(x, cache))
    stats = backend_stats()
    assert stats.graphs == 2 and stats.per_graph == [1, 1] and stats.eager_graphs == 0


def test_backend_stats_report_a_graph_run_eagerly():
    """A graph fulmen cannot trace (a Python float passed as a 0-d tensor and read with .item()) is counted, with
    why, rather than running eagerly unseen."""
    torch._dynamo.reset()
    reset_backend_stats()

    def f(x, k):
        return x.sin() * k + 1

    compiled = torch.compile(f, backend="fulmen", options=OPTIONS)
    x = torch.randn(5)
    for k in (0.5, 0.7, -3.0):
        torch.testing.assert_close(compiled(x, k), f(x, k))
    stats = backend_stats()
    assert stats.eager_graphs == 1 and len(stats.eager_reasons) == 1
    reset_backend_stats()
    assert backend_stats().graphs == 0
