"""A batch's Triton waits, deferred until every region is lowered (``inductor_triton_wait``): the deferred wait
fills a module's kernels as Inductor's own wait does, only for the thread that defers, and a batch's regions are
handed out only once their modules hold no kernel still compiling. On a CPU the modules have no Triton kernels,
but their waits take the same path, so the regions' results are checked against eager with it on and off."""

import secrets
import threading
from concurrent.futures import Future

import pytest
import torch

from fulmen.core.ambient import Ambient
from fulmen.executors import inductor_compile
from fulmen.executors import inductor_triton_wait as triton_wait


@pytest.fixture
def async_compile(monkeypatch):
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile

    monkeypatch.setattr(config, "compile_threads", 4)  # Inductor waits for futures only with compile workers
    return AsyncCompile()


def test_a_deferred_wait_returns_at_once_and_finish_fills_the_kernels(async_compile):
    compiling, failing = Future(), Future()
    scope = {"triton_kernel": compiling, "other": 3}
    scopes = []
    inductors_wait = type(async_compile).wait
    with triton_wait.deferring_waits(scopes):
        async_compile.wait(scope)  # Inductor's own wait would block on the future
    assert type(async_compile).wait is inductors_wait  # put back once no thread defers
    assert scope["triton_kernel"] is compiling and len(scopes) == 1
    compiling.set_result("kernel")
    triton_wait.finish(scopes)
    assert scope == {"triton_kernel": "kernel", "other": 3} and scopes == []

    with triton_wait.deferring_waits(scopes):
        async_compile.wait({"bad_kernel": failing})
    failing.set_exception(RuntimeError("ptxas error"))
    with pytest.raises(RuntimeError, match="ptxas error"):
        triton_wait.finish(scopes)


def test_a_future_two_modules_hold_yields_its_kernel_once(async_compile):
    """Inductor gives a kernel source still compiling to every module that asks, as one future whose result runs
    the kernel's set-up each time it is asked: a batch asks once."""
    from torch._inductor.codecache import LambdaFuture

    asked = []
    future = LambdaFuture(lambda: asked.append(1) or "kernel")
    first, second = {"k": future}, {"same_k": future}
    scopes = []
    with triton_wait.deferring_waits(scopes):
        async_compile.wait(first)
        async_compile.wait(second)
    triton_wait.finish(scopes[:1])
    triton_wait.finish(scopes[1:])
    assert first["k"] == second["same_k"] == "kernel" and asked == [1]


def test_other_threads_wait_as_inductor_does(async_compile):
    """A compilation on another thread (torch.compile beside a background lowering) is not deferred."""
    scopes, waited = [], []
    pending = Future()

    def other():
        scope = {"k": pending}
        async_compile.wait(scope)
        waited.append(scope["k"])

    with triton_wait.deferring_waits(scopes):
        thread = threading.Thread(target=other)
        thread.start()
        pending.set_result("kernel")
        thread.join(timeout=60)
    assert waited == ["kernel"] and scopes == []


def test_a_module_still_compiling_is_not_handed_out(async_compile):
    """A region whose module another region loaded (and recorded the wait of) is checked before it is used."""
    namespace = {"k": Future()}
    exec("def call(args):\n    return k(args)", namespace)
    scopes = []
    triton_wait.expect_ready(scopes, namespace["call"])
    with pytest.raises(RuntimeError, match="did not compile"):
        triton_wait.finish(scopes)
    namespace["k"] = len
    triton_wait.expect_ready(scopes, namespace["call"])
    triton_wait.finish(scopes)


def _mix_scaled_by(c: float):
    def mix(a, b):
        return torch.softmax(a.tanh() * c, dim=-1) + (a * b).mean(0), (a - b).amax(0)

    return mix


@pytest.mark.slow  # a cold Inductor compilation per case
@pytest.mark.parametrize("enabled", [True, False])
def test_a_batch_compiles_the_same_with_and_without_deferred_waits(enabled, monkeypatch):
    """Each region's output module waits through the deferral (recorded, then finished once the batch is lowered),
    and the compiled regions give eager's results either way."""
    monkeypatch.setattr(triton_wait, "ENABLED", enabled)
    finished = []
    original = triton_wait.finish
    monkeypatch.setattr(triton_wait, "finish", lambda scopes: finished.append(list(scopes)) or original(scopes))
    # a constant of its own: Inductor's source differs from every earlier module's, so it is loaded (and waits)
    mix = _mix_scaled_by(1.0 + secrets.randbelow(10**6) / 10**6)
    a, b = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    kernel = inductor_compile.Kernel("test_region", Ambient.capture())
    inductor_compile._compile([(kernel, mix, [torch.empty_like(a), torch.empty_like(b)])])
    assert kernel.done and not kernel.failed and kernel.fn is not None
    deferred = [s for scopes in finished for s, _ in scopes if s is not None]
    assert bool(deferred) == enabled
    for got, expected in zip(kernel.fn([a, b]), mix(a, b)):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
