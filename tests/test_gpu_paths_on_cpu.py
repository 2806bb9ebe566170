"""The CUDA branches of what ``benchmarks/gpu_check.sh scale`` runs, run on a CPU, so that a mistake in them shows
here rather than in the few minutes a GPU is lent.

Where a branch calls ``torch.cuda``, the call is replaced by an autospec of the real function (a call with the
wrong arguments fails as it would on a GPU) and the rest of the branch runs. Where it builds CUDA operations, the
proxies say ``cuda`` and the kernels run on meta tensors, whose shapes are the CUDA kernels' own."""

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from fulmen.bench import flops, memory, runner, step_profile
from fulmen.core.proxies import TensorProxy
from fulmen.core.trace import Trace, tracectx
from fulmen.executors import sdpa
from fulmen.transforms import grad_ops

CUDA = torch.device("cuda")


def _fake_cuda(name: str, **kwargs):
    """``torch.cuda.<name>`` replaced by an autospec of itself (the real signature checks every call)."""
    return mock.patch(f"torch.cuda.{name}", mock.create_autospec(getattr(torch.cuda, name), **kwargs))


def _proxies(shapes, dtype=torch.bfloat16, device="cuda"):
    return [TensorProxy(n, shape=s, dtype=dtype, device=device) for n, s in zip("qkv", shapes)]


# ---- attention: the sdpa executor's CUDA path ----

SHAPES = [(2, 4, 40, 64), (2, 4, 24, 64), (2, 4, 24, 64)]  # 40 query rows: the kernel pads its lse rows to 64


@pytest.mark.parametrize("is_causal,scale", [(True, None), (False, 0.3)])
def test_sdpa_executor_metas_are_the_cuda_kernels(is_causal, scale):
    """What the executor's operations say they return on CUDA is what the memory-efficient kernels return (run
    on meta tensors): the log-sum-exp has its rows padded to a multiple of 32."""
    with tracectx(Trace()):
        q, k, v = _proxies(SHAPES)
        out_p, lse_p = sdpa._fwd_meta(q, k, v, None, 0.0, is_causal, scale)
        grads_p = sdpa._bwd_meta(out_p, q, k, v, out_p, lse_p, None, 0.0, is_causal, scale)
    mq, mk, mv = (torch.empty(s, dtype=torch.bfloat16, device="meta") for s in SHAPES)
    out, lse = sdpa._fwd_impl(mq, mk, mv, None, 0.0, is_causal, scale)  # not CPU: the CUDA kernel
    grads = sdpa._bwd_impl(torch.empty_like(out), mq, mk, mv, out, lse, None, 0.0, is_causal, scale)
    for proxy, real in zip((out_p, lse_p, *grads_p), (out, lse, *grads)):
        assert (tuple(proxy.shape), proxy.dtype) == (tuple(real.shape), real.dtype)
    assert lse.shape[-1] == 64


def test_sdpa_executor_claims_on_cuda_what_the_gradient_rule_does():
    """Masks (which the kernel takes only padded and expanded, as eager's dispatcher prepares them), head sizes
    the kernel lacks and bfloat16 before Ampere are declined, as the default path's rule declines them."""
    with tracectx(Trace()), _fake_cuda("get_device_capability", return_value=(9, 0)):
        q, k, v = _proxies(SHAPES)
        mask = TensorProxy("m", shape=(40, 24), dtype=torch.bool, device="cuda")
        assert sdpa._checker(q, k, v, is_causal=True)
        assert not sdpa._checker(q, k, v, attn_mask=mask)
        assert not sdpa._checker(q, k, v, dropout_p=0.1)
        odd = _proxies([(2, 4, 40, 7)] * 3)
        assert not sdpa._checker(*odd)
        assert not sdpa._checker(*_proxies([(2, 4, 40, 64), (2, 4, 24, 64), (2, 4, 24, 64)], dtype=torch.float64))
    with tracectx(Trace()), _fake_cuda("get_device_capability", return_value=(7, 5)):
        assert not sdpa._checker(*_proxies(SHAPES))


def test_cuda_attention_kernels_take_the_arguments_fulmen_passes():
    """The gradient rule's CUDA attention (``efficient_attention_cuda``) against its own meta function."""
    mq, mk, mv = (torch.empty(s, dtype=torch.float16, device="meta") for s in SHAPES)
    out, lse = grad_ops.efficient_attention_forward(
        mq, mk.transpose(-1, -2).contiguous().transpose(-1, -2), mv, None, True, None
    )
    with tracectx(Trace()):
        q, k, v = _proxies(SHAPES, dtype=torch.float16)
        out_p, lse_p = grad_ops.efficient_attention_meta(q, k, v, None, True, None)
    assert (tuple(out_p.shape), tuple(lse_p.shape), lse_p.dtype) == (tuple(out.shape), tuple(lse.shape), lse.dtype)
    gq, gk, gv = grad_ops.efficient_attention_backward(torch.empty_like(out), mq, mk, mv, out, lse, None, True, 0.5)
    assert (gq.shape, gk.shape, gv.shape) == (mq.shape, mk.shape, mv.shape)


# ---- the benchmark runner's CUDA branches ----


def _step():
    x = torch.randn(16, 16)
    return lambda: (x @ x).sum()


def test_timed_step_and_device_busy_time_on_cuda():
    with _fake_cuda("synchronize") as sync:
        wall, host, cpu = step_profile.timed_step(_step(), CUDA)
        assert sync.call_count == 2 and wall >= host >= 0 and cpu >= 0
        # the profiler records no device time here: the branch runs to its end and says so
        with pytest.warns(UserWarning, match="CUDA"):
            assert step_profile.device_busy_ms(_step(), CUDA) is None
        runner._sync(CUDA)
    assert sync.call_args_list[-1] == mock.call(CUDA)


def test_device_busy_time_sums_the_profilers_self_device_time():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step()()
    events = prof.key_averages()
    assert events and all(e.self_device_time_total == 0 for e in events)  # the attribute the CUDA branch reads


def test_peak_memory_on_cuda_reads_the_allocators_peak():
    row = runner.BenchRow(
        model="mlp-tiny", mode="train", backend="eager", device="cuda", dtype="float32", batch_size=2, steps=1
    )
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    calls = []
    with (
        _fake_cuda("synchronize"),
        _fake_cuda("reset_peak_memory_stats") as reset,
        _fake_cuda("max_memory_allocated", return_value=3 * 2**20) as peak,
    ):
        runner._measure_memory(
            row, runner._no_progress, lambda: calls.append(1), CUDA, model, optimizer, (torch.randn(2, 4),)
        )
    reset.assert_called_once_with(CUDA)
    peak.assert_called_once_with(CUDA)
    assert len(calls) == 2 and row.peak_mb == 3.0 and row.peak_method == memory.CUDA_METHOD
    assert row.state_mb > 0


def test_a_cuda_devices_name_gives_its_peak():
    with _fake_cuda("get_device_name", return_value="NVIDIA H100 80GB HBM3"):
        name = flops.device_name(CUDA)
    assert name == "NVIDIA H100 80GB HBM3" and flops.peak_flops(name) == 989.4e12


# ---- gpu_check.sh diag: benchmarks/profile_gpu.py ----


@pytest.mark.slow  # a fresh process compiling a tiny model's regions
def test_profile_gpu_timeline_compiles_every_region():
    """The diag step's timeline times each lowering through a wrapper of ``_lower``: every region still compiles."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "FULMEN_COMPILE": "async"}  # the suite's default is "off"
    result = subprocess.run(
        [sys.executable, "benchmarks/profile_gpu.py", "--model", "mlp-tiny", "--device", "cpu", "--part", "timeline"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    stats = result.stdout.strip().splitlines()[-1]
    assert "'kernels_failed': 0" in stats and "'kernels_compiled': 0" not in stats, result.stdout[-3000:]
