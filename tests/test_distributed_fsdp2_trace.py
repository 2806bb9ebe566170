"""FSDP2 (``fully_shard``) under ``fulmen.jit`` traced whole, on 2 gloo ranks (CPU): each unit's all-gather in the
forward trace, the gradients' reduce-scatter in the backward trace, no full-size parameter saved for the backward,
and training equal to eager FSDP2's (SGD and AdamW, uneven shards: the head's one row on two ranks).

Each spawn builds the eager reference and the jitted model from one seed in the same process and returns what the
checks compare; the tolerances are float32 ones (the same operations in the same order as eager, up to the
association of a few sums).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

from fulmen.launch import run_on_ranks

TOL = dict(rtol=1e-5, atol=1e-6)
FULL_WEIGHT_SHAPES = {(16, 8), (8, 16)}  # the blocks' weights, as all-gathered


class Block(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self, width: int = 8, depth: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)  # one row: rank 0's shard holds it, rank 1's is empty (padded to gather)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def _batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g)


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _assert_params_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _sharded(mesh, seed: int = 0):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    net = Net()
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _steps(model, net, opt, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = model(_batch(rank, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _accumulate_without_sync(model, net, rank: int) -> float:
    """Two micro-batches, the first without gradient sync (FSDP keeps its gradient unsharded), then a step."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net.set_requires_gradient_sync(False)
    model(_batch(rank, 10)).backward()
    net.set_requires_gradient_sync(True)
    loss = model(_batch(rank, 11))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _fsdp2_traced(rank, world_size, options):
    from torch.distributed.device_mesh import init_device_mesh

    import fulmen
    from fulmen.bench.memory import saved_tensors

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for optimizer in ("sgd", "adamw"):
        for order in ("eager", "jit"):
            net = _sharded(mesh)
            model = fulmen.jit(net, **options) if order == "jit" else net
            opt = (
                torch.optim.SGD(net.parameters(), lr=0.1)
                if optimizer == "sgd"
                else torch.optim.AdamW(net.parameters(), lr=0.01)
            )
            out[optimizer, order] = _steps(model, net, opt, rank, range(3))
            out[optimizer, order, "params"] = _full_params(net)
            if order == "jit" and optimizer == "sgd":
                out["forward"] = str(fulmen.last_traces(model)[-1])
                out["backward"] = str(fulmen.last_backward_traces(model)[-1])
                loss = model(_batch(rank, 5))
                out["saved"] = [tuple(t.shape) for t in saved_tensors(loss)]
                loss.backward()
                out["grad_types"] = {type(p.grad).__name__ for p in net.parameters()}
                opt.zero_grad()
                out["misses"] = fulmen.cache_misses(model)
                # later calls: FSDP's unshard() makes the call run eagerly through FSDP's hooks; gradients
                # accumulated without sync too
                net.unshard()
                reference = _sharded(mesh)
                reference.load_state_dict(net.state_dict())
                reference.unshard()
                out["unsharded"] = [model(_batch(rank, 6)).item(), reference(_batch(rank, 6)).item()]
                net.reshard()
                reference.reshard()
                out["no_sync"] = [
                    _accumulate_without_sync(model, net, rank),
                    _accumulate_without_sync(reference, reference, rank),
                ]
                out["no_sync_params"] = [_full_params(net), _full_params(reference)]
                out["misses_after"] = fulmen.cache_misses(model)
    return out


def _count(trace: str, op: str) -> int:
    calls = (line for line in trace.splitlines() if not line.lstrip().startswith("#"))
    return sum(f"_c10d_functional.{op}(" in line for line in calls)


def _gathers_one_unit_ahead(trace: str) -> bool:
    """Whether each unit's parameters are gathered at most one unit ahead of where it begins, not all at the top of
    the program (which would hold every unit's parameters at once): each all-gather starts after the previous one is
    waited for, and computation runs between each two blocks' waits. The root's all-gather (its head) comes first,
    right before the first block's."""
    lines = [line for line in trace.splitlines() if not line.lstrip().startswith("#")]
    gathered = {}
    for i, line in enumerate(lines):
        m = re.search(r"(\w+) = torch\.ops\._c10d_functional\.all_gather_into_tensor\(", line)
        if m:
            gathered[m.group(1)] = i
    waits = [
        i for i, line in enumerate(lines) if (m := re.search(r"wait_tensor\((\w+)\)", line)) and m.group(1) in gathered
    ]
    starts = sorted(gathered.values())
    compute = re.compile(r"linear|matmul|inductor_fusion")
    one_in_flight = all(w < g for w, g in zip(waits, starts[1:]))
    return one_in_flight and all(any(compute.search(line) for line in lines[a:b]) for a, b in zip(waits[1:], waits[2:]))


def _check(results: list[dict]) -> None:
    for out in results:
        for optimizer in ("sgd", "adamw"):
            torch.testing.assert_close(out[optimizer, "jit"], out[optimizer, "eager"], **TOL)
            _assert_params_close(out[optimizer, "jit", "params"], out[optimizer, "eager", "params"])
        assert out["grad_types"] == {"DTensor"}  # param.grad has the parameter's spec, as FSDP2 leaves it
        # one all-gather per unit, at most one unit ahead of where its forward begins (the root's head, then each
        # block's four parameters in one buffer); the backward reduce-scatters each unit's gradients, averaged over
        # the ranks as FSDP2 does
        assert _count(out["forward"], "all_gather_into_tensor") == 3
        assert _gathers_one_unit_ahead(out["forward"]), out["forward"]
        assert _count(out["backward"], "reduce_scatter_tensor") == 3
        assert "'avg'" in out["backward"]
        # the blocks' weights are gathered again in the backward rather than saved from the forward
        assert _count(out["backward"], "all_gather_into_tensor") >= 2
        assert not FULL_WEIGHT_SHAPES & set(out["saved"]), out["saved"]
        assert out["misses"] == 1 and out["misses_after"] == 1
        torch.testing.assert_close(out["unsharded"][0], out["unsharded"][1], **TOL)
        torch.testing.assert_close(out["no_sync"][0], out["no_sync"][1], **TOL)
        _assert_params_close(*out["no_sync_params"])
    for optimizer in ("sgd", "adamw"):  # the ranks hold the same parameters, after training on different batches
        _assert_params_close(results[0][optimizer, "jit", "params"], results[1][optimizer, "jit", "params"])
    assert results[0]["sgd", "eager"] != results[1]["sgd", "eager"]


# fusion (the default executors) in the default run; the torch executor among the slow tests (each a 2-rank spawn)
@pytest.mark.parametrize(
    "options",
    [pytest.param({"executors": ["torch"]}, marks=pytest.mark.slow), {"compile": "sync"}],
    ids=["torch", "fusion"],
)
def test_fsdp2_traced_whole_matches_eager(options):
    _check(run_on_ranks(_fsdp2_traced, options, timeout=400))


def _later_calls(rank, world_size):
    """Blocks sharded, the root not; SGD steps, a call under no_grad, one in eval mode, then ``fully_shard`` on the
    head after ``fulmen.jit`` (a DTensor the program was not traced with: that call runs through FSDP's hooks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fulmen

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for order in ("eager", "jit"):
        torch.manual_seed(0)
        net = Net()
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        model = fulmen.jit(net, executors=["torch"]) if order == "jit" else net
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        losses = _steps(model, net, opt, rank, range(2))
        with torch.no_grad():
            losses.append(model(_batch(rank, 7)).item())
        net.eval()
        losses.append(model(_batch(rank, 8)).item())
        net.train()
        fully_shard(net.head, mesh=mesh)
        losses += _steps(model, net, opt, rank, range(9, 10))
        out[order] = losses
        out[order, "params"] = {n: p.full_tensor().detach() for n, p in net.named_parameters()}
    return out


@pytest.mark.slow  # a spawned 2-rank run
def test_fsdp2_traced_whole_later_calls_match_eager():
    for out in run_on_ranks(_later_calls, timeout=300):
        torch.testing.assert_close(out["jit"], out["eager"], **TOL)
        _assert_params_close(out["jit", "params"], out["eager", "params"])
