"""Communication overlapping computation in FSDP2's traced program (``overlap_communication=True``), 2 gloo ranks.

With overlap on, each unit's parameter all-gather starts while the unit before it computes and is waited for just
before its first reader, one unit ahead as FSDP2 prefetches: one all-gather is in flight at a time, so the units
whose full-size parameters are alive stay bounded (the root's, the unit computing, the next one's) however many
units the model has. In the backward, the re-gathers do the same in reverse, and each reduce-scatter starts once
its unit's gradients are complete, the previous one waited for then (one in flight, as FSDP2 runs them). Training
equals eager FSDP2's (float32 tolerances: the same operations, in the same order per value).

The checks read the final execution traces: a gathered buffer is alive from its all-gather to the last ``del`` of
it and of every view of it.
"""

from __future__ import annotations

import pytest
import torch

from fulmen.launch import run_on_ranks

TOL = dict(rtol=1e-5, atol=1e-6)
DEPTH = 3  # blocks: with the root, four units, more than the bound of three alive at once


class Block(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self, width: int = 8, depth: int = DEPTH):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = torch.nn.Linear(width, 1)  # the root's: one row, rank 1's shard empty

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def _steps(model, opt, rank: int, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full_params(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _assert_params_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _sharded(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = Net()
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _schedule(trace) -> dict:
    """What the checks need of an execution trace: the most parameter all-gathers in flight at once, the most units
    whose gathered parameters are alive at once, and the positions of collectives and computation."""
    from fulmen.core.bookkeeping import DEL
    from fulmen.core.proxies import Proxy
    from fulmen.core.symbol import OpTags

    unit_of: dict[str, int] = {}  # a gathered buffer's name, and its views', -> its all-gather's number
    alive: dict[int, set[str]] = {}
    out = {"in_flight": 0, "rs_in_flight": 0, "alive": 0, "events": []}
    in_flight = rs_in_flight = 0
    scattered: set[str] = set()  # the reduce-scatters' results in flight
    reduced: set[str] = set()  # what a reduce-scatter's result makes
    read = {p.name for b in trace.bound_symbols if b.sym is not DEL for p in b.flat_args if isinstance(p, Proxy)}
    for i, b in enumerate(trace.bound_symbols):
        tags = b.sym.tags
        names = [p.name for p in b.flat_args if isinstance(p, Proxy)]
        outs = [p.name for p in b.flat_proxy_outs]
        if b.sym is DEL:
            for name in names:
                if name in unit_of:
                    alive[unit_of[name]].discard(name)
            continue
        if OpTags.RECOMPUTABLE in tags and OpTags.WAIT not in tags:  # FSDP2's parameter all-gather
            unit_of[outs[0]] = len(alive)
            alive[len(alive)] = {outs[0]}
            in_flight += 1
            out["events"].append(("gather", i))
        elif OpTags.COMMUNICATION in tags and OpTags.WAIT not in tags:
            out["events"].append(("reduce_scatter", i))
            scattered.update(outs)
            rs_in_flight += 1
        elif OpTags.WAIT in tags:
            param = any(n in unit_of for n in names)
            in_flight -= param
            rs_in_flight -= bool(scattered & set(names))
            out["events"].append(("gather_wait" if param else "wait", i))
            reduced.update(outs if not param else ())
        elif reduced & set(names):  # splits a reduce-scatter's result into the parameters' gradients
            reduced.update(outs)
        elif not ({OpTags.VIEW, OpTags.SHAPE_OP} & set(tags)):
            out["events"].append(("compute", i))
        if OpTags.WAIT in tags or OpTags.VIEW in tags or OpTags.SHAPE_OP in tags:
            for name in names:
                if name in unit_of:  # the result may be the gathered buffer's memory
                    for o in (o for o in outs if o in read):  # (an output never read is not kept: ``_``)
                        unit_of[o] = unit_of[name]
                        alive[unit_of[name]].add(o)
        out["in_flight"] = max(out["in_flight"], in_flight)
        out["rs_in_flight"] = max(out["rs_in_flight"], rs_in_flight)
        out["alive"] = max(out["alive"], sum(bool(names) for names in alive.values()))
    return out


def _overlapped(rank, world_size, options):
    from torch.distributed.device_mesh import init_device_mesh

    import fulmen

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for order in ("eager", "jit"):
        net = _sharded(mesh)
        model = fulmen.jit(net, overlap_communication=True, **options) if order == "jit" else net
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        out[order] = _steps(model, opt, rank, 2)
        out[order, "params"] = _full_params(net)
    out["forward"] = _schedule(fulmen.last_traces(model)[-1])
    out["backward"] = _schedule(fulmen.last_backward_traces(model)[-1])
    out["peaks"] = _backward_peaks(mesh, options)
    return out


def _backward_peaks(mesh, options) -> dict:
    """The bytes the backward trace holds at its peak with overlap on and off, on a batch whose activations
    outweigh a unit's parameters (a schedule computing every block's recomputed activations at once shows); and
    the largest gathered unit and reduce-scatter input."""
    import fulmen
    from fulmen.core.symbol import OpTags
    from fulmen.transforms.liveness import nbytes, peak_live

    out = {}
    for overlap in (True, False):
        model = fulmen.jit(_sharded(mesh), overlap_communication=overlap, **options)
        model(torch.randn(256, 8)).backward()
        trace = fulmen.last_backward_traces(model)[-1]
        out[overlap] = peak_live(trace).bytes
    out["gathered"] = max(nbytes(b.flat_proxy_outs[0]) for b in trace.bound_symbols if OpTags.PREFETCH in b.sym.tags)
    out["scattered"] = max(nbytes(b.flat_args[0]) for b in trace.bound_symbols if OpTags.ONE_IN_FLIGHT in b.sym.tags)
    return out


def _between(events: list, first: int, last: int, kind: str = "compute") -> bool:
    return any(k == kind and first < i < last for k, i in events)


def _check_forward(schedule: dict) -> None:
    events = schedule["events"]
    gathers = [i for k, i in events if k == "gather"]
    waits = [i for k, i in events if k == "gather_wait"]
    assert len(gathers) == len(waits) == DEPTH + 1  # the root's (the head), then each block's
    # one all-gather in flight at a time: each starts after the previous one's wait
    assert all(w < g for w, g in zip(waits, gathers[1:])), events
    # from the second block on, the gather overlaps the previous block's computation: it starts before it
    for k in range(2, DEPTH + 1):
        assert _between(events, gathers[k], waits[k]), (k, events)
    assert schedule["in_flight"] == 1
    assert schedule["alive"] <= 3, schedule  # the root's, the unit computing, the next one's


def _check_backward(schedule: dict) -> None:
    events = schedule["events"]
    gathers = [i for k, i in events if k == "gather"]
    waits = [i for k, i in events if k == "gather_wait"]
    reduce_scatters = [i for k, i in events if k == "reduce_scatter"]
    rs_waits = [i for k, i in events if k == "wait"]
    compute = [i for k, i in events if k == "compute"]
    assert len(reduce_scatters) == len(rs_waits) == DEPTH + 1
    assert len(gathers) >= DEPTH and schedule["in_flight"] == 1  # the blocks gathered again, one in flight
    assert all(w < g for w, g in zip(waits, gathers[1:])), events
    # each re-gather after the first overlaps the computation of the unit before it
    assert all(_between(events, g, w) for g, w in zip(gathers[1:], waits[1:])), events
    # one reduce-scatter in flight (each holds a unit's full-size gradient until its wait): the last block's starts
    # as its gradients are complete and runs while the next block's are computed; the previous one is waited for
    # where the next one starts, the last one after all the computation but the splitting of its result
    assert schedule["rs_in_flight"] == 1, events
    assert all(w < r for w, r in zip(rs_waits, reduce_scatters[1:])), events
    assert _between(events, reduce_scatters[0], rs_waits[0]), events
    assert rs_waits[-1] > max(compute), events
    assert schedule["alive"] <= 3, schedule


def _check(results: list[dict]) -> None:
    for out in results:
        torch.testing.assert_close(out["jit"], out["eager"], **TOL)
        _assert_params_close(out["jit", "params"], out["eager", "params"])
        _check_forward(out["forward"])
        _check_backward(out["backward"])
        # overlap costs one unit's gathered parameters and its shards' copy in flight, and one reduce-scatter's
        # input and result in flight (each shard half its unit): no more
        peaks = out["peaks"]
        assert peaks[True] <= peaks[False] + 1.5 * (peaks["gathered"] + peaks["scattered"]), peaks
    _assert_params_close(results[0]["jit", "params"], results[1]["jit", "params"])


# the torch executor in the default run (the overlap step orders the trace); fusion, which sorts it again, slow
@pytest.mark.parametrize(
    "options",
    [{"executors": ["torch"]}, pytest.param({"compile": "sync"}, marks=pytest.mark.slow)],
    ids=["torch", "fusion"],
)
def test_fsdp2_overlap_prefetches_one_unit_and_matches_eager(options):
    _check(run_on_ranks(_overlapped, options, timeout=400))


# ---- the schedule alone, on traces of FSDP2's collectives (no process group: nothing runs) ----


def _units(x, *shards):
    """Four units as FSDP2's program makes them: gather a unit's shard, compute with it, reduce-scatter the gradient
    of what it computed (the program waits for each collective at once, as written)."""
    from fulmen.torch import collectives as c

    grads = []
    for s in shards:
        full = c.param_wait(c.param_all_gather(s.reshape(-1), 2, "g")).view(4, 4)
        x = torch.tanh(x @ full)
        grads.append(c.wait_tensor(c.param_reduce_scatter((x.t() @ x).reshape(-1), "avg", 2, "g")))
    return x, *grads


def _scheduled(fn, units: int = 4) -> list[str]:
    """The overlap step's order of ``fn``'s collectives and matmuls, by kind."""
    import fulmen
    from fulmen.transforms.overlap import overlapping, schedule_communication

    trace = fulmen.trace()(fn, torch.randn(4, 4), *[torch.randn(2, 4) for _ in range(units)])
    with overlapping(True):
        return _kinds(schedule_communication(trace))


def _kinds(trace) -> list[str]:
    """A trace's collectives and matmuls, by kind."""
    from fulmen.core.symbol import OpTags

    kinds, gathered = [], set()
    for b in trace.bound_symbols:
        tags, outs = b.sym.tags, [p.name for p in b.flat_proxy_outs]
        if OpTags.PREFETCH in tags:
            kinds.append("gather")
            gathered.update(outs)
        elif OpTags.ONE_IN_FLIGHT in tags:
            kinds.append("scatter")
        elif OpTags.WAIT in tags:
            kinds.append("gather_wait" if b.flat_args[0].name in gathered else "scatter_wait")
        elif "matmul" in b.sym.name:
            kinds.append("matmul")
    return kinds


def _most_in_flight(kinds: list[str], start: str) -> int:
    count = most = 0
    for k in kinds:
        count += (k == start) - (k == start + "_wait")
        most = max(most, count)
    return most


def test_schedule_prefetches_each_gather_while_the_unit_before_computes():
    kinds = _scheduled(_units)
    assert _most_in_flight(kinds, "gather") == 1 and _most_in_flight(kinds, "scatter") == 1, kinds
    # the program's order: gather, wait, compute, reduce-scatter, wait; scheduled, each unit's gather starts before
    # the unit before it computes, and each reduce-scatter runs while the next unit computes
    assert kinds[:3] == ["gather", "gather_wait", "gather"], kinds
    unit = ["matmul", "matmul", "scatter", "gather_wait", "gather", "matmul", "matmul", "scatter_wait", "scatter"]
    assert kinds[3:12] == unit, kinds
    assert kinds[-2:] == ["scatter", "scatter_wait"], kinds  # the last one waited for at the end


def _recomputing_units(x, *tensors):
    """A backward as rematerialization leaves it: each unit gathers its parameters, recomputes an activation from a
    tensor the forward saved (ready from the start, read only by this unit), computes with both and
    reduce-scatters a gradient."""
    from fulmen.torch import collectives as c

    half = len(tensors) // 2
    grads = []
    for shard, saved in zip(tensors[:half], tensors[half:]):
        full = c.param_wait(c.param_all_gather(shard.reshape(-1), 2, "g")).view(16, 16)
        x = (x @ full) * torch.tanh(saved)
        grads.append(c.wait_tensor(c.param_reduce_scatter((x.t() @ x).reshape(-1), "avg", 2, "g")))
    return x, *grads


def test_schedule_holds_at_most_one_more_unit_than_the_program():
    # the scheduler ran every operation not waiting on a collective before the first wait: each unit's recomputed
    # activation at the top of the backward, all alive together (what raised gpt-small's peak with overlap on)
    import fulmen
    from fulmen.core.symbol import OpTags
    from fulmen.transforms.liveness import nbytes, peak_live
    from fulmen.transforms.overlap import overlapping, schedule_communication
    from fulmen.transforms.passes import del_last_used

    units = 4
    shards = [torch.randn(8, 16) for _ in range(units)]
    saved = [torch.randn(256, 16) for _ in range(units)]  # each activation 16 KiB, the gathered parameters 1 KiB
    trace = fulmen.trace()(_recomputing_units, torch.randn(256, 16), *shards, *saved)
    with overlapping(True):
        scheduled = schedule_communication(trace)
    program, overlapped = peak_live(del_last_used(trace)), peak_live(del_last_used(scheduled))
    gathered = [b.flat_proxy_outs[0] for b in trace.bound_symbols if OpTags.PREFETCH in b.sym.tags]
    scattered = [b.flat_args[0] for b in trace.bound_symbols if OpTags.ONE_IN_FLIGHT in b.sym.tags]
    # one unit's gathered parameters prefetched, and one reduce-scatter in flight (its input and result)
    extra = nbytes(gathered[0]) + nbytes(scattered[0]) * 3 // 2
    assert overlapped.bytes <= program.bytes + extra, (program, overlapped)
    kinds = _kinds(scheduled)
    assert _most_in_flight(kinds, "gather") == 1 and _most_in_flight(kinds, "scatter") == 1, kinds
    # still overlapped: each gather after the first starts before the unit before it computes
    assert kinds[:4] == ["gather", "gather_wait", "gather", "matmul"], kinds


def test_peak_live_counts_views_once_and_holds_a_collectives_input_until_its_wait():
    import fulmen
    from fulmen.torch import collectives as c
    from fulmen.transforms.liveness import peak_live
    from fulmen.transforms.passes import del_last_used

    def f(x):
        y = (x * 2).view(-1)  # 4 KiB, and a view of it that adds nothing
        started = c.all_reduce(y, "sum", "g")  # holds y (4 KiB) and its result (4 KiB) until the wait
        z = torch.tanh(x)  # 4 KiB while both are held
        return c.wait_tensor(started).sum() + z.sum()

    trace = del_last_used(fulmen.trace()(f, torch.randn(32, 32)))
    peak = peak_live(trace)
    assert peak.bytes == 3 * 32 * 32 * 4, (peak, str(trace))
