"""FSDP2 over tensor parallelism (a 2 x 2 mesh: ``parallelize_module`` on "tp", then ``fully_shard`` on "dp") under
``fulmen.jit``, on 4 gloo ranks (CPU): training equal to eager 2-D's (SGD and AdamW), the ranks agreeing, the
gradients DTensors with eager's placements, the dp all-gathers and reduce-scatters and the tp all-reduces in the
printed traces; later calls that leave the traced FSDP state (``unshard()``, accumulation without gradient sync,
``fully_shard`` after ``fulmen.jit``) run eagerly and still match; a policy fulmen does not trace is refused.

The shards are uneven on purpose: each TP-local tensor has 5 rows, split 3 / 2 over dp (FSDP2 pads the short
chunk for the all-gather), and the head's one row leaves one dp rank's shard empty. (Uneven tensor parallelism
itself, a hidden width that tp does not divide, fails in eager: ``ColwiseParallel``'s output DTensor takes its
global shape from the local one.) Each spawn builds the eager reference and the jitted model from one seed
in the same process; the tolerances are float32 ones (the same operations in the same order as eager, up to the
association of a few sums).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

from fulmen.launch import run_on_ranks

TOL = dict(rtol=1e-5, atol=1e-6)


class Block(nn.Module):
    def __init__(self, width: int = 5, hidden: int = 10):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self, width: int = 5, depth: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)  # one row: one dp rank's shard holds it, the other's is empty

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _tensor_parallel(block: nn.Module, mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})


def _two_d(mesh, seed: int = 0, **fsdp) -> Net:
    """Each block tensor-parallel on "tp" and sharded on "dp", then the root sharded on "dp"."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    net = Net()
    for block in net.blocks:
        _tensor_parallel(block, mesh)
        fully_shard(block, mesh=mesh["dp"], **fsdp)
    fully_shard(net, mesh=mesh["dp"])
    return net


def _batch(rank: int, step: int) -> torch.Tensor:
    """The batch of ``rank``'s dp replica (the two tp ranks of a replica read the same batch)."""
    g = torch.Generator().manual_seed(100 * step + rank // 2)
    return torch.randn(4, 5, generator=g)


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _assert_params_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _grad_layouts(model: nn.Module) -> dict[str, tuple]:
    return {n: (type(p.grad).__name__, tuple(map(repr, p.grad.placements))) for n, p in model.named_parameters()}


def _steps(model, net, opt, rank: int, steps: range, out: dict | None = None, order: str = "") -> list[float]:
    """SGD or AdamW steps; ``out[order, "grads"]``: the gradients' types and placements after the first backward."""
    losses = []
    for step in steps:
        loss = model(_batch(rank, step))
        loss.backward()
        if out is not None:
            out.setdefault((order, "grads"), _grad_layouts(net))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _optimizer(name: str, net: nn.Module):
    return torch.optim.SGD(net.parameters(), lr=0.1) if name == "sgd" else torch.optim.AdamW(net.parameters(), lr=0.01)


def _train(rank, world_size, options):
    import fulmen

    mesh = _mesh()
    out = {"groups": (mesh["dp"].get_group().group_name, mesh["tp"].get_group().group_name), "dp_rank": rank // 2}
    for optimizer in ("sgd", "adamw"):
        for order in ("eager", "jit"):
            net = _two_d(mesh)
            model = fulmen.jit(net, **options) if order == "jit" else net
            out[optimizer, order] = _steps(model, net, _optimizer(optimizer, net), rank, range(3), out, order)
            out[optimizer, order, "params"] = _full_params(net)
            if order == "jit" and optimizer == "sgd":
                out["forward"] = str(fulmen.last_traces(model)[-1])
                out["backward"] = str(fulmen.last_backward_traces(model)[-1])
                out["misses"] = fulmen.cache_misses(model)
                out["saved"] = _saved_shapes(model(_batch(rank, 5)))
    return out


def _saved_shapes(out: torch.Tensor) -> set[tuple[int, ...]]:
    """The shapes of the tensors the autograd nodes on ``out``'s history keep for the backward."""
    shapes, stack, seen = set(), [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        shapes |= {tuple(t.shape) for t in getattr(node, "saved_tensors", ()) if isinstance(t, torch.Tensor)}
        stack += [n for n, _ in node.next_functions]
    return shapes


def _collectives(trace: str) -> list[tuple[str, str, str]]:
    """(op, reduction or "", group name) of each collective the trace calls, in order."""
    found = []
    for line in trace.splitlines():
        m = re.search(r"_c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor|all_reduce)\((.*)\)", line)
        if m and not line.lstrip().startswith("#"):
            args = m.group(2)
            reduction = re.search(r"'(sum|avg)'", args)
            found.append((m.group(1), reduction.group(1) if reduction else "", re.findall(r"'([^']*)'", args)[-1]))
    return found


def _check_training(results: list[dict]) -> None:
    for out in results:
        dp, tp = out["groups"]
        for optimizer in ("sgd", "adamw"):
            torch.testing.assert_close(out[optimizer, "jit"], out[optimizer, "eager"], **TOL)
            _assert_params_close(out[optimizer, "jit", "params"], out[optimizer, "eager", "params"])
        # param.grad as eager 2-D leaves it: a DTensor on the (dp, tp) mesh, e.g. (_StridedShard(0), Shard(0))
        assert out["jit", "grads"] == out["eager", "grads"]
        assert set(out["jit", "grads"].values()) >= {("DTensor", ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"))}
        forward, backward = _collectives(out["forward"]), _collectives(out["backward"])
        # one dp all-gather per unit (the root's head, then each block's four parameters in one buffer) and one tp
        # all-reduce per row-wise linear; the backward reduce-scatters each unit's gradients averaged over dp, and
        # all-reduces over tp the second block's input gradient (the first block's input needs none)
        assert [c for c in forward if c[2] == dp] == [("all_gather_into_tensor", "", dp)] * 3
        assert [c for c in forward if c[2] == tp] == [("all_reduce", "sum", tp)] * 2
        # the backward gathers each unit's parameters again rather than saving them from the forward (FSDP2
        # reshards after forward): the forward saves no gathered TP-local weight (5 x 5) or the head's (1 x 5)
        backward_dp = [c for c in backward if c[2] == dp]
        assert (
            sorted(backward_dp) == [("all_gather_into_tensor", "", dp)] * 3 + [("reduce_scatter_tensor", "avg", dp)] * 3
        )
        gathered = {(5, 5), (5, 1)} | ({(1, 5)} if out["dp_rank"] else set())  # dp rank 0's head shard is 1 x 5
        assert not gathered & out["saved"], out["saved"]
        assert [c for c in backward if c[2] == tp] == [("all_reduce", "sum", tp)]
        assert out["misses"] == 1
    for optimizer in ("sgd", "adamw"):  # every rank holds the same parameters, the dp replicas trained on others
        for out in results[1:]:
            _assert_params_close(out[optimizer, "jit", "params"], results[0][optimizer, "jit", "params"])
    assert results[0]["sgd", "eager"] != results[2]["sgd", "eager"]


@pytest.mark.slow  # 4 spawned ranks
@pytest.mark.parametrize("options", [{"executors": ["torch"]}, {"compile": "sync"}], ids=["torch", "fusion"])
def test_fsdp2_over_tensor_parallel_matches_eager(options):
    _check_training(run_on_ranks(_train, options, world_size=4, timeout=500))


def _later_calls(model, net, rank: int) -> list[float]:
    """Two SGD steps, calls under no_grad and in eval mode, one while FSDP holds the parameters unsharded, two
    micro-batches accumulated without gradient sync and a step, then a step on the traced program again."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = _steps(model, net, opt, rank, range(2))
    with torch.no_grad():
        losses.append(model(_batch(rank, 7)).item())
    net.eval()
    losses.append(model(_batch(rank, 8)).item())
    net.train()
    net.unshard()
    losses.append(model(_batch(rank, 6)).item())
    net.reshard()
    net.set_requires_gradient_sync(False)
    model(_batch(rank, 10)).backward()
    net.set_requires_gradient_sync(True)
    losses += _steps(model, net, opt, rank, range(11, 13))
    return losses


def _mixed(mesh) -> Net:
    """The first block tensor-parallel only, the second sharded on "dp" only; the root and head neither."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = Net()
    _tensor_parallel(net.blocks[0], mesh)
    fully_shard(net.blocks[1], mesh=mesh["dp"])
    return net


def _sharded_after_jit(model, net, rank: int, mesh) -> list[float]:
    """A step, then ``fully_shard`` on the head (a new FSDP2 unit the program was not traced with), two steps."""
    from torch.distributed.fsdp import fully_shard

    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = _steps(model, net, opt, rank, range(1))
    fully_shard(net.head, mesh=mesh["dp"])
    return losses + _steps(model, net, opt, rank, range(1, 3))


def _refusal(mesh, **fsdp) -> str | None:
    import fulmen

    try:
        fulmen.jit(_two_d(mesh, **fsdp))
    except NotImplementedError as e:
        return str(e)
    return None


def _later(rank, world_size):
    import fulmen

    mesh = _mesh()
    out = {}
    for order in ("eager", "jit"):
        models = {"later": _two_d(mesh), "mixed": _mixed(mesh), "after_jit": _mixed(mesh)}
        jitted = {k: fulmen.jit(m, executors=["torch"]) if order == "jit" else m for k, m in models.items()}
        out["later", order] = _later_calls(jitted["later"], models["later"], rank)
        out["mixed", order] = _steps(
            jitted["mixed"], models["mixed"], _optimizer("sgd", models["mixed"]), rank, range(3)
        )
        out["after_jit", order] = _sharded_after_jit(jitted["after_jit"], models["after_jit"], rank, mesh)
        for name, net in models.items():
            out[name, order, "params"] = _full_params(net)
        if order == "jit":
            out["hits"] = fulmen.cache_hits(jitted["later"])
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # float16 gradients: FSDP2 divides before and after the reduction, which the program does not trace
    out["refused"] = _refusal(mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float16))
    return out


@pytest.mark.slow  # 4 spawned ranks
def test_fsdp2_over_tensor_parallel_later_calls_match_eager():
    """Calls outside the traced FSDP state run through FSDP's hooks, and the program is used again after; a model
    with tensor parallelism and FSDP2 on different blocks is traced too; a policy fulmen does not trace (mixed
    precision reducing in float16) is refused naming both wrappers, the option and what works."""
    for out in run_on_ranks(_later, world_size=4, timeout=500):
        for name in ("later", "mixed", "after_jit"):
            torch.testing.assert_close(out[name, "jit"], out[name, "eager"], **TOL)
            _assert_params_close(out[name, "jit", "params"], out[name, "eager", "params"])
        assert out["hits"] >= 2  # the steps before the eager calls and the last one ran the traced program
        message = out["refused"]
        assert message is not None and "fully_shard" in message and "parallelize_module" in message
        assert "reduced in torch.float16" in message and "reduce_dtype" in message and 'mesh["dp"]' in message


def test_fsdp2_gathers_are_tagged_for_recomputation():
    """In a joint graph, each all-gather over dp, what builds its input from the shards and the views (and
    reshape copies) that take the parameters out of it are tagged to be recomputed in the backward; the
    computation reading the parameters and the collectives over other groups are not."""
    import operator

    from torch.utils.checkpoint import CheckpointPolicy

    from fulmen.frontend.fsdp2_2d import _recompute_gathers

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    g = torch.fx.Graph()
    x = g.placeholder("x")
    expected, parameters = [], []
    for unit in range(2):  # two units: each one's chain is tagged
        shards = [g.placeholder(f"shard_{unit}_{i}") for i in range(2)]
        flat = [g.call_function(aten.view.default, (s, [-1])) for s in shards]
        cat = g.call_function(aten.cat.default, (flat,))
        gather = g.call_function(c10d.all_gather_into_tensor.default, (cat, 2, "dp"))
        wait = g.call_function(c10d.wait_tensor.default, (gather,))
        rows = g.call_function(aten.view.default, (wait, [2, 8]))
        pieces = g.call_function(aten.split_with_sizes.default, (rows, [4, 4], 1))
        piece = g.call_function(operator.getitem, (pieces, 0))
        copy = g.call_function(aten.clone.default, (piece,))
        weight = g.call_function(aten._unsafe_view.default, (copy, [4, 2]))
        transposed = g.call_function(aten.t.default, (weight,))
        expected += [*flat, cat, gather, wait, rows, pieces, piece, copy, weight, transposed]
        parameters.append(transposed)
    mm = g.call_function(aten.mm.default, (x, parameters[0]))
    reduced = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce.default, (mm, "sum", "tp")),))
    other = g.call_function(c10d.all_gather_into_tensor.default, (reduced, 2, "tp"))
    g.output((g.call_function(aten.mm.default, (other, parameters[1])),))
    _recompute_gathers(g, {"dp"})
    tagged = [n for n in g.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE]
    assert set(tagged) == set(expected), [n.name for n in tagged]


def _two_d_policy(mesh, policy: str) -> Net:
    """``_two_d`` with a policy other than FSDP2's defaults: the blocks kept gathered after forward, or mixed
    precision (bfloat16 parameters and computation, float32 gradient reduction) on every unit, as FSDP2 needs it
    on the root too (the head reads the blocks' bfloat16 outputs), the root's output cast to float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if policy == "no_reshard":
        return _two_d(mesh, reshard_after_forward=False)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    net = Net()
    for block in net.blocks:
        _tensor_parallel(block, mesh)
        fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
    root = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    fully_shard(net, mesh=mesh["dp"], mp_policy=root)  # the loss comes out in float32
    return net


def _policies(rank, world_size):
    import fulmen

    mesh = _mesh()
    out = {"dp": mesh["dp"].get_group().group_name}
    for policy in ("no_reshard", "mixed"):
        for order in ("eager", "jit"):
            net = _two_d_policy(mesh, policy)
            model = fulmen.jit(net, executors=["torch"]) if order == "jit" else net
            out[policy, order] = _steps(model, net, _optimizer("sgd", net), rank, range(3), out, f"{policy}{order}")
            out[policy, order, "params"] = _full_params(net)
            if order == "jit":  # the training program's traces, before the call under no_grad traces another
                out[policy, "backward"] = str(fulmen.last_backward_traces(model)[-1])
                out[policy, "forward"] = str(fulmen.last_traces(model)[-1])
            with torch.no_grad():
                out[policy, order, "dtype"] = model(_batch(rank, 9)).dtype
    return out


@pytest.mark.slow  # 4 spawned ranks
def test_fsdp2_over_tensor_parallel_traces_no_reshard_and_mixed_precision():
    """``reshard_after_forward=False`` and ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on a
    2-D model train as in eager 2-D (the same operations in the same dtypes: float32 tolerances on the float32
    parameters); kept units are not gathered again in the backward; with mixed precision, the all-gathers carry
    bfloat16 and the reduce-scatters float32, and the gradients keep eager's placements."""
    for out in run_on_ranks(_policies, world_size=4, timeout=500):
        dp = out["dp"]
        for policy in ("no_reshard", "mixed"):
            torch.testing.assert_close(out[policy, "jit"], out[policy, "eager"], **TOL)
            _assert_params_close(out[policy, "jit", "params"], out[policy, "eager", "params"])
            assert out[f"{policy}jit", "grads"] == out[f"{policy}eager", "grads"]
            assert out[policy, "jit", "dtype"] == out[policy, "eager", "dtype"] == torch.float32
        # the blocks' parameters are read from the forward: only the root's head is gathered again
        gathers = [c for c in _collectives(out["no_reshard", "backward"]) if c[0] == "all_gather_into_tensor"]
        assert gathers == [("all_gather_into_tensor", "", dp)], gathers
        forward, backward = out["mixed", "forward"], out["mixed", "backward"]
        assert re.search(r"all_gather_into_tensor\(.*\)\s+# \w+: \"cpu bf16", forward), forward
        assert re.search(r"reduce_scatter_tensor\(.*\)\s+# \w+: \"cpu f32", backward), backward
