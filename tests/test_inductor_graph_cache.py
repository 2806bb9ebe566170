"""The on-disk cache of regions' aten graphs (fulmen/executors/inductor_graph_cache.py).

A key that two different captures could share would hand Inductor a stale graph: a silent wrong result. The key
tests change one thing at a time (a constant, a dtype, a stride, a size, autocast, a decomposition, a setting)
and require another key; the round-trip tests require that a rebuilt graph prints, and keys Inductor's cache, as
the captured one; the end-to-end tests require that a region found through the cache computes what eager and a
freshly captured compilation compute.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import fulmen
from fulmen.executors import inductor_compile
from fulmen.executors import inductor_graph_cache as graph_cache
from fulmen.executors.inductor import FusedRegion
from fulmen.executors.inductor_decomps import decomposition_table
from fulmen.executors.inductor_graph import aten_graph


def _regions(fn, *args) -> list[FusedRegion]:
    jitted = fulmen.jit(fn, compile="off")
    jitted(*args)
    trace = fulmen.last_traces(jitted)[-1]
    return [b.sym.impl for b in trace.bound_symbols if isinstance(getattr(b.sym, "impl", None), FusedRegion)]


def _region(fn, *args) -> FusedRegion:
    (region,) = _regions(fn, *args)
    return region


def _key(region: FusedRegion, example, table=None) -> str:
    key = graph_cache.region_key(region.eager, list(example), table if table is not None else decomposition_table())
    assert key is not None
    return key


def _scaled(x, y):
    return (torch.sin(x) * 2.0 + y).sum(-1)


def _scaled_other_constant(x, y):
    return (torch.sin(x) * 3.0 + y).sum(-1)


def test_keys_differ_where_the_captured_graph_could():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    region = _region(_scaled, x, y)
    key = _key(region, (x, y))
    assert _key(region, (x, y)) == key, "the same region, inputs and settings: the same key"
    assert _key(_region(_scaled, x, y), (x, y)) == key, "traced again: the same key (the region's name is not in it)"

    other = {
        "a constant": _key(_region(_scaled_other_constant, x, y), (x, y)),
        "a dtype": _key(region, (x.double(), y)),
        "a stride": _key(region, (x.t().contiguous().t(), y)),
        "a size": _key(region, (torch.randn(5, 8), torch.randn(5, 8))),
    }
    with torch.autocast("cpu", dtype=torch.bfloat16):
        other["autocast"] = _key(region, (x, y))
    table = dict(decomposition_table())
    table[torch.ops.aten.sin.default] = torch._refs.cos  # another function decomposes one operation
    other["a decomposition"] = _key(region, (x, y), table)
    with torch._inductor.config.patch(emulate_precision_casts=not torch._inductor.config.emulate_precision_casts):
        other["Inductor's configuration"] = _key(region, (x, y))
    torch.set_default_dtype(torch.float64)
    try:
        other["the default dtype"] = _key(region, (x, y))
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        other["grad mode"] = _key(region, (x, y))
    same = [what for what, k in other.items() if k == key]
    assert not same, f"a region differing in {same} gets the same key"
    assert len(set(other.values())) == len(other)


def test_symbolic_sizes_and_user_functions_are_not_cached(monkeypatch):
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    region = _region(_scaled, x, y)
    assert graph_cache.region_key(region.eager, [x, y], decomposition_table(), frozenset({(0, 0)})) is None
    monkeypatch.setattr(graph_cache, "ENABLED", False)  # FULMEN_GRAPH_CACHE=0
    assert graph_cache.region_key(region.eager, [x, y], decomposition_table()) is None
    monkeypatch.setattr(graph_cache, "ENABLED", True)

    def user_helper(t):  # its code is not covered by the key: a later process may run another version
        return t * 2

    scope = {"user_helper": user_helper, "torch": torch}
    source = "def region(a):\n  return user_helper(torch.sin(a))\n"
    exec(compile(source, "<region>", "exec"), scope)
    fn = scope["region"]
    fn.__fulmen_source__ = source
    assert graph_cache.region_key(fn, [x], decomposition_table()) is None


def test_a_rebuilt_graph_prints_and_keys_inductors_cache_as_the_captured_one():
    from torch._inductor.codecache import compiled_fx_graph_hash

    x, w = torch.randn(6, 8), torch.randn(5, 8)

    def fn(x, w):
        h = torch.nn.functional.linear(x, w).to(torch.bfloat16)
        return torch.softmax(h.float(), -1)[:, 1:], (x.t() * 2)

    region = _region(fn, x, w)
    gm = aten_graph(region.eager, [x, w], decomposition_table())
    entry = graph_cache.graph_entry(gm)
    assert entry is not None
    fake_mode = inductor_compile._fake_mode()
    fakes = [fake_mode.from_tensor(a) for a in (x, w)]
    rebuilt = graph_cache.rebuild(entry, fake_mode)
    assert rebuilt is not None and rebuilt.code == gm.code
    assert compiled_fx_graph_hash(rebuilt, fakes, {}, [])[0] == compiled_fx_graph_hash(gm, fakes, {}, [])[0]
    for a, b in zip(gm.graph.nodes, rebuilt.graph.nodes):
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(va, torch.Tensor):
            assert (va.shape, va.stride(), va.dtype, va.device) == (vb.shape, vb.stride(), vb.dtype, vb.device)

    entry["nodes"][-2] = entry["nodes"][-2][:1] + ("renamed",) + entry["nodes"][-2][2:]
    assert graph_cache.rebuild(entry, fake_mode) is None, "an entry that does not print as captured is not used"


def _captures(monkeypatch) -> list:
    from fulmen.executors import inductor_graph

    seen = []
    real = inductor_graph.aten_graph

    def counted(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(inductor_graph, "aten_graph", counted)
    return seen


def _mlp(x, w1, w2):
    # Inductor's passes rewrite this graph in place (the views become reshapes): what is kept is the graph before them
    h = torch.nn.functional.silu(x @ w1.t()).view(-1, 2, w1.shape[0] // 2) * 0.5
    return torch.nn.functional.layer_norm(h.view(x.shape[0], -1) @ w2.t(), (w2.shape[0],)), h.sum()


@pytest.mark.slow  # three Inductor compilations
def test_a_region_found_through_the_cache_computes_what_a_captured_one_does(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    captures = _captures(monkeypatch)
    torch.manual_seed(0)
    args = (
        torch.randn(8, 16, dtype=torch.float64),
        torch.randn(24, 16, dtype=torch.float64),
        torch.randn(12, 24, dtype=torch.float64),
    )
    expected = _mlp(*args)
    first = fulmen.jit(_mlp, compile="sync")(*args)
    assert len(captures) == 1 and os.listdir(tmp_path / "fulmen_graphs")

    monkeypatch.setattr(inductor_compile, "_kernels", {})  # as in a new process: no kernel shared in memory
    again = fulmen.jit(_mlp, compile="sync")
    second = again(*args)
    assert len(captures) == 1, "the second compilation rebuilt its graph from the cache"
    assert all(k.fn is not None and not k.failed for k in inductor_compile._kernels.values())
    for got, miss, want in zip(second, first, expected):
        torch.testing.assert_close(got, miss, rtol=0, atol=0)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    # The graph is kept but Inductor's cache lost the compilation: the region is captured and lowered again.
    shutil.rmtree(tmp_path / "fxgraph")
    monkeypatch.setattr(inductor_compile, "_kernels", {})
    third = fulmen.jit(_mlp, compile="sync")(*args)
    assert len(captures) == 2
    assert all(k.fn is not None and not k.failed for k in inductor_compile._kernels.values())
    for got, want in zip(third, expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_a_later_process_compiles_without_capturing_and_matches_eager(tmp_path):
    script = textwrap.dedent("""
        import json, torch, fulmen
        from fulmen.executors import inductor_graph
        captures = []
        real = inductor_graph.aten_graph
        inductor_graph.aten_graph = lambda *a, **k: captures.append(1) or real(*a, **k)
        def f(x, w):
            h = torch.nn.functional.gelu(x @ w) * x.sum(-1, keepdim=True)
            return torch.softmax(h, -1)
        torch.manual_seed(0)
        x, w = torch.randn(16, 24), torch.randn(24, 24)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = fulmen.jit(f, compile="sync")(x, w)
            want = f(x, w)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        print(json.dumps({"captures": len(captures), "out": got.float().sum().item()}))
    """)
    env = dict(os.environ, TMPDIR=str(tmp_path), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    env.pop("FULMEN_COMPILE", None)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    runs = []
    for where in ("a", "b"):  # in other working directories (some of torch's settings hold paths under it)
        (tmp_path / where).mkdir()
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, timeout=300, capture_output=True, text=True, cwd=tmp_path / where
        )
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert runs[0]["captures"] == 1 and runs[1]["captures"] == 0, runs
    assert runs[0]["out"] == runs[1]["out"]


@pytest.mark.slow  # two compilations of a Hugging Face model, one through the graph cache
def test_hf_gpt2_regions_found_through_the_cache_compute_what_captured_ones_do(monkeypatch, tmp_path):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    captures = _captures(monkeypatch)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        first = fulmen.jit(model, compile="sync")(input_ids=ids).logits
        captured = len(captures)
        monkeypatch.setattr(inductor_compile, "_kernels", {})  # as in a new process: no kernel shared in memory
        second = fulmen.jit(model, compile="sync")(input_ids=ids).logits
    assert captured and len(captures) - captured < captured, "no region of the second compilation came from the cache"
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    torch.testing.assert_close(second, expected, rtol=1e-4, atol=1e-5)
