"""fulmen with DTensor-based distributed training on 2 gloo ranks (CPU): FSDP2 (``fully_shard``) in both wrapping
orders, tensor parallelism (``parallelize_module``) and a ``torch.distributed.checkpoint`` round trip.

Each spawned run builds the eager reference and the fulmen model from one seed in the same process, trains both
with SGD on per-rank batches and returns the losses and full parameters, so one spawn checks several things. The
tolerances are float32 ones: the programs compute the same operations in the same order as eager, up to the
association of a few sums.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fulmen.launch import run_on_ranks

TOL = dict(rtol=1e-5, atol=1e-6)


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
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def _batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g)


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _train(model: nn.Module, rank: int, steps: range) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in steps:
        loss = model(_batch(rank, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _fsdp2(model: Net, mesh, order: str, **options) -> nn.Module:
    """``fully_shard`` on each block and the root, in eager PyTorch (``order="eager"``), with each block
    ``fulmen.jit``-ed first (``"jit_then_shard"``), or with ``fulmen.jit`` applied to the sharded model
    (``"shard_then_jit"``)."""
    from torch.distributed.fsdp import fully_shard

    import fulmen

    if order == "jit_then_shard":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = fulmen.jit(block, **options)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return fulmen.jit(model, **options) if order == "shard_then_jit" else model


def _fsdp2_both_orders(rank, world_size, checkpoint_dir, options):
    """Eager FSDP2 and both orders with fulmen, 3 SGD steps each; with a ``checkpoint_dir``, also a DCP round trip
    and the tensor parallel checks (one spawn for several checks: each costs seconds of start-up per rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import fulmen

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    models = {}
    for order in ("eager", "jit_then_shard", "shard_then_jit"):
        torch.manual_seed(0)
        models[order] = _fsdp2(Net(), mesh, order, **options)
        out[order] = _train(models[order], rank, range(3))
        out[order + "_params"] = _full_params(models[order])
    out["misses"] = [fulmen.cache_misses(b) for b in models["jit_then_shard"].blocks]
    out["misses"] += [fulmen.cache_misses(models["shard_then_jit"])]  # the whole model (fsdp2_program)
    # fulmen.jit over a model whose blocks were jitted before fully_shard keeps their programs
    rejitted = fulmen.jit(models["jit_then_shard"], **options)
    out["rejitted"] = [_train(rejitted, rank, range(3, 4))[0], _train(models["eager"], rank, range(3, 4))[0]]
    out["misses"] += [fulmen.cache_misses(b) for b in models["jit_then_shard"].blocks]
    traces = fulmen.last_traces(models["shard_then_jit"])
    out["trace"], out["execution"] = str(traces[0]), str(traces[-1])
    if checkpoint_dir is None:  # with fusion: tensor parallelism under fulmen.jit too
        out["tp_jit"] = _tp_under_jit(mesh, options)
        return out
    out["tp"] = _dtensor_programs(rank, world_size, mesh)
    torch.manual_seed(0)
    torch._dynamo.reset()
    dynamo_model = torch.compile(_fsdp2(Net(), mesh, "eager"), backend="fulmen", options=options)
    out["dynamo"] = _train(dynamo_model, rank, range(3))
    out["dynamo_params"] = _full_params(dynamo_model._orig_mod)

    # torch.distributed.checkpoint: save the jitted model's sharded state, load it into a fresh jitted model
    jitted = models["shard_then_jit"]
    dcp.save(get_model_state_dict(jitted), checkpoint_id=checkpoint_dir)
    torch.manual_seed(1)
    fresh = _fsdp2(Net(), mesh, "shard_then_jit", **options)
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_model_state_dict(fresh, state)
    out["loaded_params"] = _full_params(fresh)
    out["continued"] = _train(jitted, rank, range(3, 5))
    out["loaded_continued"] = _train(fresh, rank, range(3, 5))
    out["eager_continued"] = [out["rejitted"][1], *_train(models["eager"], rank, range(4, 5))]
    return out


def _assert_params_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _check_fsdp2_results(results: list[dict]) -> None:
    for out in results:
        for order in ("jit_then_shard", "shard_then_jit"):
            torch.testing.assert_close(out[order], out["eager"], **TOL)
            _assert_params_close(out[order + "_params"], out["eager_params"])
        # each block compiled once, then cache hits on every step (also through the re-jitted model)
        assert out["misses"] == [1, 1, 1, 1, 1]
        torch.testing.assert_close(out["rejitted"][0], out["rejitted"][1], **TOL)
        # the whole model's program all-gathers each unit's shards into full-size weights and reads those
        assert "ltorch.linear" in out["trace"] and "[16, 8]" in out["trace"]
        assert "_c10d_functional.all_gather_into_tensor" in out["trace"]
    # ranks hold the same full parameters (FSDP2 reduce-scattered the gradients)
    _assert_params_close(results[0]["shard_then_jit_params"], results[1]["shard_then_jit_params"])
    assert results[0]["eager"] != results[1]["eager"]  # the ranks trained on different batches


def test_fsdp2_both_orders_dcp_round_trip_and_tensor_parallel(tmp_path):
    results = run_on_ranks(_fsdp2_both_orders, str(tmp_path / "ckpt"), {"executors": ["torch"]}, timeout=300)
    _check_fsdp2_results(results)
    for out in results:
        # the checkpoint restores the parameters exactly, and training goes on as it would have
        _assert_params_close(out["loaded_params"], out["shard_then_jit_params"])
        assert out["loaded_continued"] == out["continued"]
        torch.testing.assert_close(out["continued"], out["eager_continued"], **TOL)
    _check_tensor_parallel_results([out["tp"] for out in results])
    for out in results:  # and FSDP2 under the Dynamo backend
        torch.testing.assert_close(out["dynamo"], out["eager"], **TOL)
        _assert_params_close(out["dynamo_params"], out["eager_params"])


def test_fsdp2_both_orders_and_tensor_parallel_with_fusion():
    results = run_on_ranks(_fsdp2_both_orders, None, {"compile": "sync"}, timeout=300)
    _check_fsdp2_results(results)
    assert all("inductor_fusion" in out["execution"] for out in results)
    tp = [out["tp_jit"] for out in results]
    _check_tp_under_jit(tp)
    for out in tp:  # the local computation fuses around the collectives, which stay outside the fused regions
        assert "inductor_fusion" in out["forward"] and "inductor_fusion" in out["backward"]


def _tensor_parallel(mesh, hidden: int = 16, blocks: int = 1) -> nn.Module:
    """``blocks`` blocks with ``up`` column-wise and ``down`` row-wise parallel."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(blocks)))
    for block in model:
        block.up, block.down = nn.Linear(8, hidden), nn.Linear(hidden, 8)
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model if blocks > 1 else model[0]


def _tp_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _train_replicated(model: nn.Module, loss_fn, steps: range, params: nn.Module | None = None) -> list[float]:
    """SGD steps where every rank sees the same batch, as tensor parallelism expects."""
    opt = torch.optim.SGD((params or model).parameters(), lr=0.1)
    losses = []
    for step in steps:
        loss = loss_fn(model, _batch(0, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


_RESIDUAL = 1.0  # read by _ScaledBlock.forward: a global the traced program must be guarded on


class _ScaledBlock(Block):
    def forward(self, x):
        return _RESIDUAL * x + self.down(torch.nn.functional.gelu(self.up(x)))


def _global_read(mesh, options: dict) -> tuple[list, int]:
    """A tensor parallel block whose forward reads a global, called before and after the global changes."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fulmen

    global _RESIDUAL
    block = parallelize_module(_ScaledBlock(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    jitted = fulmen.jit(block, **options)
    pairs = []
    try:
        for _RESIDUAL in (1.0, 3.0, 1.0):
            pairs.append((jitted(_batch(0, 7)), block(_batch(0, 7))))
    finally:
        _RESIDUAL = 1.0
    return pairs, fulmen.cache_misses(jitted)


class _Branching(Block):
    """Branches on a tensor's value, which a traced program cannot depend on."""

    def forward(self, x):
        return super().forward(x) if x.sum() > 0 else x


class _Renormed(nn.Module):
    """Reads its DTensor weight through ``renorm``, which DTensor has no sharding rule for."""

    def __init__(self, mesh):
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__()
        self.weight = nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)]))

    def forward(self, x):
        return x.sum() + self.weight.renorm(2, 0, 1.0).to_local().sum()


class _Counting(nn.Module):
    """Updates buffers in its forward (a call counter, batch norm's running statistics) around a sharded linear."""

    def __init__(self):
        super().__init__()
        self.norm, self.lin = nn.BatchNorm1d(8), nn.Linear(8, 16)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.lin(self.norm(x)) * self.calls


def _buffer_updates(mesh, options: dict) -> list[float]:
    """Differences from eager of the outputs, the buffers and a gradient over 3 training calls."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import fulmen

    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(parallelize_module(_Counting(), mesh, {"lin": ColwiseParallel()}))
    jitted, eager = fulmen.jit(models[0], **options), models[1]
    diffs = []
    for step in range(3):
        out, expected = jitted(_batch(0, step)), eager(_batch(0, step))
        out.sum().backward()
        expected.sum().backward()
        diffs.append((out - expected).abs().max().item())
    diffs += [(a - b).abs().max().item() for a, b in zip(models[0].buffers(), models[1].buffers())]
    diffs.append((models[0].lin.weight.grad.full_tensor() - eager.lin.weight.grad.full_tensor()).abs().max().item())
    return diffs


def _dtensor_in_and_out(mesh, options: dict) -> list[float]:
    """A DTensor argument (row-wise parallel taking a sharded input) and a DTensor result (column-wise parallel
    keeping its output sharded), with the gradient of a plain input through the latter: differences from eager."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fulmen

    torch.manual_seed(0)
    row = parallelize_module(nn.Linear(16, 8), mesh, RowwiseParallel(input_layouts=Shard(-1)))
    col = parallelize_module(nn.Linear(8, 16), mesh, ColwiseParallel(use_local_output=False))
    sharded = distribute_tensor(torch.randn(4, 16), mesh, [Shard(1)])
    diffs = [(fulmen.jit(row, **options)(sharded) - row(sharded)).abs().max().item()]
    x = _batch(0, 0).requires_grad_()
    out, expected = fulmen.jit(col, **options)(x), col(x)
    assert type(out) is type(expected) and out.placements == expected.placements
    (grad,) = torch.autograd.grad(out.full_tensor().tanh().sum(), x)
    (expected_grad,) = torch.autograd.grad(expected.full_tensor().tanh().sum(), x)
    return [
        *diffs,
        (out.full_tensor() - expected.full_tensor()).abs().max().item(),
        (grad - expected_grad).abs().max().item(),
    ]


def _tp_under_jit(mesh, options: dict) -> dict:
    """Tensor parallelism under fulmen.jit: two blocks (the second's input needs a gradient, so the backward
    all-reduces it), eager alongside in the same process; then eval without gradients, a global, and refusals."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fulmen

    out = {}
    for name, hidden in (("even", 16),):
        eager, net = _tensor_parallel(mesh, hidden, blocks=2), _tensor_parallel(mesh, hidden, blocks=2)
        jitted = fulmen.jit(net, **options)
        out[name] = _train_replicated(jitted, _tp_loss, range(3), params=net)
        out[name + "_eager"] = _train_replicated(eager, _tp_loss, range(3))
        out[name + "_params"], out[name + "_eager_params"] = _full_params(net), _full_params(eager)
        out[name + "_misses"] = fulmen.cache_misses(jitted)
        # the parameters and the state_dict stay the user's DTensors
        out[name + "_kinds"] = {type(net[0].up.weight).__name__, type(jitted.state_dict()["1.down.weight"]).__name__}
    out["forward"], out["backward"] = str(fulmen.last_traces(jitted)[-1]), str(fulmen.last_backward_traces(jitted)[-1])
    with torch.no_grad():  # eval without gradients: another program, traced once
        eager.eval(), jitted.eval()
        out["eval"] = [jitted(_batch(0, 9)), eager(_batch(0, 9))]
    out["eval_misses"] = fulmen.cache_misses(jitted)
    out["global"] = _global_read(mesh, options)
    out["in_and_out"] = _dtensor_in_and_out(mesh, options)
    out["buffers"] = _buffer_updates(mesh, options)
    try:
        fulmen.jit(_Renormed(mesh), **options)(_batch(0, 0))
    except NotImplementedError as e:
        out["no_rule"] = str(e)
    branching = parallelize_module(_Branching(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    try:
        fulmen.jit(branching, **options)(_batch(0, 0))
    except NotImplementedError as e:
        out["branch"] = str(e)
    return out


def _dtensor_programs(rank, world_size, mesh):
    import fulmen
    from fulmen.frontend import dynamo

    out = {}
    # tensor parallel under torch.compile(backend="fulmen"): the graph's DTensor part runs with PyTorch, its plain
    # part (the residual add after RowwiseParallel's to_local, the loss) compiles
    eager, compiled = _tensor_parallel(mesh), _tensor_parallel(mesh)
    torch._dynamo.reset()
    dynamo.reset_backend_stats()
    loss_fn = torch.compile(_tp_loss, backend="fulmen")
    out["eager"], out["compiled"] = (
        _train_replicated(eager, _tp_loss, range(3)),
        _train_replicated(compiled, loss_fn, range(3)),
    )
    out["eager_params"], out["compiled_params"] = _full_params(eager), _full_params(compiled)
    stats = dynamo.backend_stats()
    out["stats"] = (stats.graphs, stats.compilations, stats.eager_graphs)
    out["plain_parts"] = "".join(str(fulmen.last_traces(r.jitted)[0]) for r in dynamo._records.values())
    out["jit"] = _tp_under_jit(mesh, {"executors": ["torch"]})

    try:  # a DTensor made inside a jitted function: refused where it is made
        from torch.distributed.tensor import DTensor, Shard

        fulmen.jit(lambda x: DTensor.from_local(x, mesh, [Shard(0)]).full_tensor(), executors=["torch"])(_batch(0, 0))
    except NotImplementedError as e:
        out["made_inside"] = str(e)
    return out


def _calls(trace: str, op: str) -> int:
    """How many lines of the printed trace call ``op`` (not counting the comments that list a region's ops)."""
    return sum(op in line for line in trace.splitlines() if not line.lstrip().startswith("#"))


def _check_tp_under_jit(results: list[dict]) -> None:
    for out in results:
        for name in ("even",):
            torch.testing.assert_close(out[name], out[name + "_eager"], **TOL)
            _assert_params_close(out[name + "_params"], out[name + "_eager_params"])
            assert out[name + "_misses"] == 1  # traced once, then cache hits
            assert out[name + "_kinds"] == {"DTensor"}
        torch.testing.assert_close(out["eval"][0], out["eval"][1], **TOL)
        assert out["eval_misses"] == 2
        # the collectives are traced operations: RowwiseParallel's all-reduce of its partial output in the forward
        # (one per block), and in the backward the all-reduce of the gradient of the second block's replicated input
        assert _calls(out["forward"], "_c10d_functional.all_reduce(") == 2
        assert _calls(out["forward"], "_c10d_functional.wait_tensor(") == 2
        assert _calls(out["backward"], "_c10d_functional.all_reduce(") == 1
        # a global the forward reads is guarded: changing it traces again, and changing it back hits that program
        pairs, misses = out["global"]
        for jitted, eager in pairs:
            torch.testing.assert_close(jitted, eager, **TOL)
        assert misses == 2
        assert max(out["in_and_out"]) < 1e-5  # DTensor arguments and results, as eager's
        assert max(out["buffers"]) < 1e-5  # buffers updated in the forward, as eager updates them
        assert "_Branching" in out["branch"] and "needs a tensor's value" in out["branch"]
        assert "renorm" in out["no_rule"] and "_Renormed" in out["no_rule"] and "sharding" in out["no_rule"]
    for name in ("even",):
        torch.testing.assert_close(results[0][name], results[1][name], rtol=0, atol=0)
        _assert_params_close(results[0][name + "_params"], results[1][name + "_params"])


def _check_tensor_parallel_results(results: list[dict]) -> None:
    """Tensor parallel under torch.compile(backend="fulmen") and under fulmen.jit trains as eager."""
    for out in results:
        torch.testing.assert_close(out["compiled"], out["eager"], **TOL)
        _assert_params_close(out["compiled_params"], out["eager_params"])
        graphs, compilations, eager_graphs = out["stats"]
        assert graphs >= 1 and compilations == graphs and eager_graphs == 0  # the plain parts, compiled once each
        assert "ltorch.add" in out["plain_parts"] and "ltorch.mean" in out["plain_parts"]
        assert "DTensor" not in out["plain_parts"] and "redistribute" not in out["plain_parts"]
        assert "makes a DTensor" in out["made_inside"] and "fulmen.jit(model)" in out["made_inside"]
    torch.testing.assert_close(results[0]["compiled"], results[1]["compiled"], rtol=0, atol=0)
    _check_tp_under_jit([out["jit"] for out in results])
