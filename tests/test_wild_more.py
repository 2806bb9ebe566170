"""More programs nobody on the team wrote, as users write them: each must match eager PyTorch, or be refused with an
error that says what to change.

Every test here reproduces a silently wrong result found by running such a program under ``fulmen.jit``.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn as nn

import fulmen
from fulmen.core.proxies import Proxy

_FEATURES: list = []


def _log_features(x):
    y = x.sin()
    _FEATURES.append(y)  # a global list: eager appends a real tensor on every call
    return y * 2


def test_forward_hook_collecting_activations_is_refused_and_leaves_no_proxy():
    """A forward hook that stores activations in a list (feature extraction): the compiled program does not repeat
    the append, so the list would hold a placeholder after the first call and nothing from later ones."""
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    feats: list = []
    model[1].register_forward_hook(lambda mod, args, out: feats.append(out))
    jitted = fulmen.jit(model, executors=["torch"])
    with pytest.raises(NotImplementedError, match="'feats'.*list"):
        jitted(torch.randn(2, 3))
    assert feats == []  # the traced placeholder was taken out again
    model(torch.randn(2, 3))  # eager still runs the hook
    assert len(feats) == 1 and not isinstance(feats[0], Proxy)


def test_hook_storing_into_a_closure_dict_is_refused():
    acts: dict = {}

    def save(name):
        def hook(mod, args, out):
            acts[name] = out.detach()

        return hook

    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
    model[0].register_forward_hook(save("linear"))
    with pytest.raises(NotImplementedError, match="'acts'.*dict"):
        fulmen.jit(model, executors=["torch"])(torch.randn(2, 3))
    assert acts == {}


def test_append_to_a_global_list_is_refused():
    _FEATURES.clear()
    with pytest.raises(NotImplementedError, match="'_FEATURES' \\(a global"):
        fulmen.jit(_log_features, executors=["torch"])(torch.randn(3))
    assert _FEATURES == []


class _KeepsHistory(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.history: list = []

    def forward(self, x):
        y = self.linear(x)
        self.history.append(y)
        return y


def test_module_appending_to_its_own_list_attribute_is_refused():
    module = _KeepsHistory()
    with pytest.raises(NotImplementedError, match="_KeepsHistory.history"):
        fulmen.jit(module, executors=["torch"])(torch.randn(2, 3))
    assert module.history == []


def _append_double(xs, out):
    out.append(xs[0] * 2)
    return xs[0]


def _set_item(batch):
    batch["doubled"] = batch["x"] * 2
    return batch["x"] + 1


@pytest.mark.parametrize(
    "fn, args, name",
    [(_append_double, lambda: ([torch.ones(2)], []), "'out'"), (_set_item, lambda: ({"x": torch.ones(2)},), "'batch'")],
)
def test_changing_a_list_or_dict_argument_is_refused(fn, args, name):
    """The traced function receives copies of its list and dict arguments (their tensors made proxies): items it
    adds would never reach the caller's container, on the first call or any later one."""
    with pytest.raises(NotImplementedError, match=f"passed as {name}"):
        fulmen.jit(fn, executors=["torch"])(*args())


def test_containers_the_function_only_reads_or_updates_in_place_still_compile():
    """No false alarm: tensors updated in place through a list argument, a hook that stores a shape, a config dict."""
    shapes: list = []
    model = nn.Sequential(nn.Linear(3, 4))
    model[0].register_forward_hook(lambda mod, args, out: shapes.append(tuple(out.shape)))
    cfg = {"scale": 2.0}

    def step(ts, x):
        ts[0].mul_(cfg["scale"])
        return model(x) + ts[0].sum()

    jitted = fulmen.jit(step, executors=["torch"])
    x, ts_eager, ts_jit = torch.randn(2, 3), [torch.ones(4)], [torch.ones(4)]
    for _ in range(2):
        torch.testing.assert_close(jitted(ts_jit, x), step(ts_eager, x))
        torch.testing.assert_close(ts_jit[0], ts_eager[0])


def test_default_arguments_rebound_between_calls_are_seen():
    """Eager reads ``f.__defaults__`` / ``f.__kwdefaults__`` at every call; a program traced with the old default
    tensor or number kept using it."""
    weight = torch.ones(3)

    def scaled(x, w=weight, *, shift=1.0):
        return x * w + shift

    jitted = fulmen.jit(scaled, executors=["torch"])
    x = torch.arange(3.0)
    torch.testing.assert_close(jitted(x), scaled(x))
    scaled.__defaults__ = (torch.full((3,), 7.0),)
    torch.testing.assert_close(jitted(x), scaled(x))
    scaled.__kwdefaults__ = {"shift": -2.0}
    torch.testing.assert_close(jitted(x), scaled(x))


class _Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)


def _symmetric_linear() -> nn.Linear:
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)
    torch.nn.utils.parametrize.register_parametrization(linear, "weight", _Symmetric())
    return linear


def test_parametrize_cached_neither_leaks_proxies_nor_bakes_in_the_cached_weight():
    """``parametrize.cached()`` keeps each parametrized weight in a dict for the process: traced inside it, the
    program read the real weight an eager call had cached (a constant, stale after the next optimizer step), or left
    its proxy there for eager code to run into."""
    from torch.nn.utils import parametrize

    eager, linear = _symmetric_linear(), _symmetric_linear()
    jitted = fulmen.jit(linear, executors=["torch"])
    x = torch.randn(2, 4)
    with parametrize.cached():
        torch.testing.assert_close(linear(x), eager(x))  # eager first: the weight is now in the cache
        torch.testing.assert_close(jitted(x), eager(x))
        torch.testing.assert_close(linear(x), eager(x))  # and no proxy left there by the trace
    with torch.no_grad():
        for m in (eager, linear):
            m.parametrizations.weight.original.add_(1.0)
    torch.testing.assert_close(jitted(x), eager(x))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_returned_shapes_stay_torch_size(requires_grad):
    """``return x.shape``: eager returns a ``torch.Size`` (``.numel()``, ``isinstance(s, torch.Size)``); torch's pytree
    unflattens one into a plain tuple, which the compiled program returned."""

    def shapes(x):
        return x.shape, x.sum(), x.shape[1:], x.size()

    jitted = fulmen.jit(shapes, executors=["torch"])
    x = torch.randn(2, 3, requires_grad=requires_grad)
    for _ in range(3):  # the first call, then the compiled program (warm start)
        got, want = jitted(x), shapes(x)
        assert [type(v) for v in got] == [type(v) for v in want]
        assert got[0] == want[0] and got[2] == want[2] and got[0].numel() == 6


def test_assigning_a_nonlocal_variable_while_traced_warns(caplog):
    """``nonlocal count; count += 1`` outlives the call like a global write; the compiled program does not repeat it
    (and ``x * count`` keeps the traced count), so it warns as for globals."""
    count = 0

    def counted(x):
        nonlocal count
        count += 1
        return x * count

    with caplog.at_level(logging.WARNING, logger="fulmen"):
        fulmen.jit(counted, executors=["torch"])(torch.ones(2))
    assert any("nonlocal variable(s) count" in r.getMessage() for r in caplog.records)


_ACCURACY: list = []


def _eval_step(logits, labels):
    _ACCURACY.append((logits.argmax(-1) == labels).sum().item())  # a number, read from the call's tensors
    return logits.sum()


def test_changing_a_container_with_python_values_while_traced_warns(caplog):
    """``stats.append(correct.item())`` in a compiled step: the append runs only while tracing (a call whose value
    takes an already compiled branch appends nothing), so it warns as for assigned globals."""
    _ACCURACY.clear()
    with caplog.at_level(logging.WARNING, logger="fulmen"):
        fulmen.jit(_eval_step, executors=["torch"])(torch.eye(2), torch.tensor([0, 0]))
    assert any("changes '_ACCURACY'" in r.getMessage() for r in caplog.records)
    _ACCURACY.clear()


def test_a_generator_argument_pytorch_cannot_trace_is_a_clear_refusal():
    """``t.exponential_(generator=g)``: PyTorch's fake kernel raises a bare AssertionError for the generator; the
    refusal names the op, the user's line and the way out."""

    def noise(x, gen):
        return torch.empty(3).exponential_(generator=gen) + x

    with pytest.raises(NotImplementedError, match="(?s)exponential_.*generator.*test_wild_more.py"):
        fulmen.jit(noise, executors=["torch"])(torch.ones(3), torch.Generator().manual_seed(0))


@functools.lru_cache(maxsize=None)
def _causal_mask(n: int) -> torch.Tensor:
    return torch.ones(n, n).triu(1).bool()


def _masked(x):
    return x.masked_fill(_causal_mask(x.shape[-1]), 0.0)


def test_an_lru_cached_helper_keeps_no_traced_values():
    """A mask built by an ``lru_cache``d helper while tracing was a proxy kept in the cache: eager code calling the
    helper got it back, and a later trace (a new dtype) used it as a value of its own (a NameError in its code)."""
    _causal_mask.cache_clear()
    jitted = fulmen.jit(_masked, executors=["torch"])
    x = torch.randn(4, 4)
    torch.testing.assert_close(jitted(x), _masked(x))
    assert not isinstance(_causal_mask(4), Proxy)  # eager code gets a tensor back
    _causal_mask.cache_clear()
    torch.testing.assert_close(jitted(x.double()), _masked(x.double()))  # a new trace, then eager
    torch.testing.assert_close(jitted(x.double()), _masked(x.double()))
