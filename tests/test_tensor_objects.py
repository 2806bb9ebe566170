"""Objects that hold tensors, passed into and returned by jitted code (fulmen.frontend.objects): each call leaves the
caller's objects and returns objects exactly as eager does, and a structure the prologue did not see recompiles."""

import dataclasses

import pytest
import torch

import fulmen


class KVCache:
    """As a Hugging Face DynamicCache: a list of layers, each rebinding its tensors to a longer one per call."""

    def __init__(self, n_layers: int):
        self.layers = [Layer() for _ in range(n_layers)]


class Layer:
    def __init__(self):
        self.keys = None
        self.initialized = False

    def update(self, k: torch.Tensor) -> torch.Tensor:
        if not self.initialized:
            self.dtype = k.dtype
            self.keys = torch.tensor([], dtype=k.dtype)
            self.initialized = True
        self.keys = torch.cat([self.keys, k], dim=0)
        return self.keys


def step(x, cache):
    out = x
    for layer in cache.layers:
        out = out + layer.update(out * 2).sum(0)
    return out, cache


def _same_cache(got: KVCache, want: KVCache) -> None:
    assert len(got.layers) == len(want.layers)
    for g, w in zip(got.layers, want.layers):
        assert list(vars(g)) == list(vars(w))
        assert g.initialized == w.initialized and g.__dict__.get("dtype") == w.__dict__.get("dtype")
        torch.testing.assert_close(g.keys, w.keys, rtol=0, atol=0)


def test_an_object_passed_in_is_updated_as_eager_and_a_growing_tensor_in_it_becomes_dynamic():
    jitted = fulmen.jit(step, executors=["torch"])
    eager_cache, jit_cache = KVCache(2), KVCache(2)
    for _ in range(8):
        x = torch.randn(2, 3)
        want, want_cache = step(x, eager_cache)
        got, got_cache = jitted(x, jit_cache)
        assert got_cache is jit_cache  # the object passed in, not a copy or the first call's
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        _same_cache(jit_cache, eager_cache)
    # an empty cache; then the program for a filled one sees it rebind the cache to a longer tensor: one program
    # with the cache length symbolic serves every later call
    assert fulmen.cache_misses(jitted) == 2
    assert "marked dynamic (state carried between calls)" in fulmen.compile_stats(jitted).last_recompile_reason


def test_an_object_created_and_returned_is_rebuilt_on_every_call():
    def fresh(x):
        cache = KVCache(2)
        return step(x, cache)

    jitted = fulmen.jit(fresh, executors=["torch"])
    results = []
    for _ in range(3):
        x = torch.randn(2, 3)
        want, want_cache = fresh(x)
        got, got_cache = jitted(x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert type(got_cache) is KVCache
        _same_cache(got_cache, want_cache)
        results.append(got_cache)
    assert results[0] is not results[1] and results[0].layers is not results[1].layers
    assert results[0].layers[0] is not results[1].layers[0]
    assert fulmen.cache_misses(jitted) == 1


@dataclasses.dataclass
class Output:
    value: torch.Tensor
    extras: list
    note: str = "x"


def test_a_returned_dataclass_with_nested_lists_is_rebuilt_and_not_shared():
    jitted = fulmen.jit(lambda x: Output(x + 1, [x * 2, (x.sum(), 3)]), executors=["torch"])
    first = jitted(torch.ones(2))
    first.extras.append("mutated by the caller")
    second = jitted(torch.zeros(2))
    assert type(second) is Output and second.note == "x"
    torch.testing.assert_close(second.value, torch.ones(2))
    torch.testing.assert_close(second.extras[0], torch.zeros(2))
    assert len(second.extras) == 2 and second.extras[1][1] == 3
    torch.testing.assert_close(second.extras[1][0], torch.tensor(0.0))


class StaticBuffer:
    """As a StaticCache layer: preallocated tensors written in place, a position counter held as a tensor."""

    def __init__(self, size: int):
        self.keys = torch.zeros(size, 3)
        self.length = torch.tensor(0)

    def update(self, k):
        pos = torch.arange(k.shape[0]) + self.length
        self.length.add_(k.shape[0])
        self.keys.index_copy_(0, pos, k)
        return self.keys


def test_in_place_writes_into_an_objects_tensors_reach_the_callers_tensors():
    def f(x, buf):
        return buf.update(x * 3).sum(0)

    jitted = fulmen.jit(f, executors=["torch"])
    eager_buf, jit_buf = StaticBuffer(6), StaticBuffer(6)
    keys, length = jit_buf.keys, jit_buf.length
    for _ in range(3):
        x = torch.randn(2, 3)
        torch.testing.assert_close(jitted(x, jit_buf), f(x, eager_buf), rtol=0, atol=0)
        assert jit_buf.keys is keys and jit_buf.length is length  # written in place, as eager
        torch.testing.assert_close(jit_buf.keys, eager_buf.keys, rtol=0, atol=0)
        assert int(jit_buf.length) == int(eager_buf.length)
    assert fulmen.cache_misses(jitted) == 1


def test_a_structure_the_prologue_did_not_see_recompiles():
    def f(x, cache):
        return sum(layer.keys.sum() for layer in cache.layers if layer.keys is not None) + x

    jitted = fulmen.jit(f, executors=["torch"])
    cache = KVCache(2)
    for layer in cache.layers:
        layer.keys = torch.ones(2, 3)
    x = torch.zeros(())
    torch.testing.assert_close(jitted(x, cache), f(x, cache))
    cache.layers.append(Layer())  # one more layer, holding no tensor
    cache.layers[2].keys = torch.full((1, 3), 2.0)  # now it does
    torch.testing.assert_close(jitted(x, cache), f(x, cache))
    cache.layers[0].keys = None  # a member that was a tensor is None
    torch.testing.assert_close(jitted(x, cache), f(x, cache))
    cache.layers[1].extra = 1  # a new member
    torch.testing.assert_close(jitted(x, cache), f(x, cache))
    assert fulmen.cache_misses(jitted) == 4
    reasons = fulmen.compile_stats(jitted).recompile_reasons  # the path into the object, in words
    assert reasons[0] == "argument 1 (cache).layers (length) changed from 2 to 3"
    assert reasons[1] == "argument 1 (cache).layers[0].keys changed from cpu float32[2, 3] to None"
    assert "argument 1 (cache).layers[1]" in reasons[2] and "extra" in reasons[2]


def test_a_tensor_replaced_in_an_object_between_calls_is_read_anew():
    def f(cache):
        return cache.layers[0].keys * 2

    jitted = fulmen.jit(f, executors=["torch"])
    cache = KVCache(1)
    cache.layers[0].keys = torch.ones(3)
    torch.testing.assert_close(jitted(cache), torch.full((3,), 2.0))
    cache.layers[0].keys = torch.full((3,), 5.0)
    torch.testing.assert_close(jitted(cache), torch.full((3,), 10.0))
    assert fulmen.cache_misses(jitted) == 1


class Slotted:
    __slots__ = ("a", "b")

    def __init__(self, a):
        self.a = a


def test_slots_members_are_walked_set_and_rebuilt():
    def f(x, s):
        s.b = s.a + x
        return Slotted(s.b * 2)

    jitted = fulmen.jit(f, executors=["torch"])
    for _ in range(2):
        s_eager, s_jit = Slotted(torch.ones(2)), Slotted(torch.ones(2))
        x = torch.randn(2)
        want, got = f(x, s_eager), jitted(x, s_jit)
        torch.testing.assert_close(s_jit.b, s_eager.b)
        torch.testing.assert_close(got.a, want.a)
        assert not hasattr(got, "b")


def test_an_object_reached_twice_is_swapped_once_and_updated_once():
    def f(x, a, b):
        a.layers[0].update(x)
        return b.layers[0].keys.sum()

    jitted = fulmen.jit(f, executors=["torch"])
    eager, jit = KVCache(1), KVCache(1)
    for _ in range(3):
        x = torch.randn(2, 3)
        torch.testing.assert_close(jitted(x, jit, jit), f(x, eager, eager))
        _same_cache(jit, eager)
    first, second = KVCache(1), KVCache(1)  # two distinct objects: not the program compiled for one passed twice
    with pytest.raises(AttributeError):  # as eager: b's layer holds None, a's update did not fill it
        jitted(torch.ones(1, 3), first, second)
    assert first.layers[0].keys is None and not first.layers[0].initialized  # tracing failed: left as it was


class Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 3)

    def forward(self, x, cache):
        return self.proj(cache.layers[0].update(x)[-1:])

    def decode(self, x, steps):
        cache = KVCache(1)
        for _ in range(steps):
            x = self(x, cache)
        return x, cache


def test_a_method_reached_through_the_jitted_module_runs_its_forward_calls_compiled():
    model = Decoder()
    jitted = fulmen.jit(model, executors=["torch"])
    x = torch.randn(1, 3)
    with torch.no_grad():  # as generate(): x keeps requires_grad=False, the cache grows
        want, want_cache = model.decode(x, 6)
        got, got_cache = jitted.decode(x, 6)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_cache.layers[0].keys, want_cache.layers[0].keys, rtol=1e-6, atol=1e-6)
    stats = fulmen.compile_stats(jitted)
    assert stats.calls == 6 and stats.cache_misses == 3
    assert "forward" not in model.__dict__  # the routing lasts as long as the method call


def test_with_forward_hooks_a_routed_method_runs_eagerly_and_each_hook_runs_once(caplog):
    model = Decoder()
    calls = []
    model.register_forward_hook(lambda mod, args, out: calls.append(1))
    jitted = fulmen.jit(model, executors=["torch"])
    x = torch.randn(1, 3)
    want, _ = model.decode(x, 3)
    got, _ = jitted.decode(x, 3)
    torch.testing.assert_close(got, want)
    assert len(calls) == 6  # three per decode, as eager
    assert "forward hooks" in caplog.text


class Table:
    def __init__(self):
        self.entries = {"a": torch.ones(2)}
        self.pair = (torch.zeros(2), 1)


def test_dicts_and_tuples_inside_an_object_are_updated_as_eager():
    def f(x, table):
        table.entries["a"] = table.entries["a"] + x
        table.entries["b"] = x * 2
        table.pair = (table.pair[0] - x, table.pair[1] + 1)
        return table.entries["a"].sum()

    jitted = fulmen.jit(f, executors=["torch"])
    eager, jit = Table(), Table()
    entries = jit.entries
    for _ in range(2):
        x = torch.randn(2)
        torch.testing.assert_close(jitted(x, jit), f(x, eager))
        assert jit.entries is entries and list(jit.entries) == list(eager.entries)
        for k in eager.entries:
            torch.testing.assert_close(jit.entries[k], eager.entries[k])
        torch.testing.assert_close(jit.pair[0], eager.pair[0])
        assert jit.pair[1] == eager.pair[1]
