"""Smaller gaps real programs hit (issue 42): pickling jitted code, Embedding(max_norm), RNN flat weights, higher-order
ops, and a custom op whose meta disagrees with its kernel. Each compares against eager PyTorch."""

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import Symbol
from fulmen.executors import add_operator_executor

# ---- pickling, torch.save and deepcopy of jitted code: the function and options travel, compiled programs do not


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))


def _through_torch_save(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


_COPIES = {"pickle": lambda o: pickle.loads(pickle.dumps(o)), "torch.save": _through_torch_save,
           "deepcopy": copy.deepcopy}


@pytest.mark.parametrize("how", sorted(_COPIES))
@pytest.mark.parametrize("called_first", [False, True])
def test_a_jitted_module_survives_pickling(how, called_first):
    model = _mlp()
    jitted = fulmen.jit(model, executors=["torch"], dynamic=False)
    x = torch.randn(5, 4, requires_grad=True)
    if called_first:
        jitted(x).sum().backward()
    loaded = _COPIES[how](jitted)
    assert type(loaded) is type(jitted) and loaded is not jitted
    program = loaded._fulmen_jitted
    assert [e.name for e in program.executors] == [e.name for e in jitted._fulmen_jitted.executors]
    assert program.dynamic is False and fulmen.compile_stats(loaded).cache_misses == 0
    # one set of tensors: the wrapper's state is its original module's, and a copy's own
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for (name, a), b in zip(loaded.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
        assert a.data_ptr() != b.data_ptr()
    assert list(loaded.parameters())[0] is list(loaded.original_module.parameters())[0]
    model.zero_grad()
    expected = model(x)
    got = loaded(x)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert fulmen.compile_stats(loaded).cache_misses == 1  # compiled again for the copy
    got.sum().backward()
    expected.sum().backward()
    for (name, a), b in zip(loaded.named_parameters(), model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6, msg=name)
    with torch.no_grad():  # the copy's program reads the copy's parameters
        loaded.original_module[0].weight.zero_()
    torch.testing.assert_close(loaded(x), loaded.original_module(x), rtol=0, atol=0)


def test_state_dict_of_a_jitted_module_saves_under_the_original_names():
    model = _mlp()
    jitted = fulmen.jit(model, executors=["torch"])
    jitted(torch.randn(2, 4))
    saved = _through_torch_save(jitted.state_dict())
    assert list(saved) == list(model.state_dict())
    fresh = _mlp()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1)
    fresh.load_state_dict(saved)
    x = torch.randn(3, 4)
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)


def _scaled_sin(x, scale: float):
    return torch.sin(x) * scale + x.cumsum(0)


@pytest.mark.parametrize("how", sorted(_COPIES))
def test_a_jitted_function_survives_pickling_after_its_first_call(how):
    jitted = fulmen.jit(_scaled_sin, compile="off")
    x = torch.randn(6, 3)
    jitted(x, 2.0)
    loaded = _COPIES[how](jitted)
    assert loaded.fn is _scaled_sin and loaded.compile_mode == "off"
    assert [e.name for e in loaded.executors] == [e.name for e in jitted.executors]
    torch.testing.assert_close(loaded(x, 3.0), _scaled_sin(x, 3.0), rtol=1e-6, atol=1e-6)
    assert fulmen.compile_stats(loaded).cache_misses == 1


# ---- nn.Embedding(max_norm=...): rows renormalized in place before the lookup


def _big_embedding(**kwargs) -> torch.nn.Embedding:
    torch.manual_seed(0)
    e = torch.nn.Embedding(10, 4, **kwargs)
    with torch.no_grad():
        e.weight.mul_(3)  # most rows' norms exceed max_norm
    return e


@pytest.mark.parametrize("norm_type", [2.0, 1.0])
def test_embedding_max_norm_renormalizes_the_weight_in_place_as_eager(norm_type):
    eager = _big_embedding(max_norm=1.5, norm_type=norm_type)
    mine = copy.deepcopy(eager)
    jitted = fulmen.jit(mine, executors=["torch"])
    calls = [torch.tensor([[1, 2, 2], [3, 9, 1]]), torch.tensor([[0, 5, 5], [1, 1, 7]]), torch.tensor([[4, 4, 4]])]
    for idx in calls:  # several calls in a row: each renormalizes the rows it picks
        expected, got = eager(idx), jitted(idx)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        torch.testing.assert_close(mine.weight, eager.weight, rtol=0, atol=0)  # the write is visible after the call
        (expected * torch.arange(4.0)).sum().backward()
        (got * torch.arange(4.0)).sum().backward()
        torch.testing.assert_close(mine.weight.grad, eager.weight.grad, rtol=0, atol=0)
    assert (eager.weight.norm(p=norm_type, dim=1)[[0, 1, 2, 3, 4, 5, 7, 9]] <= 1.5 + 1e-5).all()
    assert eager.weight.norm(p=norm_type, dim=1)[8] > 1.5  # a row never picked keeps its norm


def test_functional_embedding_max_norm_writes_the_weight_argument():
    def f(idx, w):
        return F.embedding(idx, w, max_norm=1.0).sum(-1)

    w = _big_embedding().weight.detach().clone()
    w_eager = w.clone()
    idx = torch.tensor([0, 3, 3, 6])
    torch.testing.assert_close(fulmen.jit(f, executors=["torch"])(idx, w), f(idx, w_eager), rtol=0, atol=0)
    torch.testing.assert_close(w, w_eager, rtol=0, atol=0)


# ---- LSTM/GRU: forward rebuilds _flat_weights from the parameters it sees (the proxies, while tracing)


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU])
def test_rnn_traces_silently_and_keeps_its_flat_weights_real(cls, caplog, recwarn):
    torch.manual_seed(0)
    eager = cls(4, 5, num_layers=2, batch_first=True, bidirectional=True)
    mine = copy.deepcopy(eager)
    jitted = fulmen.jit(mine, executors=["torch"])
    x = torch.randn(2, 3, 4, requires_grad=True)
    x_mine = x.detach().clone().requires_grad_()
    with caplog.at_level("WARNING", logger="fulmen"):
        for _ in range(2):
            expected, got = eager(x)[0], jitted(x_mine)[0]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
            expected.square().sum().backward()
            got.square().sum().backward()
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    assert not [str(w.message) for w in recwarn.list if "weight" in str(w.message)]
    torch.testing.assert_close(x_mine.grad, x.grad, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(mine.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    # the module's own bookkeeping holds its parameters, as eager leaves it (not a tracing placeholder)
    params = [getattr(mine, n) for n in mine._flat_weights_names]
    assert all(w is p for w, p in zip(mine._flat_weights, params, strict=True))
    assert all(r() is p for r, p in zip(mine._flat_weight_refs, params, strict=True))


# ---- seed 000's form: a symbol whose meta declares int64 outputs for a kernel that returns float32


def _xent_meta(logits, labels):
    return TensorProxy(like=labels), TensorProxy(like=labels)  # as the seed: like=target


def _xent_impl(logits, labels):
    lse = torch.logsumexp(logits, -1)
    return lse - logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1), lse


_xent = Symbol(id="gaps_xent_forward", name="gaps_xent_forward", meta=_xent_meta, is_prim=True)
_XENT_EXECUTOR = add_operator_executor("gaps_xent", {"gaps_xent_forward": ("gaps_xent_impl", None, _xent_impl)},
                                       add_to_default_executors=False)


def _xent_program(logits, labels):
    losses, lse = _xent(logits, labels)
    return losses * 2 + lse.exp().log(), (losses > 1).sum()


def test_a_meta_declaring_other_dtypes_than_its_kernel_warns_and_compiles_again():
    torch.manual_seed(0)
    logits, labels = torch.randn(6, 5), torch.randint(0, 5, (6,))
    jitted = fulmen.jit(_xent_program, executors=[_XENT_EXECUTOR])
    losses, lse = _xent_impl(logits, labels)
    expected = (losses * 2 + lse.exp().log(), (losses > 1).sum())
    with pytest.warns(UserWarning, match=r"gaps_xent_impl in executor 'gaps_xent' disagrees with its meta: "
                                         r"output\[0\] is cpu f32\[6\], but the meta promises cpu i64\[6\]"):
        got = jitted(logits, labels)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert got[0].dtype == torch.float32  # traced for what the kernel returns, not for int64
    assert fulmen.cache_misses(jitted) == 2
    text = str(fulmen.last_traces(jitted)[0])
    assert 'gaps_xent_forward(logits, labels)' in text and '"cpu f32[6]"' in text
    torch.testing.assert_close(jitted(logits, labels), expected, rtol=0, atol=0)  # no warning, no compilation
    assert fulmen.cache_hits(jitted) == 1 and fulmen.cache_misses(jitted) == 2


# ---- higher-order ops: traced as eager runs them (the combine function, the branch, the loop body)


def _linear_recurrence(left, right):  # h_t = a_t * h_{t-1} + b_t, as a selective scan (Mamba) writes it
    (a1, b1), (a2, b2) = left, right
    return a2 * a1, a2 * b1 + b2


@pytest.mark.parametrize("n", [1, 5, 8])
@pytest.mark.parametrize("reverse", [False, True])
def test_associative_scan_matches_eager_values_and_gradients(n, reverse):
    from torch._higher_order_ops import associative_scan

    def f(a, b):
        _, h = associative_scan(_linear_recurrence, (a, b), dim=1, reverse=reverse, combine_mode="generic")
        cumsum = associative_scan(torch.add, b, dim=-1, combine_mode="generic")
        return h * 2, cumsum

    torch.manual_seed(n)
    a, b = torch.rand(2, n, 3, dtype=torch.float64) * 0.9, torch.randn(2, n, 3, dtype=torch.float64)
    a_eager, b_eager = a.clone().requires_grad_(), b.clone().requires_grad_()
    a.requires_grad_()
    b.requires_grad_()
    expected, got = f(a_eager, b_eager), fulmen.jit(f, executors=["torch"])(a, b)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    (expected[0].sin().sum() + expected[1].cos().sum()).backward()
    (got[0].sin().sum() + got[1].cos().sum()).backward()
    torch.testing.assert_close(a.grad, a_eager.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(b.grad, b_eager.grad, rtol=1e-10, atol=1e-12)


def test_associative_scan_refuses_what_eager_refuses():
    from torch._higher_order_ops import associative_scan

    def f(x):
        return associative_scan(torch.add, x, dim=0)  # combine_mode="pointwise" needs CUDA tensors

    x = torch.randn(4)
    with pytest.raises(ValueError, match="pointwise"):
        f(x)
    with pytest.raises(ValueError, match="pointwise"):
        fulmen.jit(f, executors=["torch"])(x)


class _Gate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 3)

    def forward(self, x):  # the predicate is a Python value: the branch reads the module's parameters
        return torch.cond(x.shape[0] > 2, lambda x: self.proj(x).sin(), lambda x: x.cos() * 2, (x,))


@pytest.mark.parametrize("rows", [2, 4])
def test_cond_with_a_python_predicate_runs_the_branch_it_picks(rows):
    eager = _Gate()
    mine = copy.deepcopy(eager)
    x = torch.randn(rows, 3, requires_grad=True)
    x_mine = x.detach().clone().requires_grad_()
    expected, got = eager(x), fulmen.jit(mine, executors=["torch"])(x_mine)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    expected.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(x_mine.grad, x.grad, rtol=1e-6, atol=1e-6)
    if rows > 2:
        torch.testing.assert_close(mine.proj.weight.grad, eager.proj.weight.grad, rtol=1e-6, atol=1e-6)


def test_while_loop_with_a_python_condition_unrolls():
    from torch._higher_order_ops import while_loop

    def f(x):
        return while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x * 2 + i), (0, x))

    x = torch.randn(4)
    i, got = fulmen.jit(f, executors=["torch"])(x)
    assert i == 3
    torch.testing.assert_close(got, ((x * 2) * 2 + 1) * 2 + 2, rtol=0, atol=0)


def _sqrt_or_double(x, w):  # the branch not taken computes NaN (forward and backward); eager never sees them
    return torch.cond(x.sum() > 0, lambda x: (x * w).sqrt(), lambda x: x * 2 + w, (x,))


class _TwoPaths(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 3)
        self.scale = torch.nn.Parameter(torch.rand(3) + 0.5)

    def forward(self, x):  # each branch reads parameters the other does not
        return torch.cond(x.mean() > 0, lambda x: self.proj(x).tanh(), lambda x: (x * self.scale).exp(), (x,))


def test_cond_with_a_tensor_predicate_is_eagers_branch_to_the_bit():
    jitted = fulmen.jit(_sqrt_or_double, executors=["torch"])
    for sign in (-1, 1, -1):
        x, w = (sign * torch.rand(2, 3)).requires_grad_(), torch.rand(3).requires_grad_()
        x_mine, w_mine = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        expected, got = _sqrt_or_double(x, w), jitted(x_mine, w_mine)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        expected.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(x_mine.grad, x.grad, rtol=0, atol=0)  # finite: no NaN from the other branch
        torch.testing.assert_close(w_mine.grad, w.grad, rtol=0, atol=0)
    assert fulmen.cache_misses(jitted) == 1  # one program serves both values of the predicate


def test_cond_with_a_tensor_predicate_in_a_module():
    eager = _TwoPaths()
    mine = copy.deepcopy(eager)
    jitted = fulmen.jit(mine, executors=["torch"])
    for sign in (1, -1):
        eager.zero_grad()
        mine.zero_grad()
        x = sign * torch.rand(4, 3)
        expected, got = eager(x), jitted(x)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        expected.square().sum().backward()
        got.square().sum().backward()
        for (name, a), b in zip(mine.named_parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6, msg=name)  # zeros for the other branch


def _writes_in_a_branch(x):
    return torch.cond(x.sum() > 0, lambda x: x.clone().add_(1), lambda x: x - 1, (x,))


def _draws_in_a_branch(x):
    return torch.cond(x.sum() > 0, lambda x: x + torch.rand_like(x), lambda x: x - 1, (x,))


@pytest.mark.parametrize("fn", [_writes_in_a_branch, _draws_in_a_branch], ids=["in place", "random"])
def test_cond_branches_that_cannot_both_run_are_refused_with_the_users_line(fn):
    with pytest.raises(NotImplementedError, match=r"torch.cond with a tensor predicate .*test_real_program_gaps.py"):
        fulmen.jit(fn, executors=["torch"])(torch.randn(3))


def _grow_until_large(x, w):  # the number of iterations depends on the values
    from torch._higher_order_ops import while_loop

    i, y, _ = while_loop(lambda i, y, w: y.abs().sum() < 50, lambda i, y, w: (i + 1, y * w + 1, w.clone()),
                         (torch.tensor(0), x, w))
    return i, y * 2


def test_while_loop_on_a_tensor_condition_runs_eagers_loop_at_every_call():
    jitted = fulmen.jit(_grow_until_large, executors=["torch"])
    for scale in (1.0, 3.0, 0.5):
        x, w = (torch.ones(3) * scale).requires_grad_(), torch.tensor([1.5, 2.0, 1.1], requires_grad=True)
        x_mine, w_mine = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        expected, got = _grow_until_large(x, w), jitted(x_mine, w_mine)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        expected[1].sum().backward()
        got[1].sum().backward()
        torch.testing.assert_close(x_mine.grad, x.grad, rtol=0, atol=0)
        torch.testing.assert_close(w_mine.grad, w.grad, rtol=0, atol=0)
    assert fulmen.cache_misses(jitted) == 1  # one program for every number of iterations
    # the functions are PyTorch's again after tracing: eager calls run as before
    assert torch.cond.__code__.co_filename.endswith("cond.py")


def _loop_reading_a_closure(x, w):
    from torch._higher_order_ops import while_loop

    return while_loop(lambda i, y: y.abs().sum() < 50, lambda i, y: (i + 1, y * w + 1), (torch.tensor(0), x))


def test_while_loop_on_a_tensor_condition_refuses_functions_reading_traced_tensors():
    x, w = torch.ones(3), torch.full((3,), 2.0)
    with pytest.raises(NotImplementedError, match=r"test_real_program_gaps.py(.|\n)*Carry those tensors in carried"):
        fulmen.jit(_loop_reading_a_closure, executors=["torch"])(x, w)


def test_the_operators_in_dynamos_graphs_run_under_the_fulmen_backend():
    def f(x, w):
        y = torch.cond(x.sum() > 0, lambda x: (x * w).sqrt(), lambda x: x * 2 + w, (x,))
        return _grow_until_large(y.detach() + 1, w.detach() + 1.5)[1] + y  # w > 1: the loop ends

    compiled = torch.compile(f, backend="fulmen")
    for sign in (1, -1):
        x, w = (sign * torch.rand(3)).requires_grad_(), torch.rand(3).requires_grad_()
        x_mine, w_mine = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        expected, got = f(x, w), compiled(x_mine, w_mine)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        expected.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(x_mine.grad, x.grad, rtol=0, atol=0)
        torch.testing.assert_close(w_mine.grad, w.grad, rtol=0, atol=0)
