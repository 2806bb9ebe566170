"""Mamba's ``generate()`` through ``torch.compile(backend="fulmen")`` once Dynamo has made its prompt graph dynamic.
The graph calls torch.func's vmap (``associative_scan``); the backend retraces such a graph with ``make_fx``, which
applies the batching rules, symbolically when its sizes are (the small case: tests/test_dynamo.py). Before, the
dynamic graph ran with eager PyTorch (counted in ``backend_stats().eager_graphs``): the HF matrix's Mamba row.
"""

from __future__ import annotations

import pytest
import torch

from fulmen.frontend.dynamo import backend_stats, reset_backend_stats

OPTIONS = {"executors": ["torch"], "compile": "off"}


@pytest.mark.slow
@pytest.mark.usefixtures("quiet_transformers")
def test_mamba_generate_through_the_backend_with_two_prompt_lengths_compiles_every_graph():
    pytest.importorskip("transformers")
    from fulmen.bench.hf_families import FAMILIES

    family = FAMILIES["mamba"]
    reference, model = family.build(), family.build()
    torch._dynamo.reset()
    reset_backend_stats()
    model.forward = torch.compile(model.forward, backend="fulmen", options=OPTIONS)
    for length in (16, 12):  # the second prompt length makes Dynamo's prompt graph (the scan's vmap) dynamic
        ids = torch.randint(2, 256, (2, length), generator=torch.Generator().manual_seed(length))
        options = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False}
        with torch.no_grad():
            expected, got = reference.generate(ids, **options), model.generate(ids, **options)
        assert torch.equal(got, expected), (got, expected)
    stats = backend_stats()
    assert stats.graphs and stats.eager_graphs == 0, stats.eager_reasons
