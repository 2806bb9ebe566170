"""C++ kernels of fused CPU regions built in batches (``inductor_cpp``): the merged library gives the torch
executor's results, the generated module calls the built functions directly, a batch of several compilations
is one compiler run, the library index lets later builds (and processes) find kernels built in another batch,
anything the merge cannot take falls back to Inductor's per-kernel builds, and the precompiled header built
beside the kernels is the one later kernels use."""

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import fulmen
from fulmen.core.ambient import Ambient
from fulmen.executors import inductor, inductor_compile, inductor_cpp


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


def _jobs(*fns_and_args):
    """Background-compiler jobs for the functions, with example inputs like ``args``."""
    jobs = []
    for i, (fn, args) in enumerate(fns_and_args):
        kernel = inductor_compile.Kernel(f"test_region_{i}", Ambient.capture())
        jobs.append((kernel, fn, [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype) for a in args]))
    return jobs


def _norm_and_scale(a, b):
    return torch.nn.functional.layer_norm(a * b, (a.shape[-1],)), (a - b).amax(0)


def _softmax_mix(a):
    return (torch.softmax(a.tanh() * 2, dim=-1) + a.mean(0),)


def _only(outputs):
    (out,) = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
    return out


def test_a_batch_of_compilations_builds_as_one_library(builds, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # nothing from earlier tests in the index
    a, b = torch.randn(24, 20, dtype=torch.float64), torch.randn(24, 20, dtype=torch.float64)
    jobs = _jobs((_norm_and_scale, (a, b)), (_softmax_mix, (a,)))
    inductor_compile._compile(jobs)
    (batch,) = builds
    assert batch.merged and len(batch.groups) == 2 and all(batch.groups)
    assert batch.compiled == len(batch.kernels) == 2, "the kernels of both compilations in one compiler run"
    (k1, _, _), (k2, _, _) = jobs
    assert k1.done and k2.done and not k1.failed and not k2.failed
    for got, expected in zip(k1.fn([a, b]), _norm_and_scale(a, b)):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(_only(k2.fn([a])), _only(_softmax_mix(a)), rtol=1e-12, atol=1e-12)

    # A later build of one of the two finds its kernels in the library the batch built: no compiler run.
    inductor_cpp._loaded.clear()  # as in a new process: the library is loaded from its path in the index
    again = _jobs((_softmax_mix, (a,)))
    inductor_compile._compile(again)
    assert builds[-1].merged and builds[-1].compiled == 0
    torch.testing.assert_close(_only(again[0][0].fn([a])), _only(_softmax_mix(a)), rtol=1e-12, atol=1e-12)


def test_a_compilation_that_fails_to_lower_leaves_the_rest_of_its_batch(builds, monkeypatch, caplog):
    real_lower = inductor_compile._lower

    def lower(fn, example, cpp, *rest):
        if fn is _softmax_mix:
            raise RuntimeError("simulated lowering failure")
        return real_lower(fn, example, cpp, *rest)

    monkeypatch.setattr(inductor_compile, "_lower", lower)
    a, b = torch.randn(16, 12), torch.randn(16, 12)
    jobs = _jobs((_softmax_mix, (a,)), (_norm_and_scale, (a, b)))
    with caplog.at_level("WARNING", logger="fulmen.inductor"):
        inductor_compile._compile(jobs)
    (bad, _, _), (good, _, _) = jobs
    assert bad.done and bad.failed and bad.fn is None
    assert "simulated lowering failure" in caplog.text and "test_region_0" in caplog.text
    assert good.done and not good.failed
    for got, expected in zip(good.fn([a, b]), _norm_and_scale(a, b)):
        torch.testing.assert_close(got, expected)


def test_background_compiler_batches_the_regions_queued_together(builds, monkeypatch):
    """A training step's forward and backward regions, queued during its first compiled call, compile as one
    batch: one library."""
    # The two requests come about 3 ms apart; a longer quiet period keeps a stall of the test process on a loaded
    # machine (two xdist workers, their compilers) from splitting them into two batches.
    monkeypatch.setattr(inductor_compile, "QUIET_SECONDS", 3.0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.LayerNorm(24),
                                torch.nn.Linear(24, 6)).double()
    x = torch.randn(10, 12, dtype=torch.float64)
    jmodel = fulmen.jit(model, compile="async")
    for _ in range(3):  # the first call runs on PyTorch autograd, the second queues the regions
        jmodel(x).square().mean().backward()
        if builds:
            break
    inductor.wait_for_compilations(timeout=300)
    batches = [b for b in builds if b.kernels]
    assert len(batches) == 1 and len(batches[0].groups) >= 2, [len(b.groups) for b in batches]
    model.zero_grad()
    loss = jmodel(x).square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = model(x).square().mean()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-10, atol=1e-12)
    assert all(r.variants for r in _regions(jmodel)), "the regions run compiled"


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
    """In a process whose temporary directory (where Inductor keeps precompiled headers) starts empty, the first
    kernels build without waiting for the header, and the header built beside them is the only one built: the
    kernels built once it is ready use it instead of building one with other flags. (About 10 s: it builds the
    header.)"""
    script = textwrap.dedent("""
        import threading
        import torch, fulmen
        from fulmen.executors import inductor, inductor_cpp
        inductor.compile_mode.set("sync")
        f = fulmen.jit(lambda a: (a.exp() * 2).sum(-1) + a.mean(), executors=["inductor"])
        a = torch.randn(32, 16)
        torch.testing.assert_close(f(a), (a.exp() * 2).sum(-1) + a.mean())
        assert inductor_cpp._header_started
        for t in threading.enumerate():
            if t.name == "fulmen-precompiled-header":
                t.join()
        assert inductor_cpp._header_ready
        g = fulmen.jit(lambda a: (a.sin() * 3).amax(-1) - a.sum(), executors=["inductor"])
        torch.testing.assert_close(g(a), (a.sin() * 3).amax(-1) - a.sum())
    """)
    env = dict(os.environ, TMPDIR=str(tmp_path), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300, capture_output=True)
    headers = sorted(p.name for p in tmp_path.rglob("*.gch"))
    assert len(headers) == 1, headers


def _scaled_tanh(a):
    return ((a * 1.5).tanh() + a,)


def test_kernels_compile_for_the_programs_threads_not_the_compilers(builds, monkeypatch, tmp_path):
    """Inductor's C++ kernels specialize on the compiling thread's PyTorch thread count, and with one thread they
    have no OpenMP loops. A compiler thread holding one thread (PyTorch fixes a thread's count when it first asks
    for it: during a cap of the program's threads, that is one) still compiles the kernels of a two-thread program
    with parallel loops. Seen as gpt-small training steps 5% slower in about half of the fresh processes."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    a = torch.randn(64, 1024)
    threads = torch.get_num_threads()

    def compile_in_a_one_thread_thread(program_threads):
        jobs = _jobs((_scaled_tanh, (a,)))
        jobs[0][0].threads = program_threads

        def run():
            torch.set_num_threads(1)
            inductor_compile._compile(jobs)

        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
        torch.set_num_threads(threads)  # the worker's call set the count new threads start with
        (kernel, _, _) = jobs[0]
        assert kernel.done and not kernel.failed
        torch.testing.assert_close(_only(kernel.fn([a])), _only(_scaled_tanh(a)))
        return "\n".join(source for _, source in builds[-1].kernels)

    assert "#pragma omp parallel" not in compile_in_a_one_thread_thread(None), "a one-thread program: serial"
    assert "#pragma omp parallel" in compile_in_a_one_thread_thread(2)


def test_vector_isa_probes_that_loaded_are_remembered_across_processes(monkeypatch, tmp_path):
    from torch._inductor.cpu_vec_isa import VecAVX2, VecISA

    from fulmen.executors.inductor_isa import remembered_probe_loads

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    loads = []

    def child_process_load(self, path):  # stands in for Inductor's dlopen in a child Python
        loads.append(os.path.basename(path))
        return path.endswith("ok.so")

    monkeypatch.setattr(VecISA, "_probe_load", child_process_load)
    ok, bad = tmp_path / "ok.so", tmp_path / "bad.so"
    ok.write_bytes(b"probe")
    bad.write_bytes(b"probe")
    isa = VecAVX2()
    with remembered_probe_loads():
        assert VecISA._probe_load(isa, str(ok)) and not VecISA._probe_load(isa, str(bad))
    with remembered_probe_loads():  # a later process: the load that worked is remembered, the failure is not
        assert VecISA._probe_load(isa, str(ok)) and not VecISA._probe_load(isa, str(bad))
    assert loads == ["ok.so", "bad.so", "bad.so"]
    ok.write_bytes(b"another probe")  # rebuilt: loaded again
    with remembered_probe_loads():
        assert VecISA._probe_load(isa, str(ok))
    assert loads[-1] == "ok.so" and len(loads) == 4
    assert VecISA._probe_load is child_process_load, "the patch lasts as long as the block"
