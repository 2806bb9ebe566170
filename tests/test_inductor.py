"""The inductor fusion executor: fused regions give the torch executor's results, swap in when compiled,
keep one variant per stride pattern, fall back (and say so) when Inductor fails, and never reorder work
into a cycle on randomly generated programs, and come from Inductor's on-disk graph cache in a later process."""

import copy
import json
import logging
import os
import random
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import fulmen
from fulmen.core.bookkeeping import is_bookkeeping
from fulmen.executors import inductor, inductor_compile


@pytest.fixture
def sync_compile():
    token = inductor.compile_mode.set("sync")
    yield
    inductor.compile_mode.reset(token)


def _fused_regions(jfn):
    return [b for b in fulmen.last_traces(jfn)[-1].bound_symbols if b.sym.is_fusion]


def test_fused_region_matches_torch_executor(sync_compile):
    def f(a, b):
        c = b * a + 1.0
        return (c.exp() * a).sum(-1), torch.sin(c * 2) - a

    a, b = torch.randn(64, 32), torch.randn(64, 32)
    jf = fulmen.jit(f, executors=["inductor"])
    out = jf(a, b)
    assert _fused_regions(jf), "expected at least one fused region"
    region = _fused_regions(jf)[0].sym.impl
    assert region.variants, "sync mode compiles before the first call returns"
    expected = fulmen.jit(f, executors=["torch"])(a, b)
    for o, e in zip(out, expected):
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_first_cuda_region_starts_inductors_triton_workers(sync_compile, monkeypatch, device):
    """As torch.compile does, so that the first regions' Triton kernels need not compile one by one in-process
    while the worker pool starts; C++ kernels (CPU) compile without that pool."""
    import torch._inductor.async_compile as async_compile

    calls = []
    monkeypatch.setattr(inductor_compile, "_pool_started", False)
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: calls.append(device))
    a = torch.randn(16, 8, device=device)
    jf = fulmen.jit(lambda a: (a * 1.75 - 0.5).tanh() * a, executors=["inductor"])
    torch.testing.assert_close(jf(a), (a * 1.75 - 0.5).tanh() * a, rtol=1e-5, atol=1e-6)
    assert _fused_regions(jf)[0].sym.impl.variants, "the region compiled"
    assert calls == ([device] if device == "cuda" else [])


def test_async_mode_runs_eagerly_then_swaps_in():
    token = inductor.compile_mode.set("async")
    try:
        _async_mode_runs_eagerly_then_swaps_in()
    finally:
        inductor.compile_mode.reset(token)


def _async_mode_runs_eagerly_then_swaps_in():
    def f(a):
        return (a * 3 + 2).cos() * a

    a = torch.randn(32, 8)
    jf = fulmen.jit(f, executors=["inductor"])
    first = jf(a)  # returns without waiting for Inductor
    torch.testing.assert_close(first, f(a))
    region = _fused_regions(jf)[0].sym.impl
    assert not region.variants, "the first call must not wait for Inductor"
    inductor.wait_for_compilations(timeout=300)
    torch.testing.assert_close(jf(a), f(a))
    assert region.variants and not region.failed, "the compiled kernel swaps in on the next call"


def test_background_compiler_frees_its_example_inputs(monkeypatch):
    """Example inputs are real allocations (GPU memory on a GPU); the idle worker must not keep the last ones."""
    import time
    import weakref

    refs = []
    real_compile = inductor_compile._compile

    def spy(jobs):
        refs.extend(weakref.ref(t) for _, _, example in jobs for t in example)
        real_compile(jobs)

    monkeypatch.setattr(inductor_compile, "_compile", spy)
    token = inductor.compile_mode.set("async")
    try:
        jf = fulmen.jit(lambda a: (a * 2.25 + 0.75).sin() * a, executors=["inductor"])
        jf(torch.randn(64, 16))
        inductor.wait_for_compilations(timeout=300)
    finally:
        inductor.compile_mode.reset(token)
    deadline = time.monotonic() + 30
    while any(r() is not None for r in refs) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert refs and all(r() is None for r in refs)


_threads_seen: list[int] = []


@torch.library.custom_op("fulmen_test::threads_seen", mutates_args=())
def _record_threads(x: torch.Tensor) -> torch.Tensor:
    """An opaque operation (it runs outside any region) that records the PyTorch threads it runs with."""
    _threads_seen.append(torch.get_num_threads())
    return x.clone()


_record_threads.register_fake(lambda x: torch.empty_like(x))
_record_threads.register_autograd(lambda ctx, g: _record_threads(g))


def test_programs_leave_a_core_to_the_background_compiler(monkeypatch):
    """While the background compiler works, a jitted program -- its forward, and the backward autograd runs --
    caps PyTorch's threads one below the cores, outside its regions as well as in their unfused runs, and
    restores them afterwards; outside a compilation nothing changes."""
    import threading

    started, release = threading.Event(), threading.Event()
    real_compile = inductor_compile._compile

    def held(jobs):
        started.set()
        release.wait(timeout=120)
        real_compile(jobs)

    monkeypatch.setattr(inductor_compile, "_compile", held)
    monkeypatch.setattr(inductor_compile, "usable_cores", lambda: 3)
    threads = torch.get_num_threads()
    token = inductor.compile_mode.set("async")
    torch.set_num_threads(3)

    def f(a, w):
        return _record_threads((a * w * 1.75 - 0.5).exp()).sum()

    a, w = torch.randn(16, 8), torch.randn(16, 8, requires_grad=True)
    expected_grad = torch.autograd.grad(f(a, w), w)[0]
    try:
        assert inductor_compile.call_leaving_a_core(torch.get_num_threads) == 3, "no compiler at work"
        jf = fulmen.jit(f, executors=["inductor", "torch"])
        jf(a, w).backward()
        region = _fused_regions(jf)[0].sym.impl
        in_region, eager = [], region.eager

        def spy(*args):
            in_region.append(torch.get_num_threads())
            return eager(*args)

        region.eager = spy
        assert started.wait(timeout=60), "the background compiler did not start"
        both = inductor_compile.call_leaving_a_core(
            lambda: (torch.get_num_threads(), inductor_compile.program_threads()))
        assert both == (2, 3), "capped at 2; kernels asked for now still compile for the program's 3 threads"
        _threads_seen.clear()
        w.grad = None
        jf(a, w).backward()
        torch.testing.assert_close(w.grad, expected_grad)
        assert _threads_seen == [2, 2] and in_region == [2], "forward and backward, outside and inside the region"
        assert torch.get_num_threads() == 3
        release.set()
        inductor.wait_for_compilations(timeout=300)
        _threads_seen.clear()
        w.grad = None
        jf(a, w).backward()
        torch.testing.assert_close(w.grad, expected_grad)
        assert _threads_seen == [3, 3] and in_region == [2] and region.variants, "compiled: full threads again"
        assert torch.get_num_threads() == 3
    finally:
        release.set()
        inductor.compile_mode.reset(token)
        torch.set_num_threads(threads)


def test_jit_compile_option_sets_the_mode_of_forward_and_backward_regions():
    # the suite's default mode is "off" (conftest): compile="sync" on one function overrides it, and the backward,
    # compiled at its first call, inherits it
    def f(a, w):
        return ((a * w).tanh() * 3 + a).sum()

    a, w = torch.randn(16, 8), torch.randn(16, 8, requires_grad=True)
    jf = fulmen.jit(f, executors=["inductor"], compile="sync")
    out = jf(a, w)
    assert _fused_regions(jf)[0].sym.impl.variants, "compile='sync' compiles the forward's region first"
    out.backward()
    backward = [b for b in fulmen.last_backward_traces(jf)[-1].bound_symbols if b.sym.is_fusion]
    assert backward and backward[0].sym.impl.variants, "the backward's regions compile in the jit's mode too"
    expected_w = w.detach().clone().requires_grad_()
    f(a, expected_w).backward()
    torch.testing.assert_close(out, f(a, w.detach()), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, expected_w.grad, rtol=1e-5, atol=1e-5)
    assert inductor.compile_mode.get() == "off", "the option must not leak into the ambient mode"


def test_jit_compile_option_rejects_unknown_modes():
    with pytest.raises(ValueError, match="compile= must be one of"):
        fulmen.jit(lambda a: a + 1, compile="later")


def test_vector_isa_decision_follows_aten(monkeypatch):
    # Inductor's probe compile is skipped only when ATen itself runs AVX2/AVX-512 kernels on an x86 CPU
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert not inductor_compile._vector_isa_known()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    import platform

    assert inductor_compile._vector_isa_known() == (platform.machine() in ("x86_64", "AMD64"))


def test_new_input_strides_get_their_own_program(sync_compile):
    def f(a, b):
        return (a + b).sin() * b

    a, b = torch.randn(16, 16), torch.randn(16, 16)
    jf = fulmen.jit(f, executors=["inductor"])
    torch.testing.assert_close(jf(a, b), f(a, b))
    # same sizes, transposed strides: the key holds a non-contiguous input's strides, so it is traced with them
    torch.testing.assert_close(jf(a.t(), b), f(a.t(), b))
    assert fulmen.cache_misses(jf) == 2
    torch.testing.assert_close(jf(a, b), f(a, b))
    torch.testing.assert_close(jf(a.t(), b), f(a.t(), b))
    assert fulmen.cache_misses(jf) == 2


def test_inductor_failure_falls_back_with_a_warning(sync_compile, monkeypatch, caplog):
    def broken(fn, example, cpp, threads=None, dims=None):
        raise RuntimeError("simulated Inductor failure")

    monkeypatch.setattr(inductor_compile, "_lower", broken)

    def f(a):
        return (a * 2).exp() + 1

    a = torch.randn(8)
    jf = fulmen.jit(f, executors=["inductor"])
    with caplog.at_level(logging.WARNING, logger="fulmen.inductor"):
        torch.testing.assert_close(jf(a), f(a))
    assert "could not compile" in caplog.text and "simulated Inductor failure" in caplog.text
    torch.testing.assert_close(jf(a), f(a))


def _random_program(seed: int):
    """A random DAG of elementwise ops, with opaque ops (which are never fused) breaking regions."""
    rng = random.Random(seed)
    unary = [torch.sin, torch.cos, torch.tanh, torch.sigmoid, lambda x: x * 0.5 + 1]
    binary = [torch.add, torch.mul, torch.sub, torch.maximum]
    plan = []
    for _ in range(rng.randint(6, 14)):
        kind = rng.random()
        if kind < 0.15:
            plan.append(("opaque", rng.randrange(10_000)))
        elif kind < 0.55:
            plan.append(("unary", rng.randrange(len(unary)), rng.randrange(10_000)))
        else:
            plan.append(("binary", rng.randrange(len(binary)), rng.randrange(10_000), rng.randrange(10_000)))

    def program(a, b):
        values = [a, b]
        for step in plan:
            pick = lambda k: values[k % len(values)]  # noqa: E731
            if step[0] == "opaque":
                values.append(torch.special.i0e(pick(step[1])))  # no torch-language rule: stays opaque
            elif step[0] == "unary":
                values.append(unary[step[1]](pick(step[2])))
            else:
                values.append(binary[step[1]](pick(step[2]), pick(step[3])))
        return values[-1], values[len(values) // 2]

    return program


@pytest.mark.parametrize("seed", range(4))
def test_random_programs_keep_their_results(sync_compile, seed):
    program = _random_program(seed)
    a, b = torch.randn(8, 4), torch.randn(8, 4)
    jf = fulmen.jit(program, executors=["inductor"])
    out = jf(a, b)
    for o, e in zip(out, program(a, b)):
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5)
    # every value is defined before use in the final trace (no region was moved past its consumers)
    from fulmen.core.trace import check_trace

    check_trace(fulmen.last_traces(jf)[-1])


# ---- the partitioner: regions as large as dependencies allow, never a cycle, never a changed result ----


@pytest.fixture
def no_compile():
    token = inductor.compile_mode.set("off")  # regions run their reordered torch code: tests the partition only
    yield
    inductor.compile_mode.reset(token)


def _opaque(x):
    return torch.special.i0e(x)  # no torch-language rule: an opaque op, never fused


def test_independent_opaque_op_does_not_split_a_region(no_compile):
    def f(x):
        a = x.sin()
        o = _opaque(x)  # independent of a: the partitioner runs it first
        b = a.cos() * 2
        return b, o

    jf = fulmen.jit(f, executors=["inductor"])
    x = torch.randn(5, 3)
    for got, want in zip(jf(x), f(x)):
        torch.testing.assert_close(got, want)
    assert len(_fused_regions(jf)) == 1


def test_dependent_opaque_op_keeps_the_order(no_compile):
    def f(x):
        a = x.sin()
        o = _opaque(a)  # needs a, and c needs it: a region holding a and c would be a cycle
        c = o.cos() + a.exp()
        return c

    jf = fulmen.jit(f, executors=["inductor"])
    x = torch.randn(4, 4)
    torch.testing.assert_close(jf(x), f(x))
    from fulmen.core.trace import check_trace

    check_trace(fulmen.last_traces(jf)[-1])
    assert len(_fused_regions(jf)) == 2


def test_random_ops_keep_eager_generator_order(no_compile):
    def f(x):
        a = x.sin() * torch.rand_like(x)
        b = x.cos() + torch.randn_like(x)
        return a * b + torch.rand_like(x)

    x = torch.randn(6, 6)
    torch.manual_seed(7)
    want = f(x)
    jf = fulmen.jit(f, executors=["inductor"])
    torch.manual_seed(7)
    torch.testing.assert_close(jf(x), want)


def test_in_place_update_of_an_input_is_ordered_with_its_reads(no_compile):
    def f(x, y):
        a = x.sin()
        x.add_(1.0)
        return a * x + y.exp()

    x, y = torch.randn(3, 3), torch.randn(3, 3)
    x_eager, x_jit = x.clone(), x.clone()
    want = f(x_eager, y)
    got = fulmen.jit(f, executors=["inductor"])(x_jit, y)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x_jit, x_eager)


@pytest.mark.parametrize("seed", range(40))
def test_partition_of_random_programs(no_compile, seed):
    program = _random_program(100 + seed)
    a, b = torch.randn(8, 4), torch.randn(8, 4)
    jf = fulmen.jit(program, executors=["inductor"])
    for o, e in zip(jf(a, b), program(a, b)):
        torch.testing.assert_close(o, e, rtol=1e-6, atol=1e-6)
    final = fulmen.last_traces(jf)[-1]
    from fulmen.core.trace import check_trace

    check_trace(final)
    # opaque ops run in their original order, and no two fused regions are adjacent (they would be one)
    kinds = [b.sym.is_fusion for b in final.bound_symbols if not is_bookkeeping(b)]
    assert not any(x and y for x, y in zip(kinds, kinds[1:]))
    computation = [b.output.name for b in fulmen.last_traces(jf)[0].bound_symbols if "i0e" in b.sym.name]
    ran = [p.name for b in final.bound_symbols if not b.sym.is_fusion for p in b.flat_proxy_outs
           if p.name in computation]
    assert ran == [name for name in computation if name in ran]


def _best_repeat_exhaustive(sigs, periods):
    """The longest run of equal consecutive blocks, by testing every pair (i, i + period) of every period."""
    best = (0, 0, 0)
    for period in periods:
        run = 0
        for i in range(len(sigs) - period - 1, -1, -1):
            run = run + 1 if sigs[i] == sigs[i + period] else 0
            if run >= period and (run // period + 1) * period > best[0]:
                best = ((run // period + 1) * period, period, i)
    return best


def test_repeat_search_agrees_with_the_exhaustive_scan():
    from fulmen.executors import partition

    rng = random.Random(0)
    for _ in range(2000):
        alphabet = rng.randint(1, 6)
        noise = lambda: [rng.randint(0, alphabet) for _ in range(rng.randint(0, 20))]  # noqa: E731
        block = [rng.randint(0, alphabet) for _ in range(rng.randint(1, 30))]
        sigs = noise() + block * rng.randint(0, 5) + noise()
        for _ in range(rng.randint(0, 3)):  # a few changed operations break some of the repeats
            if sigs:
                sigs[rng.randrange(len(sigs))] = rng.randint(0, alphabet)
        periods = range(rng.randint(1, 8), len(sigs) // 2 + 1)
        assert partition._best_repeat(sigs, periods) == _best_repeat_exhaustive(sigs, periods), sigs


def test_identical_layers_share_one_kernel(sync_compile):
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.GELU(),
                                                       torch.nn.Dropout(0.0)) for _ in range(3)])

    def f(x):
        for layer in layers:
            x = torch.special.i0e(layer(x))  # opaque ops between the layers: one region per layer
        return x

    before = inductor.kernel_stats()["kernels"]
    x = torch.randn(4, 16)
    jf = fulmen.jit(f, executors=["inductor"])
    torch.testing.assert_close(jf(x), f(x), rtol=1e-5, atol=1e-5)
    assert len(_fused_regions(jf)) == 3
    assert inductor.kernel_stats()["kernels"] - before == 1


@pytest.mark.parametrize("name, seq_len", [("gpt-tiny", None), ("llama-tiny", None), ("llama-tiny", 8)],
                         ids=["gpt-tiny", "llama-tiny", "llama-tiny-shorter-than-its-tables"])
def test_every_layer_of_a_model_shares_one_region_code(no_compile, name, seq_len):
    # the first layer matches the others, forward and backward: in LLaMA it reads rotary tables sliced in the
    # model's prologue (cos[:T], a new view whether or not T is the whole table), and its backward broadcasts
    # those slices once for every layer (common-subexpression elimination)
    from fulmen.bench.models import build

    torch.manual_seed(0)
    model, make_inputs = build(name, n_layer=4)
    reference = copy.deepcopy(model)
    x, y = (t[:, :seq_len].contiguous() for t in make_inputs(2, targets=True))
    jm = fulmen.jit(model, executors=["inductor"])
    _, loss = jm(x, y)
    loss.backward()
    _, expected = reference(x, y)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for p, e in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, e.grad, rtol=1e-4, atol=1e-6)
    for trace in (fulmen.last_traces(jm)[-1], fulmen.last_backward_traces(jm)[-1]):
        keys = [b.sym.impl.code_key for b in trace.bound_symbols if b.sym.is_fusion]
        layer_key = max(set(keys), key=keys.count)
        assert keys.count(layer_key) == 4, f"{keys.count(layer_key)} of 4 layers share their code"
        assert len(keys) <= 6, f"{len(keys)} regions: a prologue and an epilogue at most beside the layers"


def test_regions_share_unfused_code_only_when_identical(no_compile):
    # identical layers reuse one generated callable for their unfused path; a layer whose constant differs
    # (same operations, another scale) gets its own
    def layer(x, scale):
        return ((x * scale + 1.0).tanh() - x).sigmoid() * 2.0

    def f(a):
        x = torch.special.i0e(layer(a, 3.0))  # opaque ops between the layers: one region per layer
        x = torch.special.i0e(layer(x, 3.0))
        return torch.special.i0e(layer(x, 5.0))

    a = torch.randn(4, 8)
    jf = fulmen.jit(f, executors=["inductor"])
    torch.testing.assert_close(jf(a), f(a), rtol=1e-5, atol=1e-5)
    regions = [r.sym.impl for r in _fused_regions(jf)]
    assert len(regions) == 3
    assert regions[0].eager is regions[1].eager, "identical layers share their unfused callable"
    assert regions[2].eager is not regions[0].eager, "another constant, another callable"
    assert regions[2].code_key != regions[0].code_key


def test_regions_with_zero_and_negative_zero_constants_do_not_share(no_compile):
    # 0.0 == -0.0 in Python, but x * -0.0 is -0.0 for positive x: the constants must keep the regions apart
    def f(a):
        x = torch.special.i0e((a.abs() + 1.0).exp() * 0.0 + 0.0)
        return torch.special.i0e((x.abs() + 1.0).exp() * -0.0 + 0.0)

    a = torch.randn(4, 8)
    jf = fulmen.jit(f, executors=["inductor"])
    out = jf(a)
    torch.testing.assert_close(out, f(a))
    regions = [r.sym.impl for r in _fused_regions(jf)]
    assert len(regions) == 2 and regions[0].eager is not regions[1].eager


_GPU = pytest.mark.gpu


@pytest.mark.parametrize("name, device", [("gpt-tiny", "cpu"), pytest.param("gpt-tiny", "cuda", marks=_GPU),
                                          pytest.param("llama-tiny", "cuda", marks=_GPU)])
def test_model_training_through_inductor_matches_torch_executor(sync_compile, name, device):
    """On a GPU, Inductor writes Triton kernels instead of C++: the same checks hold for them."""
    from fulmen.bench.models import build

    grads = []
    for executors in (["torch"], ["inductor"]):
        torch.manual_seed(0)
        model, make_inputs = build(name, device=device)
        x, y = make_inputs(2, targets=True)
        jm = fulmen.jit(model, executors=executors)
        logits, loss = jm(x, y)
        loss.backward()
        grads.append([loss.detach()] + [p.grad for p in model.parameters()])
        if executors == ["inductor"]:
            forward, backward = fulmen.last_traces(jm)[-1], fulmen.last_backward_traces(jm)[-1]
            regions = [b.sym.impl for t in (forward, backward) for b in t.bound_symbols if b.sym.is_fusion]
            assert regions and all(r.variants and not r.failed for r in regions), "every region ran compiled"
    for g, e in zip(*grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


def test_hf_gpt2_training_through_inductor_matches_torch_executor(sync_compile):
    pytest.importorskip("transformers")
    from fulmen.bench.hf import hf_model

    grads = []
    for executors in (["torch"], ["inductor"]):
        torch.manual_seed(0)
        model = hf_model("gpt2")
        ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
        jm = fulmen.jit(model, executors=executors)
        loss = jm(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append([loss.detach()] + [p.grad for p in model.parameters()])
        if executors == ["inductor"]:
            regions = [b.sym.impl for t in (fulmen.last_traces(jm)[-1], fulmen.last_backward_traces(jm)[-1])
                       for b in t.bound_symbols if b.sym.is_fusion]
            assert regions and all(r.variants and not r.failed for r in regions)
    for g, e in zip(*grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


def test_tanh_gelu_through_inductor_matches_eager_over_the_whole_range(sync_compile):
    """fulmen hands Inductor tanh-GELU as ``x * sigmoid(2z)`` on CPU (``inductor_decomps``): one ``exp`` instead of
    the far slower vectorized ``tanh``. Forward and backward must match eager over inputs from deep in the
    negative tail (where ``1 + tanh`` cancels in eager's formula) to large positives, and through infinities and
    NaN; against a float64 reference, the fused kernels are no less accurate than eager's."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-12, 12, 48001), torch.randn(4000, generator=gen) * 3,
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 50.0, -50.0, 1e4, -1e4, float("inf"), float("-inf"),
                                 float("nan")])])
    g = torch.randn(x.shape, generator=gen)

    def f(x):
        return torch.nn.functional.gelu(x * 1.0, approximate="tanh")

    jf = fulmen.jit(f, executors=["inductor"])
    xj = x.clone().requires_grad_()
    out = jf(xj)
    (grad,) = torch.autograd.grad(out, xj, g)
    regions = [b.sym.impl for t in (fulmen.last_traces(jf)[-1], fulmen.last_backward_traces(jf)[-1])
               for b in t.bound_symbols if b.sym.is_fusion]
    assert len(regions) == 2 and all(r.variants and not r.failed for r in regions)

    xe = x.clone().requires_grad_()
    expected = f(xe)
    (expected_grad,) = torch.autograd.grad(expected, xe, g)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-5, equal_nan=True)

    x64 = x.double().requires_grad_()
    ref = f(x64)
    (ref_grad,) = torch.autograd.grad(ref, x64, g.double())
    finite = ref.isfinite() & ref_grad.isfinite()
    for ours, eager, exact in ((out, expected, ref), (grad, expected_grad, ref_grad)):
        err = (ours.double() - exact)[finite].abs().max()
        eager_err = (eager.double() - exact)[finite].abs().max()
        assert err <= 2 * eager_err, (err, eager_err)


def test_tanh_gelu_decomposition_uses_exp_on_cpu_only():
    from torch.fx.experimental.proxy_tensor import make_fx

    from fulmen.executors.inductor_decomps import decomposition_table

    def targets(device, dtype, approximate):
        x = torch.randn(8, device=device, dtype=dtype)
        gm = make_fx(lambda x: torch.ops.aten.gelu_backward(x, x, approximate=approximate) + torch.ops.aten.gelu(
            x, approximate=approximate), decomposition_table=decomposition_table())(x)
        return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}

    cpu = targets("cpu", torch.float32, "tanh")
    assert "aten.exp.default" in cpu and "aten.tanh.default" not in cpu
    bf16 = targets("cpu", torch.bfloat16, "tanh")  # computed in float32, as eager's kernel does
    assert "aten.tanh.default" not in bf16 and "prims.convert_element_type.default" in bf16
    assert "aten.erf.default" in targets("cpu", torch.float32, "none")  # the exact GELU keeps PyTorch's rule
    assert "aten.tanh.default" in targets("meta", torch.float32, "tanh")  # other devices keep PyTorch's rule too


class _AddmmLinear(torch.nn.Module):
    """A linear layer the way Hugging Face's GPT-2 writes it (``Conv1D``): ``addmm(bias, x, weight)``."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_in, n_out) / n_in ** 0.5)
        self.bias = torch.nn.Parameter(torch.randn(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x, self.weight)


@pytest.mark.parametrize("layer", [torch.nn.Linear, _AddmmLinear])
def test_bias_gradient_is_lowered_after_the_matmuls_that_read_the_same_gradient(no_compile, layer):
    """Inductor lowers a region's operations in order. A bias gradient (a sum over rows) lowered before the
    matmuls that read the same gradient inlines the gradient's producers (a GELU's backward) into the column
    reduction and computes them twice; lowered after them, it reads the gradient the matmuls made Inductor
    store (gpt-small: one kernel instead of two per layer, about 1 ms of a 60 ms CPU training step)."""
    model = torch.nn.Sequential(layer(8, 32), torch.nn.GELU(approximate="tanh"), layer(32, 8))
    x = torch.randn(4, 8, requires_grad=True)
    jmodel = fulmen.jit(model)
    jmodel(x).square().sum().backward()
    lines = str(fulmen.last_backward_traces(jmodel)[-1]).splitlines()
    (gelu_grad,) = {line.split("=")[0].strip(" #") for line in lines if "gelu_backward(" in line}

    def first(pattern):
        return next(i for i, line in enumerate(lines) if re.search(pattern, line))

    bias_grad = first(rf"= prims\.sum\({gelu_grad}\b")
    assert bias_grad > first(rf"= prims\.matmul\({gelu_grad}\b")  # the input's gradient
    assert bias_grad > first(rf"= prims\.matmul\(\w+, {gelu_grad}\b|= prims\.matmul\(\w+, \w+\).*f32\[32, 8\]")
    reference, x_ref = copy.deepcopy(model), x.detach().clone().requires_grad_()
    for p in reference.parameters():
        p.grad = None
    reference(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", ["2d", "1d", "weight", "float64", "bfloat16"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_cross_entropy_backward_through_inductor_matches_eager(sync_compile, reduction, case, device):
    """fulmen's decompositions build cross-entropy's one-hot gradient pointwise and hand its row sums to the
    log-softmax backward (``inductor_decomps``); ignored targets, every reduction, a single sample, class weights
    (PyTorch's decomposition), float64 and bfloat16 (fulmen's rule on CUDA, PyTorch's on CPU) must all keep
    eager's results."""
    gen = torch.Generator().manual_seed(0)
    dtype = {"float64": torch.float64, "bfloat16": torch.bfloat16}.get(case, torch.float32)
    logits = (torch.randn(2, 24, 37, generator=gen, dtype=torch.float64) * 4).to(device, dtype)
    target = torch.randint(0, 37, (2, 24), generator=gen)
    target[0, :5] = -1
    target = target.to(device)
    weight = (torch.rand(37, generator=gen, dtype=dtype) + 0.5).to(device) if case == "weight" else None

    def f(logits, target):
        x, t = logits.flatten(0, 1) * 1.0, target.flatten()
        if case == "1d":
            x, t = x[5], t[5]
        return torch.nn.functional.cross_entropy(x, t, weight=weight, ignore_index=-1, reduction=reduction)

    jf = fulmen.jit(f, executors=["inductor"])
    results = []
    for fn in (jf, f):
        x = logits.clone().requires_grad_()
        loss = fn(x, target)
        cotangent = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        (grad,) = torch.autograd.grad(loss, x, cotangent)
        results.append((loss, grad))
    regions = [b.sym.impl for t in (fulmen.last_traces(jf)[-1], fulmen.last_backward_traces(jf)[-1])
               for b in t.bound_symbols if b.sym.is_fusion]
    assert regions and all(r.variants and not r.failed for r in regions)
    (loss, grad), (expected_loss, expected_grad) = results
    if dtype is not torch.bfloat16:
        tol = {"rtol": 1e-12, "atol": 1e-12} if dtype is torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
        torch.testing.assert_close(loss, expected_loss, **tol)
        torch.testing.assert_close(grad, expected_grad, **tol)
        return
    # bfloat16: the backward exponentiates the log-softmax saved in bfloat16, whose rounding (up to 2^-9 of
    # |log p|, so 2-4% of p for log-probabilities near -10) depends on how the forward computed it; eager and
    # the fused kernels differ there by a rounding. So both are held to a float64 reference computed from the
    # same bfloat16 inputs, and fulmen must be no less accurate than eager.
    x64 = logits.double().requires_grad_()
    weight = weight.double() if weight is not None else None
    ref_loss = f(x64, target)
    (ref_grad,) = torch.autograd.grad(ref_loss, x64, torch.randn(
        ref_loss.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype).double())
    for ours, eager, exact in ((loss, expected_loss, ref_loss), (grad, expected_grad, ref_grad)):
        err, eager_err = ((y.double() - exact).abs().max() for y in (ours, eager))
        assert err <= 1.25 * eager_err, (err, eager_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cross_entropy_backward_decomposition_is_one_pass(dtype):
    """No scatter into a logits-sized buffer and no row sums: the backward is pointwise in the logits (on CPU for
    float32 and float64; bfloat16 logits keep PyTorch's rule there, which was faster)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fulmen.executors.inductor_decomps import decomposition_table

    aten = torch.ops.aten

    def backward(g, logp, target, total):
        one_hot = aten.nll_loss_backward(g, logp, target, None, 1, -1, total)
        return aten._log_softmax_backward_data(one_hot, logp, 1, logp.dtype)

    args = (torch.tensor(1.0, dtype=dtype), torch.randn(6, 5, dtype=dtype).log_softmax(1),
            torch.tensor([0, 4, -1, 2, 2, 1]), torch.tensor(5.0, dtype=dtype))
    gm = make_fx(backward, decomposition_table=decomposition_table())(*args)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    one_pass = not any("scatter" in t or "sum" in t for t in targets)
    assert one_pass == (dtype is not torch.bfloat16), targets
    torch.testing.assert_close(gm(*args), backward(*args), rtol=1e-6 if dtype is not torch.bfloat16 else None,
                               atol=1e-7 if dtype is not torch.bfloat16 else None)


def test_a_later_process_takes_whole_compilations_from_inductors_graph_cache(tmp_path):
    """A region compiled in one process is found whole in Inductor's FX graph cache by the next process with the
    same cache directory: no lowering and no C++ compiler run, and the same results as eager PyTorch."""
    script = textwrap.dedent("""
        import json
        import torch, fulmen
        from torch._dynamo.utils import counters
        from fulmen.executors import inductor, inductor_cpp
        inductor.compile_mode.set("sync")
        compiled = []
        build = inductor_cpp.MergedBuild.build
        def counting_build(self):
            build(self)
            compiled.append(self.compiled)
        inductor_cpp.MergedBuild.build = counting_build
        def f(a, w):
            h = torch.nn.functional.layer_norm(a @ w, (w.shape[1],))
            return torch.nn.functional.gelu(h) * a.sum(-1, keepdim=True)
        torch.manual_seed(0)
        a, w = torch.randn(16, 24), torch.randn(24, 8)
        torch.testing.assert_close(fulmen.jit(f, executors=["inductor"])(a, w), f(a, w), rtol=1e-5, atol=1e-5)
        cache = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
        print(json.dumps({"cache": cache, "cpp_compiled": sum(compiled)}))
    """)
    env = dict(os.environ, TMPDIR=str(tmp_path), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], env=env, timeout=300, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["cache"] == {"fxgraph_cache_miss": 1} and first["cpp_compiled"] > 0, first
    assert second["cache"] == {"fxgraph_cache_hit": 1} and second["cpp_compiled"] == 0, second

