"""Nothing fulmen's background compiler does may change what the program's own threads see.

A region's Inductor lowering runs on a background thread while the program keeps running. The tests pause a real
background lowering in the middle of its aten trace and look, from the main thread, at what FX's tracer would
have replaced for the whole process (``nn.Module.__call__``/``__getattr__``, ``torch.fx.wrap``'d functions, the
symbolic-tracing flag) and at a ``torch.compile``'d module called meanwhile.
"""

import threading

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import fulmen
from fulmen.executors import inductor, inductor_compile

_ORIGINAL_CALL = nn.Module.__call__
_ORIGINAL_GETATTR = nn.Module.__getattr__


def _fx_wrapped_helper(x):
    return x + 1


# registered with FX: any ``Tracer.trace`` in the process replaces this module's global while it runs
torch.fx.wrap("_fx_wrapped_helper")
_ORIGINAL_HELPER = _fx_wrapped_helper


class _Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)

    def forward(self, x):
        return self.norm(self.lin(x)).relu()


def _main_thread_view() -> dict:
    """What the main thread sees of the process-wide things FX's tracer patches."""
    fx = torch.fx._symbolic_trace
    return {"Module.__call__": nn.Module.__call__ is _ORIGINAL_CALL,
            "Module.__getattr__": nn.Module.__getattr__ is _ORIGINAL_GETATTR,
            "fx.wrap'd function": globals()["_fx_wrapped_helper"] is _ORIGINAL_HELPER,
            "is_fx_symbolic_tracing is torch's": fx.is_fx_symbolic_tracing.__module__ == fx.__name__,
            "is_fx_symbolic_tracing()": fx.is_fx_symbolic_tracing(),
            "FX patcher active": fx.CURRENT_PATCHER is not None}


_UNTOUCHED = {"Module.__call__": True, "Module.__getattr__": True, "fx.wrap'd function": True,
              "is_fx_symbolic_tracing is torch's": True, "is_fx_symbolic_tracing()": False,
              "FX patcher active": False}


class _CompiledModule:
    """A fresh ``torch.compile``'d module, the graphs Dynamo hands its backend, and its results next to eager's."""

    def __init__(self):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        self.model = _Small()
        self.graphs = []
        self.compiled = torch.compile(self.model, backend=self._backend)
        self.pairs = []

    def _backend(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def __call__(self):
        x = torch.randn(2, 4)
        self.pairs.append((self.compiled(x), self.model(x)))


@pytest.fixture
def paused_lowering(monkeypatch):
    """A region's Inductor lowering on the background compiler, stopped in the middle of its aten trace (at its
    first multiplication) until the test calls the fixture's value, or ends; then it finishes, and the fixture
    checks that it compiled and that the main thread's random numbers were not drawn from meanwhile."""
    tracing, release = threading.Event(), threading.Event()
    main = threading.current_thread()
    table = dict(inductor_compile.decomposition_table())

    def pause(*args, **kwargs):
        if threading.current_thread() is not main:
            tracing.set()
            release.wait(300)
        return NotImplemented  # no decomposition: the multiplication is recorded as it is

    table[torch.ops.aten.mul.Tensor] = pause
    monkeypatch.setattr(inductor_compile, "decomposition_table", lambda: table)

    def f(a):
        return nn.functional.gelu(a * 1.5 + 0.25) * a

    a = torch.randn(8, 4)
    jf = fulmen.jit(f, executors=["inductor"], compile="async")
    rng = []

    def finish():
        """Let the lowering go on, wait for it, and check what it did."""
        if release.is_set():
            return
        rng.append(torch.get_rng_state())
        release.set()
        inductor.wait_for_compilations(timeout=300)
        assert torch.equal(torch.get_rng_state(), rng[0]), "the background compiler drew from the main generator"
        region = [b for b in fulmen.last_traces(jf)[-1].bound_symbols if b.sym.is_fusion][0].sym.impl
        torch.testing.assert_close(jf(a), f(a))
        assert region.variants, "the paused lowering went on to compile the region"

    try:
        torch.testing.assert_close(jf(a), f(a))  # schedules the region's lowering on the background compiler
        assert tracing.wait(300), "the background compiler never reached the region's multiplication"
        yield finish
    except BaseException:
        release.set()
        raise
    finish()


def test_a_paused_background_lowering_changes_nothing_the_main_thread_sees(paused_lowering):
    """While the background compiler is stopped in the middle of tracing a region's aten graph, the main thread
    finds torch as it was, and a torch.compile'd module compiles once, as without fulmen."""
    assert _main_thread_view() == _UNTOUCHED
    module = _CompiledModule()
    module()  # Dynamo traces and guards the module while the lowering is paused
    assert _main_thread_view() == _UNTOUCHED
    paused_lowering()
    module()  # the guards Dynamo made during the pause still hold once the lowering has finished
    module()
    for out, exp in module.pairs:
        torch.testing.assert_close(out, exp)
    assert len(module.graphs) == 1, f"Dynamo compiled {len(module.graphs)} graphs for one module at one shape"
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
