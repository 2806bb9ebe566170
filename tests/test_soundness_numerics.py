"""References that do not depend on the machine: points where eager PyTorch's own result varies with the CPU's
vector width or the thread count are checked against the mathematical value or a float64 reference instead."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fulmen.torch as ltorch
from fulmen.testing import run_decomposed
from fulmen.tests.opinfos.nn import gelu_opinfo
from fulmen.tests.opinfos.nn_losses import sdpa_opinfo


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("n", [1, 64])
def test_gelu_decomposition_takes_the_limits_at_infinity(approximate, n):
    """gelu(x) = x * Phi(x) tends to +inf at +inf (eager's vectorized CPU kernel gives nan there, its scalar one
    inf); at -inf the product -inf * 0 is nan, as in eager, float64 included."""
    x = torch.full((n,), math.inf)
    out = run_decomposed(ltorch.gelu, x, approximate=approximate)
    assert torch.isposinf(out).all(), out
    out = run_decomposed(ltorch.gelu, -x, approximate=approximate)
    assert torch.isnan(out).all(), out


def test_gelu_samples_leave_out_only_plus_infinity():
    """The OpInfo's special values still hold nan, -inf, signed zeros and large magnitudes."""
    values = set()
    for sample in gelu_opinfo.sample_inputs("cpu", torch.float32):
        values.update(sample.args[0].flatten().tolist())
    assert math.inf not in values
    assert {-math.inf, 30.0, -30.0} <= values and any(math.isnan(v) for v in values)


def _double(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


@pytest.mark.parametrize("threads", [1, 2])
def test_sdpa_decomposition_is_as_close_to_float64_as_eager_whatever_the_thread_count(threads):
    """Eager's flash kernel blocks its float32 sums by thread count. For every sample without dropout, the
    decomposition is within the OpInfo's float32 tolerance of eager, and no further from a float64 reference
    than eager's own error plus that tolerance."""
    rtol, atol = sdpa_opinfo.tolerances(torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for sample in sdpa_opinfo.sample_inputs("cpu", torch.float32):
            if sample.kwargs.get("dropout_p"):
                continue
            eager = F.scaled_dot_product_attention(*sample.args, **sample.kwargs)
            exact = F.scaled_dot_product_attention(*map(_double, sample.args),
                                                   **{k: _double(v) for k, v in sample.kwargs.items()})
            ours = run_decomposed(ltorch.scaled_dot_product_attention, *sample.args, **sample.kwargs)
            torch.testing.assert_close(ours, eager, rtol=rtol, atol=atol, msg=lambda m: f"{sample}: {m}")
            eager_error = (eager.double() - exact).abs().max().item()
            our_error = (ours.double() - exact).abs().max().item()
            assert our_error <= eager_error + atol, (sample, our_error, eager_error)
    finally:
        torch.set_num_threads(before)
