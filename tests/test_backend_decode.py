"""A decode step's fused region, whose cache inputs grow by one position every call: the layout key that selects
its kernel is built from the last one for the inputs one C++ check finds unchanged (``FusedRegion._key``). That
key must be the one ``layout_key`` builds input by input, whatever the call changes, and the results eager's."""

from types import SimpleNamespace

import pytest
import torch

import fulmen
from fulmen.core.ambient import Ambient
from fulmen.executors import inductor
from fulmen.executors.inductor import FusedRegion
from fulmen.executors.inductor_compile import Kernel
from fulmen.executors.inductor_dynamic import layout_key


def _region_with_a_symbolic_kernel(dims: frozenset) -> FusedRegion:
    """A region whose kernel with symbolic sizes (at ``dims``) is compiled; nothing runs it here."""
    region = FusedRegion("decode_region", eager=lambda *args: None, source="", code_key=("test",))
    kernel = Kernel("decode_kernel", Ambient.capture(), dims)
    kernel.fn, kernel.done = (lambda inputs: None), True
    kernel.check = SimpleNamespace(fits_layout=lambda key: True)
    region.dynamic = kernel
    return region


def _key(region: FusedRegion, args: tuple) -> tuple:
    """The call's key as the region builds it, then the kernel with symbolic sizes found for it (which builds or
    rebuilds the growing check), as a call that misses the region's layout table does."""
    key = region._key(args)
    if region.dynamic is not None:
        region._symbolic_call(key, args)
    return key


def _calls() -> list[tuple[str, tuple]]:
    """(what changed, the region's inputs): the cache (input 1) grows; then each other fact a key holds changes."""
    torch.manual_seed(0)
    x, w = torch.randn(1, 64), torch.randn(64, 64)
    calls = [(f"cache length {n}", (x, torch.randn(1, 2, n, 16), w)) for n in range(3, 9)]
    calls += [
        ("the weight transposed (other strides)", (x, torch.randn(1, 2, 9, 16), w.t().contiguous().t())),
        ("the weight another size", (x, torch.randn(1, 2, 10, 16), torch.randn(32, 64))),
        ("the input another dtype", (x.double(), torch.randn(1, 2, 11, 16), w)),
        ("the cache a non-contiguous view", (x, torch.randn(1, 2, 16, 12).transpose(-1, -2), w)),
        ("the input a slice with a step", (torch.randn(1, 128)[:, ::2], torch.randn(1, 2, 12, 16), w)),
        ("the input expanded", (torch.randn(1, 1).expand(1, 64), torch.randn(1, 2, 13, 16), w)),
        ("back to the first layout", (x, torch.randn(1, 2, 14, 16), w)),
    ]
    return calls


def test_a_growing_inputs_key_is_the_key_built_input_by_input(monkeypatch):
    region = _region_with_a_symbolic_kernel(frozenset({(1, 2)}))
    built = []
    monkeypatch.setattr(inductor, "layout_key", lambda args: built.append(1) or layout_key(args))
    for what, args in _calls():
        built.clear()
        assert _key(region, args) == layout_key(args), what
        if what.startswith("cache length") and what != "cache length 3":
            assert not built, f"{what}: the key was built input by input"
    assert region.growing is not None and region.growing[2] == (1,)


def test_a_region_without_a_symbolic_kernel_keys_input_by_input():
    region = FusedRegion("static_region", eager=lambda *args: None, source="", code_key=("test",))
    for what, args in _calls():
        assert _key(region, args) == layout_key(args), what
    assert region.growing is None


def test_forget_fast_drops_the_growing_check():
    region = _region_with_a_symbolic_kernel(frozenset({(1, 2)}))
    _, args = _calls()[0]
    _key(region, args)
    assert region.growing is not None
    region.forget_fast()
    assert region.growing is None
    assert _key(region, args) == layout_key(args)


def _decode_step(x, k, v, w):
    q = (x @ w).view(1, 2, 1, 16)
    s = torch.softmax((q @ k.transpose(-1, -2)) * 0.25, -1)
    return (s @ v).reshape(1, 32) + x


def _fusion_regions(jf) -> list[FusedRegion]:
    return [b.sym.impl for b in fulmen.last_traces(jf)[-1].bound_symbols if b.sym.is_fusion]


@pytest.mark.slow
def test_decode_steps_match_eager_while_the_cache_grows_and_the_weight_changes_layout():
    torch.manual_seed(0)
    jf = fulmen.jit(_decode_step, executors=["inductor"], compile="sync")
    x, w = torch.randn(1, 32), torch.randn(32, 32)
    for n in range(4, 16):
        if n == 12:  # the steps so far ran the kernel with the length symbolic, keyed by the growing check
            assert any(r.growing is not None for r in _fusion_regions(jf)), "no growing check was built"
            w = w.t().contiguous().t()
        k, v = torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
        torch.testing.assert_close(jf(x, k, v, w), _decode_step(x, k, v, w))


def _hf_llama_greedy_scores(monkeypatch, max_fast_builds: int) -> tuple[torch.Tensor, list, int]:
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    monkeypatch.setattr(inductor, "MAX_FAST_BUILDS", max_fast_builds)
    built = []
    real_grow = FusedRegion._grow

    def grow(self, args, key):
        real_grow(self, args, key)
        built.append(self.growing is not None)

    monkeypatch.setattr(FusedRegion, "_grow", grow)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    eager = model.generate(ids, max_new_tokens=10, do_sample=False, output_scores=True, return_dict_in_generate=True,
                           pad_token_id=0)
    model.forward = torch.compile(model.forward, backend="fulmen", options={"compile": "sync"})
    got = model.generate(ids, max_new_tokens=10, do_sample=False, output_scores=True, return_dict_in_generate=True,
                         pad_token_id=0)
    assert torch.equal(got.sequences, eager.sequences)
    for g, e in zip(got.scores, eager.scores):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
    return torch.stack(got.scores), built


@pytest.mark.slow
def test_hf_llama_decode_keyed_by_the_growing_check_computes_what_input_by_input_keys_do(monkeypatch):
    # transformers' Llama through the torch.compile backend: the decode graph's cache grows every step, so its
    # regions take the growing check; with the check off every key is built input by input. Same kernels, same bits.
    fast, built = _hf_llama_greedy_scores(monkeypatch, inductor.MAX_FAST_BUILDS)
    assert any(built), "no region built a growing check"
    slow, built_off = _hf_llama_greedy_scores(monkeypatch, 0)
    assert not any(built_off)
    torch.testing.assert_close(fast, slow, rtol=0, atol=0)
