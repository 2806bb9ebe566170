"""One C++ build per fused CPU region (``inductor_cpp``): the merged library gives the torch executor's results,
the generated module calls the built functions directly, anything the merge cannot take falls back to
Inductor's per-kernel builds, and the precompiled header built ahead is the one the kernels use."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fulmen
from fulmen.executors import inductor, inductor_cpp


@pytest.fixture
def sync_compile():
    token = inductor.compile_mode.set("sync")
    yield
    inductor.compile_mode.reset(token)


@pytest.fixture
def builds(monkeypatch):
    """The ``MergedBuild``s made while the test runs."""
    made = []
    original = inductor_cpp.MergedBuild.build

    def build(self):
        made.append(self)
        original(self)

    monkeypatch.setattr(inductor_cpp.MergedBuild, "build", build)
    return made


def _several_kernels(x, w):
    # a matmul between elementwise work and two reductions over different dimensions: several C++ kernels
    h = torch.tanh(x * 1.5 + 0.25) @ w
    s = torch.softmax(h, dim=-1)
    return s.sum(0) * h.mean(), torch.nn.functional.layer_norm(h.relu(), (h.shape[-1],))


def _regions(jfn):
    return [b.sym.impl for b in fulmen.last_traces(jfn)[-1].bound_symbols if b.sym.is_fusion]


def test_region_kernels_build_as_one_library_and_match_torch_executor(sync_compile, builds):
    x, w = torch.randn(48, 40, dtype=torch.float64), torch.randn(40, 24, dtype=torch.float64)
    jf = fulmen.jit(_several_kernels, executors=["inductor"])
    out = jf(x, w)
    expected = fulmen.jit(_several_kernels, executors=["torch"])(x, w)
    for o, e in zip(out, expected):
        torch.testing.assert_close(o, e, rtol=1e-12, atol=1e-12)
    merged = [b for b in builds if len(b.kernels) > 1]
    assert merged and all(b.merged for b in merged), "a region's kernels built as one library"
    # the generated module calls the built C++ functions, not the placeholders
    (region,) = _regions(jf)
    (fn,) = region.variants.values()
    scope = getattr(fn, "__func__", fn).__globals__
    kernels = {k: v for k, v in scope.items() if k.startswith("cpp_fused")}
    assert len(kernels) > 1 and all(type(v).__name__ == "builtin_function_or_method" for v in kernels.values())


def test_training_step_through_merged_kernels_matches_eager(sync_compile, builds):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 8)).double()
    x, y = torch.randn(12, 16, dtype=torch.float64), torch.randint(0, 8, (12,))
    jmodel = fulmen.jit(model)
    loss = torch.nn.functional.cross_entropy(jmodel(x), y)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = torch.nn.functional.cross_entropy(model(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-10, atol=1e-12)
    assert any(b.merged and len(b.kernels) > 1 for b in builds)


def test_unmergeable_sources_fall_back_to_per_kernel_builds(sync_compile, builds, monkeypatch, caplog):
    def refuse(kernels):
        raise ValueError("not this time")

    monkeypatch.setattr(inductor_cpp, "merged_source", refuse)
    x, w = torch.randn(40, 36), torch.randn(36, 20)
    jf = fulmen.jit(_several_kernels, executors=["inductor"])
    with caplog.at_level("INFO", logger="fulmen.inductor"):
        out = jf(x, w)
    expected = _several_kernels(x, w)
    for o, e in zip(out, expected):
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5)
    assert builds and not any(b.merged for b in builds)
    assert all(p.fn is not None for b in builds for p in b.pending)
    assert "one by one (ValueError: not this time)" in caplog.text
    assert all(r.variants for r in _regions(jf)), "the region still runs compiled"


_KERNEL = textwrap.dedent("""
    #include <torch/csrc/inductor/cpp_prefix.h>
    extern "C"  void  kernel(const float* in_ptr0,
                           float* out_ptr0,
                           const int64_t ks0)
    {
        for (int64_t i = 0; i < ks0; ++i) out_ptr0[i] = in_ptr0[i] * 2;
    }
""")


def test_merged_source_puts_each_kernel_in_its_own_namespace():
    source = inductor_cpp.merged_source([(["const float*", "float*", "const int64_t"], _KERNEL)] * 2)
    assert source.count("#include <torch/csrc/inductor/cpp_prefix.h>") == 1
    assert 'extern "C"' not in source.split("PyMODINIT_FUNC")[0]
    assert "namespace fulmen_k0" in source and "namespace fulmen_k1" in source
    assert "fulmen_k1::kernel(static_cast<float*>(tensor_data(args, 0)), static_cast<float*>(tensor_data(args, 1)), " \
           "parse_int(args, 2))" in source
    assert '{"kernel_0", kernel_0_py' in source and '{"kernel_1", kernel_1_py' in source


@pytest.mark.parametrize("bad", ["define", "no entry", "two entries", "argument type"])
def test_merged_source_refuses_what_it_does_not_understand(bad):
    source, argtypes = _KERNEL, ["const float*", "float*", "const int64_t"]
    if bad == "define":
        source = source.replace("{\n", "{\n#define TWICE(x) (2 * (x))\n", 1)
    elif bad == "no entry":
        source = source.replace('extern "C"', "static")
    elif bad == "two entries":
        source = source + source.split("\n", 2)[2]
    else:
        argtypes = ["const float*", "float*", "const bool"]
    with pytest.raises(ValueError):
        inductor_cpp.merged_source([(argtypes, source)])


def test_prefetched_header_is_the_one_the_kernels_use(tmp_path):
    """In a process whose temporary directory (where Inductor keeps precompiled headers) starts empty, the
    header built ahead of the first kernel is the only one built: the kernels found it instead of building one
    with other flags. (About 10 s: it builds the header.)"""
    script = textwrap.dedent("""
        import torch, fulmen
        from fulmen.executors import inductor
        inductor.compile_mode.set("sync")
        f = fulmen.jit(lambda a: (a.exp() * 2).sum(-1) + a.mean(), executors=["inductor"])
        a = torch.randn(32, 16)
        torch.testing.assert_close(f(a), (a.exp() * 2).sum(-1) + a.mean())
        from fulmen.executors import inductor_cpp
        assert inductor_cpp._header_started
    """)
    env = dict(os.environ, TMPDIR=str(tmp_path), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300, capture_output=True)
    headers = sorted(p.name for p in tmp_path.rglob("*.gch"))
    assert len(headers) == 1, headers
