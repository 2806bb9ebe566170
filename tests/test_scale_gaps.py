"""The CPU side of issue 46's gaps between fulmen's training step and torch.compile's: the host cost of calling a
fused region (one C++ check of a steady layout instead of a Python key), and that the faster path computes what
the key lookup does."""

from __future__ import annotations

import threading

import pytest
import torch

import fulmen
from fulmen.executors import inductor


@pytest.fixture
def sync_compile():
    token = inductor.compile_mode.set("sync")
    yield
    inductor.compile_mode.reset(token)


def _body(a, b):
    return (a * b + 1.0).tanh() * a - b.sin()


def _region(jf):
    (region,) = [b.sym.impl for b in fulmen.last_traces(jf)[-1].bound_symbols if b.sym.is_fusion]
    return region


@pytest.fixture(scope="module")
def compiled_region():
    """One compiled region of ``_body`` (sizes 8 x 6), built once for the module's tests."""
    token = inductor.compile_mode.set("sync")
    try:
        jf = fulmen.jit(_body, executors=["inductor"])
        a, b = torch.randn(8, 6), torch.randn(8, 6)
        torch.testing.assert_close(jf(a, b), _body(a, b))
        return _region(jf)
    finally:
        inductor.compile_mode.reset(token)


def _fresh(region) -> None:
    region.forget_fast()


def test_a_steady_layout_is_found_by_one_cpp_check(compiled_region):
    region = compiled_region
    _fresh(region)
    a, b = torch.randn(8, 6), torch.randn(8, 6)
    region(a, b)
    assert region.fast is None, "one call is not yet a steady layout"
    region(a, b)
    assert region.fast is not None, "the same layout twice in a row gets the C++ check"
    looked_up = []
    original = region.variants
    region.variants = _Recording(original, looked_up)
    try:
        (out,) = region(a, b)
    finally:
        region.variants = original
    assert not looked_up, "a call in the steady layout must not build the Python key"
    torch.testing.assert_close(out, _body(a, b))


class _Recording(dict):
    def __init__(self, inner: dict, log: list):
        super().__init__(inner)
        self.log = log

    def get(self, key, default=None):
        self.log.append(key)
        return super().get(key, default)


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda a, b: (a.t().contiguous().t(), b), id="column-major"),
        pytest.param(lambda a, b: (a[:, :4], b[:, :4]), id="other-sizes-strided"),
        pytest.param(lambda a, b: (a.requires_grad_(), b), id="requires-grad"),
        pytest.param(lambda a, b: (torch.nn.Parameter(a), b), id="parameter-type"),
    ],
)
def test_another_layout_after_the_steady_one_gives_eagers_result(compiled_region, other):
    """The kernel compiled for contiguous 8 x 6 inputs reads memory by those strides: any other input must fail the
    C++ check and be decided by the key lookup (another variant, or the region's unfused path). (Dtypes and devices
    are the trace's; the prologue checks them.)"""
    region = compiled_region
    _fresh(region)
    a, b = torch.randn(8, 6), torch.randn(8, 6)
    region(a, b)
    region(a, b)
    assert region.fast is not None
    x, y = other(torch.randn(8, 6), torch.randn(8, 6))
    with torch.no_grad():  # as inside fulmen's autograd.Function, where regions run
        (out,) = region(x, y)
        want = _body(x, y)
    torch.testing.assert_close(out, want)


def test_alternating_layouts_never_build_the_check(compiled_region):
    region = compiled_region
    _fresh(region)
    a, b = torch.randn(8, 6), torch.randn(8, 6)
    at, bt = a.t().contiguous().t(), b.t().contiguous().t()
    for _ in range(4):
        torch.testing.assert_close(region(a, b)[0], _body(a, b))
        torch.testing.assert_close(region(at, bt)[0], _body(at, bt))
    assert region.fast is None
    assert region._fast_builds == 0


def test_a_changing_steady_layout_rebuilds_the_check_a_bounded_number_of_times(compiled_region):
    region = compiled_region
    _fresh(region)
    a, b = torch.randn(8, 6), torch.randn(8, 6)
    at, bt = a.t().contiguous().t(), b.t().contiguous().t()
    for _ in range(inductor.MAX_FAST_BUILDS + 3):
        for x, y in ((a, b), (a, b), (at, bt), (at, bt)):
            torch.testing.assert_close(region(x, y)[0], _body(x, y))
    assert region._fast_builds == inductor.MAX_FAST_BUILDS


def test_threads_calling_one_region_in_two_layouts_get_eagers_results(compiled_region):
    region = compiled_region
    _fresh(region)
    layouts = []
    for k in range(2):
        a, b = torch.randn(8, 6), torch.randn(8, 6)
        if k:
            a, b = a.t().contiguous().t(), b.t().contiguous().t()
        layouts.append((a, b, _body(a, b)))
    errors = []

    def work(a, b, want):
        try:
            for _ in range(200):
                torch.testing.assert_close(region(a, b)[0], want)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=layout) for layout in layouts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_the_report_times_regions_that_run_through_the_check(sync_compile):
    """fulmen.report swaps ``variants``' callables for timed ones: a region already running through its C++ check
    must be timed too, and run its own callable again afterwards."""
    from fulmen.report import _timed_regions

    jf = fulmen.jit(_body, executors=["inductor"])
    a, b = torch.randn(8, 6), torch.randn(8, 6)
    for _ in range(3):
        jf(a, b)
    region = _region(jf)
    assert region.fast is not None
    times, eager_times = {}, {}
    sym = [b.sym for b in fulmen.last_traces(jf)[-1].bound_symbols if b.sym.is_fusion][0]
    with _timed_regions([sym], times, eager_times, lambda: None):
        for _ in range(3):
            torch.testing.assert_close(jf(a, b), _body(a, b))
    assert len(times[sym.name]) == 3
    for _ in range(3):
        torch.testing.assert_close(jf(a, b), _body(a, b))
    assert len(times[sym.name]) == 3, "the timed callables are gone after the report"


# ---- a model's layers share one kernel ----


def _llama_step(run, inputs, autocast: bool):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits, loss = run(*inputs)
    loss.backward()
    return logits, loss


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_every_layer_of_the_llama_step_runs_one_shared_region_code(autocast):
    """Under bf16 autocast the last layer's residual sum is read by nothing after it (the backward recomputes the
    other layers' from saved bfloat16 projections), so it returned one value fewer and compiled separately; each
    layer now returns the same values. The step still gives eager's loss and gradients."""
    from fulmen.bench.models import build, size_overrides

    sizes = {**size_overrides("llama-1b", n_layer=3, width=64, seq_len=8), "vocab_size": 256}
    model, make_inputs = build("llama-1b", **sizes)
    reference, _ = build("llama-1b", **sizes)
    inputs = make_inputs(1, targets=True)
    run = fulmen.jit(model, compile="off")
    for _ in range(2):  # the second call runs fulmen's own forward and backward (the first runs PyTorch autograd)
        model.zero_grad(set_to_none=True)
        logits, loss = _llama_step(run, inputs, autocast)
    for label, trace in (("forward", fulmen.last_traces(run)[-1]), ("backward", fulmen.last_backward_traces(run)[-1])):
        regions = [b for b in trace.bound_symbols if b.sym.is_fusion]
        codes: dict[tuple, int] = {}
        for b in regions:
            codes[b.sym.impl.code_key] = codes.get(b.sym.impl.code_key, 0) + 1
        assert max(codes.values()) == 3, f"{label}: the 3 layers' regions should share one code, got {codes.values()}"

    want_logits, want_loss = _llama_step(reference, inputs, autocast)
    tol = {"rtol": 2e-2, "atol": 2e-2} if autocast else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(loss, want_loss, **tol)
    torch.testing.assert_close(logits.float(), want_logits.float(), **tol)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m, name=name: f"{name}: {m}")
