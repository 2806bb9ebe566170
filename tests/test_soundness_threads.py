"""Tracing state is per thread, and filling a cache entry is safe when several threads miss at once.

Each test runs a few hundred calls from 4 threads with a very short thread switch interval, so the threads
interleave inside tracing, and checks every result against eager PyTorch.
"""

import sys
import threading

import pytest
import torch
from torch import nn

import fulmen
from fulmen.core.symbol import Symbol, SymbolCalledOutsideTracing
from fulmen.core.trace import Trace, get_tracectx, tracectx

N_THREADS = 4


@pytest.fixture(autouse=True)
def _switch_often():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads every few bytecodes' worth of time: tracing interleaves
    yield
    sys.setswitchinterval(old)


def _run_threads(worker) -> list[str]:
    """``worker(i)`` on N_THREADS threads started together; the failures they report."""
    failures: list[str] = []
    barrier = threading.Barrier(N_THREADS)

    def run(i):
        try:
            barrier.wait(timeout=60)
            worker(i)
        except Exception as e:  # reported below, with the thread's number
            failures.append(f"thread {i}: {type(e).__name__}: {str(e)[:300]}")

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a thread did not finish: a deadlock?"
    return failures


def _chain(x, y):
    a = x * 2 + y
    for _ in range(12):  # long enough that traces in different threads overlap
        a = torch.sin(a) - y
    return a


def test_threads_jitting_different_functions():
    def worker(i):
        for r in range(20):
            jf = fulmen.jit(lambda x, y, k=i * 100 + r: _chain(x, y) * k, executors=["torch"])
            x, y = torch.randn(3, 4), torch.randn(3, 4)
            torch.testing.assert_close(jf(x, y), _chain(x, y) * (i * 100 + r))

    assert _run_threads(worker) == []


def test_threads_first_calls_of_one_function():
    for r in range(10):
        jf = fulmen.jit(_chain, executors=["torch"])
        xs = [(torch.randn(2 + i, 3), torch.randn(2 + i, 3)) for i in range(N_THREADS)]

        def worker(i):
            for _ in range(3):
                out = jf(*xs[i])
                assert type(out) is torch.Tensor, f"got {type(out).__name__}"
                torch.testing.assert_close(out, _chain(*xs[i]))

        assert _run_threads(worker) == []
        # one compilation per shape, however the threads raced (dynamic=None: the second size may go symbolic)
        assert fulmen.cache_misses(jf) <= N_THREADS


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8)) for _ in range(4)])


def test_threads_first_calls_of_one_module():
    for r in range(8):
        model = _model(r)
        jm = fulmen.jit(model, executors=["torch"])
        xs = [torch.randn(2, 8) for _ in range(N_THREADS)]
        with torch.no_grad():
            refs = [model(x) for x in xs]

        def worker(i):
            for _ in range(4):
                with torch.no_grad():
                    out = jm(xs[i])
                assert type(out) is torch.Tensor, f"got {type(out).__name__}"
                torch.testing.assert_close(out, refs[i])

        assert _run_threads(worker) == []
        assert fulmen.cache_misses(jm) == 1  # the threads that missed together waited for one compilation
        assert all(type(p) is nn.Parameter for p in model.parameters())


def test_module_called_while_it_is_traced_for_another_wrapper():
    # one thread keeps compiling new wrappers of the module (proxies stand in its dictionaries while it is
    # traced); the others call a wrapper compiled before, whose hit path must never read a proxy
    hot = _model(0)
    jhot = fulmen.jit(hot, executors=["torch"])
    x = torch.randn(3, 8)
    with torch.no_grad():
        ref = hot(x)
        jhot(x)

    def worker(i):
        for _ in range(12 if i == 0 else 60):
            with torch.no_grad():
                if i == 0:
                    torch.testing.assert_close(fulmen.jit(hot, executors=["torch"])(x), ref)
                else:
                    out = jhot(x)
                    assert type(out) is torch.Tensor, f"got {type(out).__name__}"
                    torch.testing.assert_close(out, ref)

    assert _run_threads(worker) == []


def test_trace_context_is_per_thread():
    seen = {}
    inside = threading.Event()
    done = threading.Event()

    def tracer():
        with tracectx(Trace("mine")):
            inside.set()
            done.wait(timeout=30)
            seen["tracer"] = get_tracectx().fn_name

    t = threading.Thread(target=tracer)
    t.start()
    assert inside.wait(timeout=30)
    try:
        seen["other"] = get_tracectx()
        with pytest.raises(SymbolCalledOutsideTracing):
            Symbol(name="noop", meta=lambda: None)()
    finally:
        done.set()
        t.join(timeout=30)
    assert seen == {"other": None, "tracer": "mine"}


def test_compiling_flag_is_restored_after_concurrent_traces():
    flag = getattr(torch.compiler, "_is_compiling_flag", None)
    if flag is None:
        pytest.skip("this torch has no torch.compiler._is_compiling_flag")

    def worker(i):
        for r in range(10):
            fulmen.jit(lambda x, k=i * 100 + r: _chain(x, x) + k, executors=["torch"])(torch.randn(4))

    assert _run_threads(worker) == []
    assert torch.compiler._is_compiling_flag is flag
    assert not torch.compiler.is_compiling()


def test_module_writes_are_recorded_for_the_tracing_thread_only():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = 1.0

        def forward(self, x):
            self.last_scale = self.scale  # an attribute write while tracing: every call makes it
            return self.lin(x) * self.scale

    def worker(i):
        for r in range(6):
            m = Counter()
            m.scale = float(i + r)
            jm = fulmen.jit(m, executors=["torch"])
            x = torch.randn(2, 4)
            with torch.no_grad():
                out = jm(x)
                torch.testing.assert_close(out, m.lin(x) * m.scale)
            assert m.last_scale == float(i + r)

    assert _run_threads(worker) == []


def test_threads_settling_a_warm_started_training_program():
    # a training program's first call runs on PyTorch autograd; the next calls, made by several threads at once,
    # compile the real program once and every thread gets eager's value and gradient
    for r in range(6):
        jf = fulmen.jit(lambda x, w: _chain(x @ w, x @ w).sum(), executors=["torch"], compile="async")
        x = torch.randn(3, 4, dtype=torch.float64)
        w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
        ref = _chain(x @ w, x @ w).sum()
        (ref_grad,) = torch.autograd.grad(ref, w)
        jf(x, w)  # the first call

        def worker(i):
            for _ in range(3):
                out = jf(x, w)
                (grad,) = torch.autograd.grad(out, w)
                torch.testing.assert_close(out, ref)
                torch.testing.assert_close(grad, ref_grad)

        assert _run_threads(worker) == []
        assert fulmen.compile_stats(jf).pending_compilations == 0
        assert "warm_start" in fulmen.compile_stats(jf).phase_times_ms  # the path this test is about was taken


def test_module_change_is_seen_while_another_thread_traces():
    # fulmen sets torch.compiler's is_compiling flag (one for the process) while it traces; a structure change a
    # thread makes meanwhile must still be noticed by that thread's jitted module
    stop = threading.Event()

    def tracer():
        k = 0
        while not stop.is_set():
            k += 1
            fulmen.jit(lambda x, k=k: _chain(x, x) * k, executors=["torch"])(torch.randn(3))

    t = threading.Thread(target=tracer, daemon=True)
    t.start()
    try:
        for _ in range(30):
            m = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
            jm = fulmen.jit(m, executors=["torch"])
            x = torch.randn(2, 4)
            with torch.no_grad():
                jm(x)
                m[1] = nn.Tanh()  # the next call must not reuse the program compiled with ReLU
                torch.testing.assert_close(jm(x), m(x))
    finally:
        stop.set()
        t.join(timeout=60)


def test_threads_differentiating_convolutions():
    # the convolution's VJP asks which gradients the walk wants; each thread's walk has its own answer
    def worker(i):
        for r in range(6):
            def f(**kw):
                y = torch.nn.functional.conv2d(kw[f"inp{i}_{r}"], kw[f"weight{i}_{r}"])
                return _chain(y, y).sum()  # a long walk: the threads' walks overlap

            x = torch.randn(1, 2, 5, 5, dtype=torch.float64, requires_grad=True)
            w = torch.randn(3, 2, 3, 3, dtype=torch.float64, requires_grad=True)
            kw = {f"inp{i}_{r}": x, f"weight{i}_{r}": w}
            got = torch.autograd.grad(fulmen.jit(f, executors=["torch"])(**kw), (x, w))
            want = torch.autograd.grad(f(**kw), (x, w))
            for g, e in zip(got, want):
                torch.testing.assert_close(g, e)

    assert _run_threads(worker) == []
