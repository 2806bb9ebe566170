"""The host work around a decode step, each fast path against the slow one it stands for.

- The prologue compares every tensor input in one C++ check (``TensorGuards``) before its per-tensor checks, which run
  only when that check finds a difference (fulmen/frontend/prologue.py): it must accept exactly the calls the
  per-tensor checks accept, and a cache hit of a model's decode step must not fall back to them.
- Output containers (a ``ModelOutput``, namedtuples) are rebuilt by precomputed builders (fulmen/frontend/containers.py)
  exactly as ``tree_unflatten(tree_flatten(out)[0], spec)`` rebuilt them.
- Objects the program updates are left as eager leaves them: a traced tensor's device stored in one is a
  ``torch.device`` (fulmen/frontend/objects.py).
- Hugging Face ``generate()`` through these paths gives eager's tokens, greedy and sampling.
"""

from __future__ import annotations

import collections
import linecache
import sys

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

import fulmen
from fulmen.frontend.cache import args_key, global_state_key
from fulmen.frontend.containers import rebuilder
from fulmen.frontend.prologue import build_prologue


class _Sub(torch.Tensor):
    pass


def _odd_size1_stride() -> torch.Tensor:
    # contiguous (a size-1 dim's stride is ignored) but with another stride there than torch.randn(1, 3) has
    return torch.randn(5, 3).as_strided((1, 3), (7, 1))


def _tensors() -> list[torch.Tensor]:
    x = torch.randn(2, 3)
    z = torch.randn(2, 3, dtype=torch.complex64)
    return [
        x,
        torch.randn(1, 3),
        _odd_size1_stride(),
        torch.randn(2, 3).t().contiguous().t(),
        x.t(),
        torch.randn(4, 6)[::2, ::2],
        torch.randn(3).expand(2, 3),
        torch._neg_view(x),
        z,
        z.conj(),
        torch._neg_view(z),
        x.double(),
        x.detach().requires_grad_(),
        torch.nn.Parameter(x.clone()),
        x.as_subclass(_Sub),
        torch.randn(0, 3),
        torch.randn(0, 3).t(),
        torch.tensor(1.0),
        torch.randn(3, 2),
    ]


def _calls() -> list[tuple[tuple, dict]]:
    tensors = _tensors()
    calls = [((t,), {}) for t in tensors] + [((t, 1), {}) for t in tensors[:3]]
    return calls + [((tensors[0],), {"k": t}) for t in tensors[:4]] + [(([tensors[0], tensors[1]],), {})]


def test_the_one_tensor_check_accepts_exactly_what_the_per_tensor_checks_accept():
    calls = _calls()
    fast_built = 0
    for args, kwargs in calls:
        flat: list[torch.Tensor] = []
        key = (args_key(args, kwargs, flat), global_state_key())
        names = [f"a{i}" for i in range(len(args))]
        slow = build_prologue(key, names)
        fast = build_prologue(key, names, examples=flat)
        fast_built += fast.fast is not None
        assert fast.fast is None or "tensor_guards.check(" in fast.source
        for other_args, other_kwargs in calls:
            want, got = slow.check(other_args, other_kwargs), fast.check(other_args, other_kwargs)
            assert (got is None) == (want is None), (args, kwargs, other_args, other_kwargs)
            assert got is None or all(a is b for a, b in zip(got, want))
    # every call gets the one check but the one with a tensor subclass: the per-tensor checks alone decide there
    # (one tensor passed twice is one input, checked once; TensorGuards would refuse the alias)
    assert fast_built == len(calls) - 1


def test_a_prologue_reused_for_new_guards_keeps_its_tensor_check():
    flat: list[torch.Tensor] = []
    x = torch.randn(2, 3)
    key = (args_key((x,), {}, flat), global_state_key())
    first = build_prologue(key, ["x"], examples=flat)
    again = build_prologue(key, ["x"], fast=first.fast)
    assert again.fast is first.fast and again.check((torch.randn(2, 3),), {}) is not None
    assert again.check((torch.randn(3, 2).t(),), {}) is None


def _prologue_lines_run(fn, *args, **kwargs) -> list[str]:
    """The source lines of fulmen prologues that ran during ``fn(*args, **kwargs)``."""
    ran: list[str] = []

    def tracer(frame, event, arg):
        if not frame.f_code.co_filename.startswith("<fulmen prologue"):
            return None
        if event == "line":
            ran.append(linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip())
        return tracer

    sys.settrace(tracer)
    try:
        fn(*args, **kwargs)
    finally:
        sys.settrace(None)
    return ran


def test_a_module_cache_hit_checks_its_tensors_in_one_call():
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    jm, x = fulmen.jit(model, executors=["torch"]), torch.randn(2, 8)
    torch.testing.assert_close(jm(x), model(x))
    printed = str(fulmen.last_prologue_traces(jm)[0])
    assert "the 13 tensors" in printed and "0_weight: cpu float32[8, 8], requires_grad" in printed
    ran = _prologue_lines_run(jm, x)
    assert any(line.startswith("if not tensor_guards.check(") for line in ran)
    assert not any("isinstance(" in line for line in ran), "a per-tensor check ran on a hit"
    # a difference only the one check sees (an nn.Parameter where a tensor was): the per-tensor checks accept it
    as_param = torch.nn.Parameter(x.clone(), requires_grad=False)
    ran = _prologue_lines_run(jm, as_param)
    assert any("isinstance(" in line for line in ran)
    torch.testing.assert_close(jm(as_param), model(x))
    assert fulmen.cache_misses(jm) == 1
    model[0].weight.requires_grad_(False)  # a fact both compare: a miss, then eager's result
    torch.testing.assert_close(jm(x), model(x))
    assert fulmen.cache_misses(jm) == 2


def test_dynamic_sizes_keep_the_contiguity_check():
    def f(x):
        return x.reshape(-1) * 2

    jf = fulmen.jit(f, executors=["torch"], dynamic=True)
    for n in (3, 5):
        a = torch.randn(n, 4)
        torch.testing.assert_close(jf(a), f(a))
    assert "is_contiguous()" in str(fulmen.last_prologue_traces(jf)[0])
    misses = fulmen.cache_misses(jf)
    t = torch.randn(4, 7).t()  # sizes the symbolic entry takes, a layout it was not compiled for
    torch.testing.assert_close(jf(t), f(t))
    assert fulmen.cache_misses(jf) == misses + 1


# ---- containers ----

_Pair = collections.namedtuple("_Pair", "a b")


def _plain(x):
    if isinstance(x, tuple):
        return tuple(_plain(v) for v in x)
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _outputs() -> list:
    t = torch.randn(2)
    outputs = [_Pair(t, (t, [t, None])), {"x": _Pair(1, t)}, [None, (), {}, _Pair(t, t)], (t, 2.0)]
    transformers = pytest.importorskip("transformers")
    out = transformers.modeling_outputs.CausalLMOutputWithPast
    return outputs + [(out(logits=t, past_key_values=0), [t, t]), out(logits=t)]


@pytest.mark.parametrize("index", range(6))
def test_rebuilt_containers_are_pytrees_own(index):
    output = _outputs()[index]
    spec = tree_flatten(output)[1]
    generated = _plain(output)
    want = tree_unflatten(tree_flatten(generated)[0], spec)
    got = rebuilder(output)(generated)
    assert type(got) is type(want) and tree_flatten(got)[1] == spec
    assert all(a is b for a, b in zip(tree_flatten(got)[0], tree_flatten(want)[0]))


def test_a_jitted_function_returns_its_namedtuples():
    def f(x):
        return _Pair(x * 2, {"y": _Pair(x + 1, 3)})

    x = torch.randn(3)
    got = fulmen.jit(f, executors=["torch"])(x)
    want = f(x)
    assert type(got) is _Pair and type(got.b["y"]) is _Pair and got.b["y"].b == 3
    torch.testing.assert_close(got.a, want.a)
    torch.testing.assert_close(got.b["y"].a, want.b["y"].a)


# ---- objects ----


class _Box:
    pass


def test_a_device_stored_in_an_object_is_a_torch_device():
    def f(x, box):
        box.device = x.device
        box.t = x + 1
        return x * 2

    jf, x = fulmen.jit(f, executors=["torch"]), torch.randn(2)
    for _ in range(2):  # the call that compiles, then a hit
        box = _Box()
        box.device, box.t = None, torch.zeros(2)
        jf(x, box)
        assert type(box.device) is torch.device and box.device == x.device
        torch.testing.assert_close(box.t, x + 1)


# ---- Hugging Face generate() ----


def _model(name: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2
        )
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.usefixtures("quiet_transformers")
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_generate_takes_the_fast_paths_and_gives_eagers_tokens(name, sample):
    model = _model(name)
    jitted = fulmen.jit(model, executors=["torch"])
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    options = dict(max_new_tokens=8, min_new_tokens=8, do_sample=sample, top_k=0)
    with torch.no_grad():
        torch.manual_seed(2)
        want = model.generate(ids, **options)
        torch.manual_seed(2)
        got = jitted.generate(ids, **options)
        assert torch.equal(got, want), (got, want)
        torch.manual_seed(2)
        ran = _prologue_lines_run(jitted.generate, ids, **options)  # every forward a cache hit now
        assert fulmen.cache_misses(jitted) == 2
        assert ran and not any("isinstance(" in line for line in ran), "a per-tensor check ran on a decode step"
        cache = model(ids, use_cache=True).past_key_values
        jcache = jitted(ids, use_cache=True).past_key_values
    for mine, eager in zip(jcache.layers, cache.layers):
        assert {k: type(v) for k, v in vars(mine).items()} == {k: type(v) for k, v in vars(eager).items()}
