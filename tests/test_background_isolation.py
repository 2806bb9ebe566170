"""Nothing fulmen's background compiler does may change what the program's own threads see.

A region's Inductor lowering runs on a background thread while the program keeps running. The tests pause a real
background lowering in the middle of its aten trace and look, from the main thread, at what FX's tracer would
have replaced for the whole process (``nn.Module.__call__``/``__getattr__``, ``torch.fx.wrap``'d functions, the
symbolic-tracing flag) and at a ``torch.compile``'d module called meanwhile.
"""

import itertools
import random
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

    def __init__(self, paused=None):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        self.model = _Small()
        self.graphs = []
        self.compiled = torch.compile(self.model, backend=self._backend)
        self.pairs = []
        self.lowered_first = []
        self.paused = paused

    def _backend(self, gm, example_inputs):
        self.graphs.append(gm)
        if self.paused is not None:
            self.lowered_first.append(self.paused.lowered.is_set())
        return gm.forward

    def __call__(self):
        x = torch.randn(2, 4)
        self.pairs.append((self.compiled(x), self.model(x)))


# Regions (and a user's graphs) no earlier test or process compiled: kernels of equal code are shared in the process,
# and Inductor's on-disk graph cache would answer a compilation without lowering it.
_fresh = itertools.count(random.Random().randrange(1 << 30))


class _Paused:
    """A background lowering stopped at a point of a test's choosing: ``release_in(seconds)`` lets it go on from
    another thread (the main thread may be waiting for it then); ``lowered`` is set once Inductor's compilation of
    it returned; ``finish()`` waits for it and checks what it did."""

    def __init__(self):
        self.reached, self.release, self.lowered = threading.Event(), threading.Event(), threading.Event()
        self.main = threading.current_thread()
        self.check = None

    def pause(self):
        if threading.current_thread() is not self.main:
            self.reached.set()
            self.release.wait(300)

    def release_in(self, seconds: float) -> None:
        threading.Timer(seconds, self.release.set).start()

    def finish(self):
        if self.check is not None:
            check, self.check = self.check, None
            check()


def _paused_region(monkeypatch, paused: _Paused):
    """Start a fresh region's lowering on the background compiler; ``paused.pause`` must stop it somewhere."""
    from torch._inductor import compile_fx

    compile_inner = compile_fx.compile_fx_inner

    def noting_the_end(*args, **kwargs):  # _lower looks the function up at each lowering
        try:
            return compile_inner(*args, **kwargs)
        finally:
            if threading.current_thread() is not paused.main:
                paused.lowered.set()

    monkeypatch.setattr(compile_fx, "compile_fx_inner", noting_the_end)
    scale = 1.5 + next(_fresh) / 2**31

    def f(a):
        return nn.functional.gelu(a * scale + 0.25) * a

    a = torch.randn(8, 4)
    jf = fulmen.jit(f, executors=["inductor"], compile="async")
    rng = []

    def check():
        rng.append(torch.get_rng_state())
        paused.release.set()
        inductor.wait_for_compilations(timeout=300)
        assert torch.equal(torch.get_rng_state(), rng[0]), "the background compiler drew from the main generator"
        region = [b for b in fulmen.last_traces(jf)[-1].bound_symbols if b.sym.is_fusion][0].sym.impl
        torch.testing.assert_close(jf(a), f(a))
        assert region.variants, "the paused lowering went on to compile the region"

    paused.check = check
    torch.testing.assert_close(jf(a), f(a))  # schedules the region's lowering on the background compiler
    assert paused.reached.wait(300), "the background compiler never reached the pause"


def _while_paused(monkeypatch, paused):
    """A fixture's body: start a region's lowering that stops at ``paused``, hand ``paused`` to the test, then let
    the lowering finish."""
    try:
        _paused_region(monkeypatch, paused)
        yield paused
    finally:
        paused.release.set()
    paused.finish()


@pytest.fixture
def paused_lowering(monkeypatch):
    """A region's Inductor lowering on the background compiler, stopped in the middle of its aten trace (at its
    first multiplication)."""
    paused = _Paused()
    table = dict(inductor_compile.decomposition_table())

    def pause(*args, **kwargs):
        paused.pause()
        return NotImplemented  # no decomposition: the multiplication is recorded as it is

    table[torch.ops.aten.mul.Tensor] = pause
    monkeypatch.setattr(inductor_compile, "decomposition_table", lambda: table)
    yield from _while_paused(monkeypatch, paused)


def test_a_paused_background_lowering_changes_nothing_the_main_thread_sees(paused_lowering):
    """While the background compiler is stopped in the middle of tracing a region's aten graph, the main thread
    finds torch as it was; a torch.compile started meanwhile waits for the lowering (Dynamo's compile lock), then
    compiles once, as without fulmen."""
    assert _main_thread_view() == _UNTOUCHED
    paused_lowering.release_in(1.0)
    module = _CompiledModule(paused_lowering)  # torch._dynamo.reset() waits for the lowering too
    module()
    assert module.lowered_first == [True], "Dynamo traced the module while the lowering was in flight"
    assert _main_thread_view() == _UNTOUCHED
    paused_lowering.finish()
    module()
    module()
    for out, exp in module.pairs:
        torch.testing.assert_close(out, exp)
    assert len(module.graphs) == 1, f"Dynamo compiled {len(module.graphs)} graphs for one module at one shape"
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])



@pytest.fixture
def compiled_before():
    """A function torch.compile'd (and compiled) before a background lowering starts."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda a: a * 2 + 1, backend="eager")
    compiled(torch.randn(3))
    return compiled


@pytest.fixture
def paused_in_inductors_fx_trace(monkeypatch, compiled_before):
    """A region's lowering on the background compiler, stopped inside a torch.fx Tracer.trace that Inductor's
    compilation makes (its loop bodies and pattern matcher trace helper functions with FX)."""
    from torch._inductor import compile_fx

    paused = _Paused()
    compile_inner = compile_fx.compile_fx_inner

    def helper(x):
        paused.pause()
        return x + 1

    def tracing_first(*args, **kwargs):
        torch.fx.symbolic_trace(helper)
        return compile_inner(*args, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", tracing_first)
    yield from _while_paused(monkeypatch, paused)


def test_inductors_own_fx_traces_leave_the_main_thread_alone(paused_in_inductors_fx_trace, compiled_before):
    """While Inductor, lowering a region on the background compiler, is inside an FX trace, the main thread's
    torch.compile'd functions run (FX's process-wide tracing flag made Dynamo refuse them: a DDP training step
    failed on one rank and left the others in a collective) and its modules return tensors, not FX proxies."""
    x = torch.randn(3)
    assert not torch.fx._symbolic_trace.is_fx_symbolic_tracing()
    torch.testing.assert_close(compiled_before(x), x * 2 + 1)
    lin = nn.Linear(3, 2)
    out = lin(x)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, nn.functional.linear(x, lin.weight, lin.bias))
    paused_in_inductors_fx_trace.finish()
    torch.testing.assert_close(compiled_before(x), x * 2 + 1)

# Tiny random configs of families whose torch.compile(backend="fulmen") runs broke or silently fell back to eager
# while fulmen's background compiler traced with FX's tracer.
_VOCAB = 128
_HF_FAMILIES = {
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                 dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)),
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                 word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, pad_token_id=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=64)),
    "bloom": ("BloomConfig", "BloomForCausalLM",
              dict(hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0)),
}


@pytest.mark.parametrize("family", list(_HF_FAMILIES))
def test_torch_compile_of_hf_models_beside_a_background_lowering(paused_lowering, family, caplog):
    """torch.compile(model, backend="fulmen") started while the background compiler is in the middle of a lowering
    (which FX's tracer, patching nn.Module.__call__, broke: "Guard failed on the same frame it was created"): one
    Dynamo graph, traced after the lowering, no graph break, fulmen compiles and runs it (no eager fallback), and
    the loss, logits and every parameter's gradient match eager PyTorch (float64)."""
    transformers = pytest.importorskip("transformers")
    from fulmen.frontend.dynamo import fulmen_backend

    config_cls, model_cls, fields = _HF_FAMILIES[family]
    config = getattr(transformers, config_cls)(vocab_size=_VOCAB, use_cache=False, **fields)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(torch.float64)
    paused_lowering.release_in(1.0)
    torch._dynamo.reset()  # waits for the lowering in flight (Dynamo's compile lock), as Dynamo's compile does
    counters.clear()
    made, lowered_first = [], []

    def backend(gm, example_inputs):
        lowered_first.append(paused_lowering.lowered.is_set())
        made.append(fulmen_backend(gm, example_inputs, options={"compile": "off"}))
        return made[-1]

    compiled = torch.compile(model, backend=backend)
    ids = torch.randint(0, _VOCAB, (2, 12))
    with caplog.at_level("WARNING", logger="fulmen"):
        for _ in range(3):
            model.zero_grad()
            out = compiled(input_ids=ids, labels=ids)
            out.loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad()
            expected = model(input_ids=ids, labels=ids)
            expected.loss.backward()
            torch.testing.assert_close(out.loss, expected.loss)
            torch.testing.assert_close(out.logits, expected.logits)
            for name, p in model.named_parameters():
                torch.testing.assert_close(grads[name], p.grad, msg=lambda m, name=name: f"{name}: {m}")
    assert len(made) == 1, f"Dynamo compiled {len(made)} graphs for one model at one shape"
    assert lowered_first == [True], "Dynamo traced the model while the lowering was in flight"
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    jitted = made[0]._fulmen_jitted
    assert fulmen.cache_misses(jitted) == 1 and fulmen.cache_hits(jitted) == 2, "fulmen ran every call"
    assert [r.getMessage() for r in caplog.records if r.name.startswith("fulmen")] == []


def test_a_graph_module_generating_its_code_while_traced_is_no_side_effect(caplog):
    """A lazy GraphModule (what Dynamo hands the torch.compile backend, or torch.fx.symbolic_trace makes) writes
    its generated code onto itself at its first call. Inside a trace, that is no side effect of the user's program:
    nothing is reported, and the jitted callables run from their cache afterwards."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    torch.manual_seed(0)
    model = _Small()
    x = torch.randn(2, 4)
    with _use_lazy_graph_module(True):
        as_module, called = torch.fx.symbolic_trace(model), torch.fx.symbolic_trace(model)
    jitted_module = fulmen.jit(as_module, executors=["torch"])
    jitted_function = fulmen.jit(lambda a: called(a) * 2, executors=["torch"])
    with caplog.at_level("WARNING", logger="fulmen"):
        for _ in range(2):
            torch.testing.assert_close(jitted_module(x), model(x))
            torch.testing.assert_close(jitted_function(x), model(x) * 2)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("fulmen")] == []
    assert fulmen.cache_hits(jitted_module) == 1 and fulmen.cache_hits(jitted_function) == 1


def test_torch_compile_backend_reports_no_module_writes(caplog):
    """Each Dynamo graph reaches fulmen as a lazy GraphModule whose first call is fulmen's trace."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Small()
    compiled = torch.compile(model, backend="fulmen", options={"executors": ["torch"]})
    x = torch.randn(2, 4, requires_grad=True)
    with caplog.at_level("WARNING", logger="fulmen"):
        out = compiled(x)
        out.sum().backward()
    torch.testing.assert_close(out, model(x))
    assert [r.getMessage() for r in caplog.records if r.name.startswith("fulmen")] == []


def test_inductor_state_of_a_lowering_in_flight_is_its_own(monkeypatch):
    """The background compiler is stopped inside Inductor's compilation of a region (as its C++ kernel is handed
    over): its configuration patches, graph and tracing context are not the main thread's, and a torch.compile of
    the user's with Inductor waits for it (the two would share Inductor's per-compilation class state), then runs
    and matches eager."""
    from torch._inductor import config, virtualized
    from torch._inductor.compile_fx import compile_fx

    from fulmen.executors import inductor_cpp

    paused = _Paused()
    add = inductor_cpp.MergedBuild.add

    def pausing_add(self, *args):
        paused.pause()
        return add(self, *args)

    monkeypatch.setattr(inductor_cpp.MergedBuild, "add", pausing_add)
    before = (config.emulate_precision_casts, config.cpp.vec_isa_ok, config.bundle_triton_into_fx_graph_cache)
    user_scale = 3 + next(_fresh) / 2**31
    lowered_first = []

    def user_backend(gm, example_inputs):
        lowered_first.append(paused.lowered.is_set())
        return compile_fx(gm, example_inputs)

    try:
        _paused_region(monkeypatch, paused)
        assert (config.emulate_precision_casts, config.cpp.vec_isa_ok,
                config.bundle_triton_into_fx_graph_cache) == before
        assert isinstance(virtualized._graph._get_handler(), virtualized.NullHandler)
        assert torch._guards.TracingContext.try_get() is None
        paused.release_in(1.0)
        torch._dynamo.reset()
        a = torch.randn(16, 8)
        user = torch.compile(lambda t: torch.nn.functional.gelu(t * user_scale) - t, backend=user_backend)
        torch.testing.assert_close(user(a), torch.nn.functional.gelu(a * user_scale) - a)
    finally:
        paused.release.set()
    paused.finish()
    assert lowered_first == [True], "Inductor compiled the user's graph while the lowering was in flight"


# ---- the patch-free capture is make_fx's graph, on programs fulmen did not write ----

def _programs_from_other_libraries():
    """Forward functions written by transformers and torch.nn, with example inputs (float32, CPU)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=1, vocab_size=64)
    norm = modeling_llama.LlamaRMSNorm(32)
    mlp = modeling_llama.LlamaMLP(config)
    encoder = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    x = torch.randn(2, 5, 32)
    def with_parameters(module):
        # a region takes every tensor as an input: the module's parameters are passed, not captured
        names = [n for n, _ in module.named_parameters()]

        def fn(x, *params):
            return torch.func.functional_call(module, dict(zip(names, params)), (x,))

        return fn, [x, *[p.detach() for p in module.parameters()]]

    rotary = modeling_llama.apply_rotary_pos_emb
    return {
        "llama_rotary": (lambda q, k, cos, sin: rotary(q, k, cos, sin), [q, k, cos, sin]),
        "llama_rmsnorm": with_parameters(norm),
        "llama_mlp": with_parameters(mlp),
        "transformer_encoder_layer": with_parameters(encoder),
        "gelu_tanh_softmax": (lambda x: torch.softmax(torch.nn.functional.gelu(x, approximate="tanh")
                                                      @ x.transpose(-1, -2), -1), [x]),
    }


@pytest.mark.parametrize("name", ["llama_rotary", "llama_rmsnorm", "llama_mlp", "transformer_encoder_layer",
                                  "gelu_tanh_softmax"])
def test_the_region_graph_is_the_one_make_fx_makes(name):
    # fulmen records a region's aten graph without FX's Tracer.trace (which patches nn.Module process-wide); the
    # graph handed to Inductor must be make_fx's under the Python dispatcher (as AOTAutograd traces for
    # torch.compile): the same code, and the same values on the same inputs
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx.experimental.proxy_tensor import make_fx

    from fulmen.executors.inductor_decomps import decomposition_table
    from fulmen.executors.inductor_graph import aten_graph

    fn, example = _programs_from_other_libraries()[name]
    table = decomposition_table()
    with torch.no_grad():
        with enable_python_dispatcher():
            expected = make_fx(fn, decomposition_table=table, tracing_mode="fake")(*example)
        got = aten_graph(fn, example, table)
        assert got.code == expected.code
        for a, b in zip(torch.utils._pytree.tree_leaves(got(*example)),
                        torch.utils._pytree.tree_leaves(expected(*example))):
            assert torch.equal(a, b)
