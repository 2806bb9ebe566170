"""Checkpointing: torch.utils.checkpoint regions recomputed in the backward, selective checkpointing policies, and
torch.distributed.checkpoint round trips of jitted models."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)

import fulmen
from fulmen.bench.memory import saved_tensors


def saved_bytes(out: torch.Tensor, exclude=()) -> int:
    """Bytes of the distinct storages fulmen saved for ``out``'s backward, less those of ``exclude`` (parameters
    and inputs, which the caller keeps alive anyway)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved_tensors(out)}
    return sum(n for ptr, n in storages.items() if ptr not in skip)


def _block(x, w1, w2):
    return torch.tanh(x @ w1).sin() @ w2


def _two_blocks(x, w1, w2, use_reentrant):
    h = checkpoint(_block, x, w1, w2, use_reentrant=use_reentrant)
    return checkpoint(_block, h, w1, w2, use_reentrant=use_reentrant).sum()


def _two_blocks_plain(x, w1, w2, use_reentrant):
    return _block(_block(x, w1, w2), w1, w2).sum()


def _run(fn, *args):
    """(loss, gradients, activation bytes saved) of a jitted ``fn``'s second call (its cached program)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    jf = fulmen.jit(fn, executors=["torch"])
    jf(*args).backward()
    for a in tensors:
        a.grad = None
    loss = jf(*args)
    nbytes = saved_bytes(loss, exclude=tensors)
    grads = torch.autograd.grad(loss, [a for a in tensors if a.requires_grad])
    return loss, grads, nbytes


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointed_regions_save_only_what_enters_them(use_reentrant):
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    loss, grads, nbytes = _run(_two_blocks, x, w1, w2, use_reentrant)
    _, _, plain_bytes = _run(_two_blocks_plain, x, w1, w2, use_reentrant)
    eager = _two_blocks_plain(x, w1, w2, use_reentrant)
    expected = torch.autograd.grad(eager, [w1, w2])
    torch.testing.assert_close(loss, eager)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e)
    # without checkpointing: each block's tanh output and the first block's result ([16, 8] f32 each);
    # with it, only the first block's result, which the second region reads
    assert plain_bytes == 3 * 16 * 8 * 4
    assert nbytes == 16 * 8 * 4


def test_checkpointed_gradients_match_finite_differences():
    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    jf = fulmen.jit(lambda x, w1, w2: _two_blocks(x, w1, w2, False), executors=["torch"])
    assert torch.autograd.gradcheck(jf, (x, w1, w2))


def _mlp(width: int = 8, depth: int = 4) -> nn.Sequential:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


class _Sequential(nn.Module):
    def __init__(self, segments: int | None):
        super().__init__()
        self.body = _mlp()
        self.segments = segments

    def forward(self, x):
        if self.segments is None:
            return self.body(x)
        return checkpoint_sequential(self.body, self.segments, x, use_reentrant=False)


def test_checkpoint_sequential_in_a_jitted_module():
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    results = {}
    for segments in (None, 2):
        torch.manual_seed(1)
        model = _Sequential(segments)
        jm = fulmen.jit(model, executors=["torch"])
        jm(x).sum().backward()
        model.zero_grad()
        out = jm(x).sum()
        results[segments] = saved_bytes(out, exclude=[x, *model.parameters()])
        out.backward()
        torch.manual_seed(1)
        eager = _Sequential(None)
        eager(x).sum().backward()
        for p, e in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, e.grad)
    # checkpoint_sequential leaves its last segment unchekpointed: the first two layer pairs save only their input
    # (x itself) and the output of the first segment; without it every layer's input and GELU input is saved
    assert results[2] < results[None]


def _dropout_block(x, w):
    return F.dropout(torch.tanh(x @ w), p=0.5, training=True) @ w


def _dropout_program(x, w):
    return checkpoint(_dropout_block, x, w, use_reentrant=False).sum()


def test_random_numbers_in_a_checkpointed_region_are_eagers():
    torch.manual_seed(0)
    x, w = torch.randn(16, 8), torch.randn(8, 8, requires_grad=True)
    jf = fulmen.jit(_dropout_program, executors=["torch"])
    jf(x, w).backward()
    w.grad = None
    torch.manual_seed(123)
    loss = jf(x, w)
    loss.backward()
    got = w.grad
    w.grad = None
    torch.manual_seed(123)
    eager = _dropout_program(x, w)  # eager checkpoint restores the RNG state for its recomputation
    eager.backward()
    torch.testing.assert_close(loss, eager)
    torch.testing.assert_close(got, w.grad)


def _two_dropouts(x, w):
    h = F.dropout(torch.tanh(x @ w), p=0.3, training=True)
    return F.dropout(h.sin(), p=0.6, training=True) @ w


def test_random_draws_in_a_region_are_drawn_again_from_the_forwards_generator_state():
    def program(x, w):
        return checkpoint(_two_dropouts, x, w, use_reentrant=False).sum()

    torch.manual_seed(0)
    x, w = torch.randn(16, 8), torch.randn(8, 8, requires_grad=True)
    jf = fulmen.jit(program, executors=["torch"])
    jf(x, w)
    torch.manual_seed(5)
    loss = jf(x, w)
    # the masks are not kept: two generator states (uint8) are, and no float tensor but the inputs
    kept = saved_tensors(loss)
    assert [t.dtype for t in kept if t.dtype != torch.float32] == [torch.uint8, torch.uint8]
    assert saved_bytes(loss, exclude=[x, w]) == 2 * torch.get_rng_state().numel()
    (grad,) = torch.autograd.grad(loss, [w])
    after = torch.rand(3)  # the backward's draws leave the generator where the forward left it, as eager's
    torch.manual_seed(5)
    eager = program(x, w)
    (expected,) = torch.autograd.grad(eager, [w])
    torch.testing.assert_close(loss, eager)
    torch.testing.assert_close(grad, expected)
    torch.testing.assert_close(after, torch.rand(3), rtol=0, atol=0)


def _selective(policy):
    def program(x, w1, w2):
        return checkpoint(
            _block,
            x,
            w1,
            w2,
            use_reentrant=False,
            context_fn=functools.partial(create_selective_checkpoint_contexts, policy),
        ).sum()

    return program


def _save_mm(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize(
    "policy, saved",
    [
        (_save_mm, 16 * 8 * 4),  # x @ w1 saved, tanh and sin recomputed from it
        ([torch.ops.aten.mm.default], 16 * 8 * 4),
        ([], 0),  # everything recomputed from the region's inputs
        ([torch.ops.aten.tanh.default], 16 * 8 * 4),  # tanh's output saved, sin's recomputed from it
    ],
)
def test_selective_checkpointing_policies_choose_what_is_saved(policy, saved):
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    loss, grads, nbytes = _run(_selective(policy), x, w1, w2)
    eager = _block(x, w1, w2).sum()
    torch.testing.assert_close(loss, eager)
    for g, e in zip(grads, torch.autograd.grad(eager, [w1, w2])):
        torch.testing.assert_close(g, e)
    assert nbytes == saved


def test_selective_policy_decides_which_value_is_saved():
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    jf = fulmen.jit(_selective([torch.ops.aten.tanh.default]), executors=["torch"])
    jf(x, w1, w2)
    saved = fulmen.last_traces(jf)[-1].output[1:]
    assert [p.name for p in saved if p.name not in ("x", "w1", "w2")] == ["t1"]  # t0 = x @ w1, t1 = tanh(t0)


def test_other_context_fn_is_refused():
    import contextlib

    def program(x, w):
        return checkpoint(
            torch.sin,
            x @ w,
            use_reentrant=False,
            context_fn=lambda: (contextlib.nullcontext(), contextlib.nullcontext()),
        ).sum()

    with pytest.raises(NotImplementedError, match="create_selective_checkpoint_contexts"):
        fulmen.jit(program, executors=["torch"])(torch.randn(2, 2), torch.randn(2, 2, requires_grad=True))


def _gpt(checkpointed: bool, use_reentrant: bool = False):
    from fulmen.bench.models import GPT, GPTConfig, checkpoint_blocks

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16, dropout=0.1))
    return checkpoint_blocks(model, use_reentrant) if checkpointed else model


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointed_gpt_blocks_with_dropout_match_eager_and_save_less(use_reentrant):
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    saved = {}
    for checkpointed in (False, True):
        model = _gpt(checkpointed, use_reentrant)
        jitted = fulmen.jit(model, executors=["torch"])
        jitted(idx, targets)[1].backward()
        model.zero_grad()
        torch.manual_seed(7)
        loss = jitted(idx, targets)[1]
        saved[checkpointed] = saved_bytes(loss, exclude=[idx, targets, *model.parameters()])
        loss.backward()
        eager = _gpt(checkpointed, use_reentrant)
        torch.manual_seed(7)
        eager_loss = eager(idx, targets)[1]
        eager_loss.backward()  # eager's checkpoint recomputes the blocks with the forward's random numbers
        torch.testing.assert_close(loss, eager_loss)
        for (name, p), e in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, e.grad, msg=name)
    assert saved[True] < saved[False] / 2


def test_checkpointed_regions_with_fusion():
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    jf = fulmen.jit(_two_blocks, compile="sync")
    jf(x, w1, w2, False)
    loss = jf(x, w1, w2, False)
    assert saved_bytes(loss, exclude=[x, w1, w2]) == 16 * 8 * 4
    expected = torch.autograd.grad(_two_blocks_plain(x, w1, w2, False), [w1, w2])
    for g, e in zip(torch.autograd.grad(loss, [w1, w2]), expected):
        torch.testing.assert_close(g, e)


# ---------------------------------------------------------------------------------------------------------
# torch.distributed.checkpoint: save and load a jitted model and its optimizer


def _dcp_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _train(model, opt, batches) -> list[torch.Tensor]:
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _dcp_round_trip(rank: int, world_size: int, path: str, ddp: bool):
    """Train two steps, save with DCP, train two more (the uninterrupted run); load the checkpoint into another
    jitted model and optimizer (built from other weights, already stepped) and train the same two steps. Returns
    what the test compares."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.nn.parallel import DistributedDataParallel as DDP

    def build(seed):
        model = fulmen.jit(_dcp_model(seed), executors=["torch"])
        model = DDP(model) if ddp else model
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(4)]
    model, opt = build(0)
    _train(model, opt, batches[:2])
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    saved = {k: v.detach().clone() for k, v in state["model"].items()}
    dcp.save(state, checkpoint_id=path)
    expected_losses = _train(model, opt, batches[2:])
    expected = [p.detach().clone() for p in model.parameters()]

    fresh, fresh_opt = build(1)
    _train(fresh, fresh_opt, batches[:1])  # compiled, with optimizer state, before the checkpoint is loaded into it
    state = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(fresh, state["model"])
    set_optimizer_state_dict(fresh, fresh_opt, state["optim"])
    loaded = {k: v.detach().clone() for k, v in get_model_state_dict(fresh).items()}
    losses = _train(fresh, fresh_opt, batches[2:])
    return saved, loaded, expected_losses, losses, expected, [p.detach().clone() for p in fresh.parameters()]


def _check_round_trip(saved, loaded, expected_losses, losses, expected, params):
    assert list(saved) == ["0.weight", "0.bias", "2.weight", "2.bias"]  # the original module's names
    assert list(loaded) == list(saved)
    for k in saved:
        torch.testing.assert_close(loaded[k], saved[k], rtol=0, atol=0)
    # the same program on the same values: the resumed steps are the uninterrupted ones, bit for bit
    torch.testing.assert_close(losses, expected_losses, rtol=0, atol=0)
    torch.testing.assert_close(params, expected, rtol=0, atol=0)


def test_dcp_round_trip_of_a_jitted_model_and_optimizer(tmp_path):
    _check_round_trip(*_dcp_round_trip(0, 1, str(tmp_path / "ckpt"), False))


def test_dcp_round_trip_of_ddp_over_a_jitted_model_on_two_ranks(tmp_path):
    from fulmen.launch import run_on_ranks

    results = run_on_ranks(_dcp_round_trip, str(tmp_path / "ckpt"), True, timeout=240)
    for result in results:
        _check_round_trip(*result)
    (_, _, _, _, _, params0), (_, _, _, _, _, params1) = results
    torch.testing.assert_close(params0, params1, rtol=0, atol=0)  # the ranks agree


def test_random_numbers_without_preserved_rng_state_are_refused():
    def program(x, w):
        return checkpoint(_dropout_block, x, w, use_reentrant=False, preserve_rng_state=False).sum()

    with pytest.raises(NotImplementedError, match="preserve_rng_state=True"):
        fulmen.jit(program, executors=["torch"])(torch.randn(4, 8), torch.randn(8, 8, requires_grad=True))


def test_a_checkpointed_region_without_random_numbers_may_skip_the_rng_state():
    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)

    def program(x, w):
        return checkpoint(_block, x, w, w, use_reentrant=True, preserve_rng_state=False).sum()

    loss = fulmen.jit(program, executors=["torch"])(x, w)
    torch.testing.assert_close(loss, _block(x, w, w).sum())


def test_checkpointed_regions_under_the_dynamo_backend():
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    compiled = torch.compile(_two_blocks, backend="fulmen")
    compiled(x, w1, w2, False).backward()
    loss = compiled(x, w1, w2, False)
    assert saved_bytes(loss, exclude=[x, w1, w2]) == 16 * 8 * 4
    expected = torch.autograd.grad(_two_blocks_plain(x, w1, w2, False), [w1, w2])
    for g, e in zip(torch.autograd.grad(loss, [w1, w2]), expected):
        torch.testing.assert_close(g, e)


def test_selective_policy_on_a_gpt_block_keeps_the_named_operators():
    from fulmen.bench.models import GPTBlock, GPTConfig

    torch.manual_seed(0)
    block = GPTBlock(GPTConfig(n_layer=1, n_head=2, n_embd=16))
    keep = [torch.ops.aten.addmm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default]

    def program(x):
        context_fn = functools.partial(create_selective_checkpoint_contexts, keep)
        return checkpoint(block, x, use_reentrant=False, context_fn=context_fn).square().sum()

    x = torch.randn(2, 8, 16)
    jitted = fulmen.jit(program, executors=["torch"])
    loss = jitted(x)
    grads = torch.autograd.grad(loss, list(block.parameters()))
    expected = torch.autograd.grad(block(x).square().sum(), list(block.parameters()))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e)
    forward = fulmen.last_traces(jitted)[-1]
    producers: dict[str, str] = {}
    stack = list(reversed(forward.bound_symbols))
    while stack:
        b = stack.pop()
        producers.update((p.name, b.sym.qualified_name) for p in b.flat_proxy_outs if p.name not in producers)
        stack += reversed(b.subsymbols)
    inputs = {p.name for p in forward.args}
    kept = {producers[p.name] for p in forward.output[1:] if p.name not in inputs}
    # the linear layers' outputs (and attention's, with its log-sum-exp); the block's result, squared outside the
    # region, as well; no layer norm or GELU output
    assert any("linear" in name for name in kept) and any("scaled_dot_product" in name for name in kept)
    assert all("linear" in name or "scaled_dot_product" in name or name.endswith("add") for name in kept), kept


def test_the_first_call_already_runs_the_checkpointed_program():
    # in the "async" mode a training program's first call may run on PyTorch autograd, which keeps everything the
    # regions compute; a program checkpointed to fit in memory must not need more at its first step
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    loss = fulmen.jit(_two_blocks, executors=["torch"], compile="async")(x, w1, w2, False)
    assert type(loss.grad_fn).__name__ == "FulmenFunctionBackward"
    assert saved_bytes(loss, exclude=[x, w1, w2]) == 16 * 8 * 4


@pytest.mark.usefixtures("quiet_transformers")
def test_hugging_face_gradient_checkpointing_is_recomputed_and_equals_eager():
    # transformers' own checkpointing (model.gradient_checkpointing_enable(), use_reentrant=False) on a tiny Llama
    # built from its config: fulmen recomputes the layers in the backward, the loss and every gradient as eager's
    pytest.importorskip("transformers")
    from fulmen.bench.hf_families import FAMILIES

    family = FAMILIES["llama"]

    def build(checkpointed: bool):
        model = family.build(use_cache=False).train()
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    kwargs = family.inputs(build(False).config)
    eager = build(True)
    expected = eager(**kwargs).loss
    expected.backward()
    results = {}
    for checkpointed in (False, True):
        model = build(checkpointed)
        jitted = fulmen.jit(model, executors=["torch"])
        jitted(**kwargs).loss.backward()  # the first call compiles
        model.zero_grad()
        loss = jitted(**kwargs).loss
        results[checkpointed] = saved_bytes(loss, exclude=[*model.parameters()])
        loss.backward()
        if checkpointed:
            torch.testing.assert_close(loss, expected)
            for (name, p), e in zip(model.named_parameters(), eager.parameters()):
                torch.testing.assert_close(p.grad, e.grad, msg=name)
    assert results[True] < results[False]
