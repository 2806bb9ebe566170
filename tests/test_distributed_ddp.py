"""DDP and FSDP1 with fulmen.jit, both wrapping orders, on 2 gloo CPU ranks: losses, gradients and parameters after
a few SGD steps equal distributed eager's, and the ranks agree.

Every check runs in one spawned 2-rank run (a spawn costs seconds of torch import per rank); the tests read its
results. Each rank trains on its own batches, so only a real all-reduce makes the ranks' parameters equal.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fulmen
from fulmen.bench.models import build
from fulmen.launch import run_on_ranks

STEPS = 3
# DDP setups: (name, how the model is wrapped, fulmen's compile mode)
DDP_SETUPS = [
    ("jit(DDP) off", "jit_outside", "off"),
    ("DDP(jit) off", "jit_inside", "off"),
    ("jit(DDP) sync", "jit_outside", "sync"),
    ("jit(DDP find_unused_parameters) off", "jit_outside_find_unused", "off"),
]


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + 10 * rank + step)
    return torch.randint(0, 128, (2, 16), generator=gen), torch.randint(0, 128, (2, 16), generator=gen)


def _loss(model, rank: int, step: int) -> torch.Tensor:
    return model(*_batch(rank, step))[1]


def _train_ddp(rank: int, wrapping: str, compile_mode: str) -> dict:
    """A no_sync() accumulation step, then plain DDP steps; the local gradients seen inside no_sync are kept."""
    model, _ = build("gpt-tiny")
    if wrapping == "eager":
        m = DDP(model)
    elif wrapping.startswith("jit_outside"):
        # find_unused_parameters: DDP's post-forward walks the autograd graph from the compiled program's outputs
        m = fulmen.jit(DDP(model, find_unused_parameters=wrapping.endswith("find_unused")), compile=compile_mode)
    else:
        m = DDP(fulmen.jit(model, compile=compile_mode))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    with m.no_sync():
        loss = _loss(m, rank, 0)
        loss.backward()
    local_grads = [p.grad.clone() for p in model.parameters()]
    losses.append(loss.item())
    for step in range(1, STEPS + 1):
        loss = _loss(m, rank, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = [p.detach().clone() for p in model.parameters()]
    return {"losses": losses, "local_grads": local_grads, "params": params}


def _train_fsdp1(rank: int, jit_inside: bool) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model, _ = build("gpt-tiny")
    inner = fulmen.jit(model, compile="off") if jit_inside else model
    m = FSDP(inner, use_orig_params=True, device_id=torch.device("cpu"))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        loss = _loss(m, rank, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with FSDP.summon_full_params(m):
        params = [p.detach().clone() for p in m.parameters()]
    return {"losses": losses, "params": params}


def _error_of(fn) -> str:
    try:
        fn()
    except NotImplementedError as e:
        return str(e)
    return "no error"


def _refusals() -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def fsdp1_outside():
        fulmen.jit(FSDP(build("gpt-tiny")[0], use_orig_params=True, device_id=torch.device("cpu")))

    def ddp_nested():
        outer = torch.nn.Sequential(DDP(torch.nn.Linear(4, 4)))
        fulmen.jit(outer, compile="off")(torch.randn(2, 4))

    return {"fsdp1_outside": _error_of(fsdp1_outside), "ddp_nested": _error_of(ddp_nested)}


def _all_checks(rank: int, world_size: int) -> dict:
    out = {"ddp eager": _train_ddp(rank, "eager", "off")}
    for name, wrapping, compile_mode in DDP_SETUPS:
        out[name] = _train_ddp(rank, wrapping, compile_mode)
    out["fsdp1 eager"] = _train_fsdp1(rank, jit_inside=False)
    out["FSDP1(jit)"] = _train_fsdp1(rank, jit_inside=True)
    dist.barrier()
    out["refusals"] = _refusals()
    out["dynamo eager"] = _several_dynamo_ddp_models(rank, world_size, False)
    out["dynamo fulmen"] = _several_dynamo_ddp_models(rank, world_size, True)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_all_checks, timeout=600)


def _close(actual, expected, tol):
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, **tol)


OFF_TOL = {"rtol": 1e-5, "atol": 1e-6}  # the same float32 ops, summed in another order
SYNC_TOL = {"rtol": 1e-4, "atol": 1e-5}  # fused kernels reassociate the reductions


@pytest.mark.parametrize("name", [s[0] for s in DDP_SETUPS])
def test_ddp_matches_distributed_eager_and_ranks_agree(ranks, name):
    tol = SYNC_TOL if name.endswith("sync") else OFF_TOL
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r[name]["losses"]), torch.tensor(r["ddp eager"]["losses"]), **tol)
        _close(r[name]["params"], r["ddp eager"]["params"], tol)
    # each rank trained on its own batches: equal parameters mean the gradients were all-reduced on every step
    _close(ranks[0][name]["params"], ranks[1][name]["params"], {"rtol": 0, "atol": 0})


@pytest.mark.parametrize("name", [s[0] for s in DDP_SETUPS])
def test_no_sync_accumulates_local_gradients(ranks, name):
    tol = SYNC_TOL if name.endswith("sync") else OFF_TOL
    for r in ranks:
        _close(r[name]["local_grads"], r["ddp eager"]["local_grads"], tol)
    # under no_sync each rank keeps its own gradient
    assert not torch.allclose(ranks[0][name]["local_grads"][0], ranks[1][name]["local_grads"][0])


def test_fsdp1_around_jit_matches_eager_fsdp1(ranks):
    for r in ranks:
        torch.testing.assert_close(
            torch.tensor(r["FSDP1(jit)"]["losses"]), torch.tensor(r["fsdp1 eager"]["losses"]), **OFF_TOL
        )
        _close(r["FSDP1(jit)"]["params"], r["fsdp1 eager"]["params"], OFF_TOL)
    _close(ranks[0]["FSDP1(jit)"]["params"], ranks[1]["FSDP1(jit)"]["params"], {"rtol": 0, "atol": 0})


def test_jit_of_fsdp1_is_refused_naming_the_order_that_works(ranks):
    message = ranks[0]["refusals"]["fsdp1_outside"]
    assert "fulmen.jit(FullyShardedDataParallel(model))" in message
    assert "FullyShardedDataParallel(fulmen.jit(model), use_orig_params=True)" in message


def test_a_ddp_inside_a_traced_module_is_refused(ranks):
    message = ranks[0]["refusals"]["ddp_nested"]
    assert "DistributedDataParallel" in message and "fulmen.jit(DDP(model))" in message


DYNAMO_MODELS = ("gpt-tiny", "mlp-tiny", "llama-tiny")


def _dynamo_step(model, inputs):
    out = model(*inputs)
    loss = out[1] if isinstance(out, tuple) else nn.functional.mse_loss(out, inputs[1])
    loss.backward()
    return loss


def _several_dynamo_ddp_models(rank: int, world_size: int, compiled: bool) -> dict:
    """Several models, each torch.compile(DDP(model), backend="fulmen") in one process, trained in rounds while
    fulmen's background compiler lowers their regions (the default "async" mode)."""
    models, opts, inputs = [], [], []
    for name in DYNAMO_MODELS:
        model, make_inputs = build(name)
        wrapped = DDP(model)
        if compiled:
            wrapped = torch.compile(wrapped, backend="fulmen", options={"compile": "async"})
        models.append(wrapped)
        opts.append(torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = make_inputs(2, targets=True)
        inputs.append(((x + rank) % 8 if x.dtype == torch.long else x + rank, y))  # each rank its own batch
    losses = [[] for _ in DYNAMO_MODELS]
    for _ in range(3):
        for i, model in enumerate(models):
            losses[i].append(_dynamo_step(model, inputs[i]).item())
            opts[i].step()
            opts[i].zero_grad()
    return {"losses": losses, "params": [[p.detach().clone() for p in m.parameters()] for m in models]}


def test_several_dynamo_ddp_models_in_one_process_match_eager(ranks):
    """Training steps run while fulmen's background compiler lowers regions: on a rank where one met an FX trace of
    Inductor's, Dynamo refused to run the compiled model and the other rank was left in a collective."""
    for r in ranks:
        for got, expected in zip(r["dynamo fulmen"]["losses"], r["dynamo eager"]["losses"], strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), **SYNC_TOL)
        for got, expected in zip(r["dynamo fulmen"]["params"], r["dynamo eager"]["params"], strict=True):
            _close(got, expected, SYNC_TOL)
    for rank0, rank1 in zip(ranks[0]["dynamo fulmen"]["params"], ranks[1]["dynamo fulmen"]["params"], strict=True):
        _close(rank0, rank1, {"rtol": 0, "atol": 0})


@pytest.mark.slow  # a spawned 2-rank run (tens of seconds on a loaded machine)
def test_bench_distributed_mode_runs_at_toy_size():
    from fulmen.bench.distributed import DistConfig, format_distributed_table, run_distributed

    config = DistConfig(model="gpt-tiny", wrappers=("ddp", "fsdp2"), backends=("eager", "fulmen"), steps=1, warmup=0)
    rows = run_distributed(config)
    assert [(r.wrapper, r.backend) for r in rows] == [
        ("ddp", "eager"),
        ("ddp", "fulmen"),
        ("fsdp2", "eager"),
        ("fsdp2", "fulmen"),
    ]
    for r in rows[:3]:  # a row that fails shows its error; these must not fail
        assert r.error is None and len(r.step_ms) == 2 and all(t > 0 for t in r.step_ms) and len(r.peak_mb) == 2
    # the same seeded model, batches and steps: fulmen's loss is eager's
    assert rows[1].loss == pytest.approx(rows[0].loss, rel=1e-5)
    table = format_distributed_table(rows)
    assert all(r.wrapper in table for r in rows)
    assert rows[3].error is not None or rows[3].loss == pytest.approx(rows[2].loss, rel=1e-5)


@pytest.mark.parametrize("argv", [["--model", "mlp-tiny"], ["--backends", "torch.compile-fulmen"]])
def test_bench_distributed_refuses_what_it_cannot_run(argv, capsys):
    from fulmen.bench import cli

    assert cli.main(["bench", "--mode", "distributed", *argv]) == 2
    assert "cannot run" in capsys.readouterr().err
