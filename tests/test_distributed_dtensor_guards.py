"""Later calls of a tensor-parallel module under ``fulmen.jit`` (the DTensor program) on 2 gloo ranks: what a user
changes between calls, compared with the same module run by eager DTensor in the same process.

One spawn checks several things: tensor attributes that are neither parameters nor buffers (replaced or updated in
place between calls), a forward that rebinds a buffer (refused: the program cannot rebind the module's attribute),
dropout's random stream, a swapped layer of an ``nn.Sequential``, a replaced forward hook and a ``forward`` set on
the instance. The tolerances are float32 ones: the program computes the same operations in the same order as eager,
up to the association of a few sums.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

from fulmen.launch import run_on_ranks

TOL = dict(rtol=1e-5, atol=1e-6)


class _Masked(nn.Module):
    """A column- then row-wise parallel pair in an ``nn.Sequential`` (torch's code calls its layers), scaled by a
    plain tensor attribute (neither a parameter nor a buffer)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.0), nn.Linear(16, 8))
        self.mask = torch.full((8,), 2.0)

    def forward(self, x):
        return self.body(x) * self.mask


class _Rebinding(_Masked):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count = self.count + 1  # a new tensor bound to the buffer: eager keeps it, a traced program cannot
        return super().forward(x) * self.count


def _parallel(cls, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    return parallelize_module(cls(), mesh, {"body.0": ColwiseParallel(), "body.3": RowwiseParallel()})


def _x(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


def _changes(model: nn.Module, module: nn.Module) -> list:
    """Calls ``model`` (``module`` itself, or fulmen.jit of it) as a user changing the module between calls would."""
    outs = [model(_x(0))]
    module.mask = torch.full((8,), 3.0)  # replaced
    outs.append(model(_x(0)))
    module.mask.fill_(5.0)  # updated in place
    outs.append(model(_x(1)))
    module.body[2].p = 0.5  # dropout: the same random stream as eager's, fresh numbers each call
    torch.manual_seed(7)
    outs += [model(_x(2)), model(_x(2))]
    outs[-1].sum().backward()
    outs.append(torch.rand(3))  # the generator's state after the calls
    module.body[2].p = 0.0
    module.body[1] = nn.Sigmoid()  # a layer swapped for another with the same attributes
    outs.append(model(_x(3)))
    for factor in (2.0, 3.0):  # a forward hook replaced by another (the same number of hooks)
        handle = module.body[0].register_forward_hook(lambda m, i, o, factor=factor: o * factor)
        outs.append(model(_x(4)))
        handle.remove()
    module.forward = types.MethodType(lambda self, x: type(self).forward(self, x) * 2, module)  # set on the instance
    outs.append(model(_x(5)))
    del module.forward
    outs.append(model(_x(5)))
    outs.append(module.body[0].weight.grad.full_tensor())
    return [t.detach() for t in outs]


def _sequential_changes(model: nn.Module, module: nn.Sequential) -> list:
    """A root ``nn.Sequential``: no user code reads its layers or hooks (its own or global ones), torch's code calls
    them."""
    outs = [model(_x(0))]
    module[1] = nn.Sigmoid()
    outs.append(model(_x(0)))
    for factor in (2.0, 3.0):
        handle = module[0].register_forward_hook(lambda m, i, o, factor=factor: o * factor)
        outs.append(model(_x(1)))
        handle.remove()
    for factor in (2.0, 3.0):  # a global forward hook, replaced by another
        hook = lambda m, i, o, factor=factor: o * factor if isinstance(m, nn.Sigmoid) else o  # noqa: E731
        handle = nn.modules.module.register_module_forward_hook(hook)
        outs.append(model(_x(2)))
        handle.remove()
    return [t.detach() for t in outs]


def _later_calls(rank: int, world_size: int, options: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import fulmen

    mesh = init_device_mesh("cpu", (world_size,))
    eager, net = _parallel(_Masked, mesh), _parallel(_Masked, mesh)
    out = {"eager": _changes(eager, eager), "jit": _changes(fulmen.jit(net, **options), net)}
    eager, net = _parallel(_Masked, mesh).body, _parallel(_Masked, mesh).body
    out["eager"] += _sequential_changes(eager, eager)
    out["jit"] += _sequential_changes(fulmen.jit(net, **options), net)
    rebinding = _parallel(_Rebinding, mesh)
    try:
        fulmen.jit(rebinding, **options)(_x(0))
    except NotImplementedError as e:
        out["rebind"] = str(e)
    return out


@pytest.mark.parametrize("options", [{"executors": ["torch"]}], ids=["torch"])
def test_tensor_parallel_later_calls_match_eager(options):
    results = run_on_ranks(_later_calls, options, timeout=300)
    for result in results:
        assert len(result["jit"]) == len(result["eager"])
        for i, (got, expected) in enumerate(zip(result["jit"], result["eager"])):
            torch.testing.assert_close(got, expected, **TOL, msg=lambda m, i=i: f"value {i}: {m}")
        # the forward's rebinding of a buffer is refused, naming the module, the buffer and what to do
        assert "_Rebinding" in result["rebind"] and "count" in result["rebind"] and "in place" in result["rebind"]
