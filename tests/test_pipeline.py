"""The pipeline as data (fulmen.frontend.compile), steps added by executors and users (fulmen.core.steps), the
options object of one fulmen.jit (fulmen.core.options) and the one composed runner (fulmen.frontend.runner)."""

from __future__ import annotations

import pickle

import pytest
import torch

import fulmen
from fulmen.core.options import JitOptions
from fulmen.core.steps import Step
from fulmen.core.trace import TraceCheckError
from fulmen.executors.base import OperatorExecutor, deregister_executor, register_executor
from fulmen.frontend.compile import BACKWARD_STEPS, EXECUTION_PIPELINE
from fulmen.transforms.passes import cse


def _f(a, b):
    return (a + b * a).sin().sum()


def _execution_names(fusion: bool) -> list[str]:
    # "overlap" returns the trace it is given unless the trace communicates: then it keeps no trace
    return [s.name for s in EXECUTION_PIPELINE if (fusion or s.name != "fusion") and s.name != "overlap"]


def _inputs(requires_grad: bool = False):
    torch.manual_seed(0)
    return torch.randn(3, 4, requires_grad=requires_grad), torch.randn(3, 4)


def test_last_traces_mirror_the_pipeline_steps_for_inference():
    a, b = _inputs()
    for executors, fusion in ((["torch"], False), (None, True)):
        jf = fulmen.jit(_f, executors=executors)
        torch.testing.assert_close(jf(a, b), _f(a, b))
        stats = fulmen.compile_stats(jf)
        assert stats.last_trace_steps == ["trace", *_execution_names(fusion)]
        assert len(fulmen.last_traces(jf)) == len(stats.last_trace_steps)


def test_last_traces_mirror_the_pipeline_steps_for_training():
    a, b = _inputs(requires_grad=True)
    jf = fulmen.jit(_f, executors=["torch"])
    out = jf(a, b)
    out.backward()
    ref = a.detach().clone().requires_grad_()
    _f(ref, b).backward()
    torch.testing.assert_close(a.grad, ref.grad)
    stats = fulmen.compile_stats(jf)
    assert stats.last_trace_steps == ["trace", "autodiff", *_execution_names(False)]
    assert stats.last_backward_trace_steps == [
        "backward_split",
        *(s.name for s in BACKWARD_STEPS),
        *_execution_names(False),
    ]
    assert len(fulmen.last_backward_traces(jf)) == len(stats.last_backward_trace_steps)


def _counting_step(name: str, stage: str, calls: list):
    def step(trace, executors):
        calls.append((name, [ex.name for ex in executors]))
        return cse(trace)

    return Step(name, step, stage)


def test_user_steps_run_at_their_stage_and_keep_their_trace():
    calls: list = []
    steps = [
        _counting_step("early", "computation", calls),
        _counting_step("late", "execution", calls),
        _counting_step("in_backward", "backward", calls),
    ]
    a, b = _inputs(requires_grad=True)
    jf = fulmen.jit(_f, executors=["torch"], steps=steps)
    out = jf(a, b)
    out.backward()
    ref = a.detach().clone().requires_grad_()
    torch.testing.assert_close(out, _f(ref, b))
    _f(ref, b).backward()
    torch.testing.assert_close(a.grad, ref.grad)
    stats = fulmen.compile_stats(jf)
    forward = _execution_names(False)
    assert stats.last_trace_steps == ["trace", "early", "autodiff", *forward[:-1], "late", forward[-1]]
    backward = stats.last_backward_trace_steps
    assert backward[: len(BACKWARD_STEPS) + 2] == ["backward_split", *(s.name for s in BACKWARD_STEPS), "in_backward"]
    assert backward[-2:] == ["late", forward[-1]]
    # each ran once per trace it applies to, with the compilation's executors
    assert [name for name, _ in calls] == ["early", "late", "in_backward", "late"]
    assert all(names == ["torch"] for _, names in calls)


class _StepExecutor(OperatorExecutor):
    """An executor that declares a pipeline step (the documented hook: ``Executor.steps``)."""

    def __init__(self, calls: list):
        super().__init__("pipeline_test_ex", version="0")
        self.steps = (_counting_step("pipeline_test_ex_rewrite", "computation", calls),)


def test_an_executor_adds_a_step_by_declaring_it():
    calls: list = []
    ex = register_executor(_StepExecutor(calls))
    try:
        a, b = _inputs()
        jf = fulmen.jit(_f, executors=[ex])
        torch.testing.assert_close(jf(a, b), _f(a, b))
        assert fulmen.compile_stats(jf).last_trace_steps[:2] == ["trace", "pipeline_test_ex_rewrite"]
        assert [name for name, _ in calls] == ["pipeline_test_ex_rewrite"]
    finally:
        deregister_executor(ex)


def test_fused_linear_ce_rewrites_through_its_declared_step():
    torch.manual_seed(0)
    h, w, y = torch.randn(6, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True), torch.randint(0, 5, (6,))

    def loss(h, w, y):
        return torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w), y)

    jf = fulmen.jit(loss, executors=["fused_linear_ce"])
    out = jf(h, w, y)
    grads = torch.autograd.grad(out, (h, w))
    expected = loss(h, w, y)
    torch.testing.assert_close(out, expected)
    for g, e in zip(grads, torch.autograd.grad(expected, (h, w))):
        torch.testing.assert_close(g, e)
    stats = fulmen.compile_stats(jf)
    assert stats.last_trace_steps[:3] == ["trace", "fused_linear_ce", "autodiff"]
    rewritten = fulmen.last_traces(jf)[1]
    assert any(b.sym.id == "fused_linear_ce.fused_linear_cross_entropy" for b in rewritten.bound_symbols)


def test_step_mistakes_are_clear_errors():
    with pytest.raises(ValueError, match="name must be an identifier"):
        Step("two words", lambda t, ex: t)
    with pytest.raises(ValueError, match="stage must be one of"):
        Step("s", lambda t, ex: t, stage="after")
    with pytest.raises(TypeError, match="fn must be a function"):
        Step("s", None)
    with pytest.raises(TypeError, match="steps must be fulmen.Step"):
        fulmen.jit(_f, steps=[lambda t, ex: t])
    jf = fulmen.jit(_f, executors=["torch"], steps=[Step("broken", lambda t, ex: None)])
    with pytest.raises(TypeError, match="step 'broken' returned NoneType"):
        jf(*_inputs())


def test_check_traces_is_an_option_of_each_jit():
    def drop_first(trace, executors):  # a broken step: uses a name no line defines any more
        return trace.derive("drop the first line", trace.bound_symbols[1:])

    step = Step("drop_first", drop_first)
    with pytest.raises(TraceCheckError):
        fulmen.jit(_f, executors=["torch"], steps=[step], check_traces=True)(*_inputs())
    unchecked = fulmen.jit(_f, executors=["torch"], steps=[step], check_traces=False)
    assert unchecked.options.check_traces is False
    with pytest.raises(Exception) as info:  # not checked after the step: fails later, in code generation or the call
        unchecked(*_inputs())
    assert not isinstance(info.value, TraceCheckError)


def test_options_are_validated_with_the_option_named():
    with pytest.raises(TypeError, match="dynamic= must be None"):
        fulmen.jit(_f, dynamic="yes")
    with pytest.raises(ValueError, match="compile= must be one of"):
        fulmen.jit(_f, compile="fast")
    with pytest.raises(TypeError, match="warm_start= must be True or False"):
        fulmen.jit(_f, warm_start=1)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['replay_all'\].*replay="):
        fulmen.jit(_f, replay_all=True)
    with pytest.raises(TypeError, match="options= must be a fulmen.JitOptions"):
        fulmen.jit(_f, options={"dynamic": False})


def test_options_object_keywords_and_pickling_agree():
    base = JitOptions(dynamic=False, compile="off")
    jf = fulmen.jit(_f, options=base, replay=False)
    assert jf.options == JitOptions(dynamic=False, compile="off", replay=False)
    assert (jf.dynamic, jf.compile_mode) == (False, "off")
    copy = pickle.loads(pickle.dumps(jf))
    assert copy.options == jf.options
    module = fulmen.jit(torch.nn.Linear(2, 2), dynamic=True)
    assert module._fulmen_jitted.options.dynamic is True


def test_environment_overrides_set_the_defaults(monkeypatch):
    monkeypatch.setenv("FULMEN_WARM_START", "0")
    monkeypatch.setenv("FULMEN_REPLAY", "false")
    options = fulmen.jit(_f).options
    assert (options.warm_start, options.replay) == (False, False)
    assert fulmen.jit(_f, warm_start=True).options.warm_start is True  # a keyword wins over the environment
    monkeypatch.setenv("FULMEN_CHECK_TRACES", "maybe")
    with pytest.raises(ValueError, match="FULMEN_CHECK_TRACES='maybe' is not a boolean"):
        JitOptions()


def _is_fulmen_backward(out: torch.Tensor) -> bool:
    return type(out.grad_fn).__name__ == "FulmenFunctionBackward"


def test_warm_start_is_per_function_and_replaces_the_program_without_editing_it():
    x, w = torch.randn(3, 4), torch.randn(3, 4, requires_grad=True)

    def f(x, w):
        return (x * w).sin().sum()

    cold = fulmen.jit(f, executors=["torch"], compile="async", warm_start=False)
    assert _is_fulmen_backward(cold(x, w))
    warm = fulmen.jit(f, executors=["torch"], compile="async")
    first = warm(x, w)
    assert not _is_fulmen_backward(first)  # ran on PyTorch autograd
    expected = torch.autograd.grad(f(x, w), w)[0]
    torch.testing.assert_close(torch.autograd.grad(first, w)[0], expected)
    entry = warm._last_entry
    program, traces, steps = entry.program, list(entry.program.traces), list(entry.program.steps)
    second = warm(x, w)
    assert _is_fulmen_backward(second)
    torch.testing.assert_close(torch.autograd.grad(second, w)[0], expected)
    assert entry.program is not program  # the cache entry runs the compiled program now
    assert (program.traces, program.steps) == (traces, steps)  # the first call's program is as it was
    assert fulmen.compile_stats(warm).last_trace_steps[:2] == ["trace", "autodiff"]


def _branchy(x):
    if x.sum() > 0:  # a split point
        return (x * 2).exp()
    return x - 1


def test_one_composed_runner_around_a_program():
    x = torch.randn(4, 4)
    plain = fulmen.jit(_branchy, executors=["torch"])
    plain(x.abs())
    entry = plain._last_entry
    assert entry.run.__qualname__ == "compose.<locals>.run_program"  # the split point's random-state guard
    assert entry.run.__closure__ is not None and any(
        c.cell_contents is entry.program.run for c in entry.run.__closure__
    )  # the program itself, not a wrapper
    for sign in (1, -1):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = plain(sign * x.abs())
            want = _branchy(sign * x.abs())
        torch.testing.assert_close(got, want)
    simple = fulmen.jit(lambda a: a + 1, executors=["torch"])
    simple(x)
    assert simple._last_entry.run is simple._last_entry.program.run  # nothing to do around it: nothing between


def test_factory_memory_format_fulmen_cannot_honour_raises():
    call = lambda x: torch.zeros_like(x, memory_format=torch.channels_last)  # noqa: E731
    with pytest.raises(NotImplementedError, match="memory_format=torch.channels_last"):
        fulmen.jit(call, executors=["torch"])(torch.randn(1, 2, 3, 4))


_PINNED = {
    "zeros": lambda x: torch.zeros(2, 3, pin_memory=True) + x,
    "new_ones": lambda x: x.new_ones(2, 3, pin_memory=True),
    "empty_like": lambda x: torch.empty_like(x, pin_memory=True).fill_(1.0),
    "tensor": lambda x: torch.tensor([1.0, 2.0], pin_memory=True) * 2,
    "arange": lambda x: torch.arange(3, pin_memory=True),
    "randn": lambda x: torch.randn(2, pin_memory=True) * 0,
}


@pytest.mark.parametrize("name", sorted(_PINNED))
def test_factory_pin_memory_raises_as_eager_does(name):
    """Without an accelerator eager refuses pin_memory=True: fulmen raises the same error; with one, eager pins and
    fulmen says it does not (a NotImplementedError naming the argument), never a plain tensor in its place."""
    call, x = _PINNED[name], torch.randn(2, 3)
    try:
        call(x)
        eager_error = None
    except RuntimeError as e:
        eager_error = e
    expected = NotImplementedError if eager_error is None else RuntimeError
    with pytest.raises(expected, match="pin_memory=True") as info:
        fulmen.jit(call, executors=["torch"])(x)
    if eager_error is not None:
        assert str(eager_error) in str(info.value)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.preserve_format])
def test_factory_memory_formats_fulmen_honours_match_eager(memory_format):
    x = torch.randn(3, 4).t()  # not contiguous: the two formats give different strides in eager

    def f(x):
        return torch.zeros_like(x, memory_format=memory_format) + x, torch.empty_like(x, memory_format=memory_format)

    got, want = fulmen.jit(f, executors=["torch"])(x), f(x)
    torch.testing.assert_close(got[0], want[0])
    assert [t.stride() for t in got] == [t.stride() for t in want]


def test_register_operator_honours_bind_postprocess():
    seen = []
    ex = register_executor(OperatorExecutor("pipeline_postprocess_ex", version="0"))
    try:

        def twice_like(x):
            return x * 2

        op = ex.register_operator(
            "twice", like=twice_like, fn=lambda x: x * 2, bind_postprocess=lambda bsym: seen.append(bsym)
        )
        x = torch.randn(3)
        jf = fulmen.jit(lambda x: op(x) + 1, executors=[ex])
        torch.testing.assert_close(jf(x), x * 2 + 1)
        assert [b.sym for b in seen] == [op]  # called once, with the new bound symbol
        with pytest.raises(TypeError, match="bind_postprocess must be callable"):
            ex.register_operator("thrice", like=twice_like, fn=lambda x: x * 3, bind_postprocess=3)
    finally:
        deregister_executor(ex)


def test_the_background_compilers_pacing_reads_its_environment_override(monkeypatch):
    from fulmen.core.options import env_seconds

    monkeypatch.setenv("FULMEN_COMPILE_QUIET_SECONDS", "1.5")
    assert env_seconds("FULMEN_COMPILE_QUIET_SECONDS", 0.3) == 1.5
    monkeypatch.delenv("FULMEN_COMPILE_QUIET_SECONDS")
    assert env_seconds("FULMEN_COMPILE_QUIET_SECONDS", 0.3) == 0.3
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("FULMEN_COMPILE_QUIET_SECONDS", bad)
        with pytest.raises(ValueError, match="FULMEN_COMPILE_QUIET_SECONDS=.* is not a number of seconds"):
            env_seconds("FULMEN_COMPILE_QUIET_SECONDS", 0.3)
