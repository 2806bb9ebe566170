"""Errors a user can act on.

* Python that needs a tensor's value while tracing (``if t:``, ``t.item()``, ...) raises ``DataDependentError``
  naming the user's file and line and the way out (the ``torch.compile`` backend).
* Bad arguments to an op raise the exception type eager PyTorch raises, with the bad values in the message.
* A failing call leaves the caller's tensors and modules as they were, and the function usable afterwards.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fulmen
from fulmen.core.proxies import DataDependentError

THIS_FILE = os.path.basename(__file__)


def _line_of(fn, marker: str) -> int:
    """The line number, in this file, of the first source line of ``fn`` containing ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    for offset, text in enumerate(lines):
        if marker in text:
            return start + offset
    raise AssertionError(f"{marker!r} not found in the source of {fn.__name__}")


def _check_data_dependent(excinfo, fn, marker: str) -> None:
    message = str(excinfo.value)
    line = _line_of(fn, marker)
    assert THIS_FILE in message, f"the message does not name {THIS_FILE}:\n{message}"
    assert f"line {line}" in message, f"the message does not name line {line}:\n{message}"
    assert "torch.compile(" in message and 'backend="fulmen"' in message, message


# ---------------------------------------------------------------------------------------------------------------
# data-dependent Python
# ---------------------------------------------------------------------------------------------------------------

def _uses_bool(x):
    y = x * 2
    if y.sum() > 0:  # offending: bool
        return y
    return -y


def _uses_item(x):
    scale = x.max().item()  # offending: item
    return x / scale


def _uses_tolist(x):
    values = x.tolist()  # offending: tolist
    return x + len(values)


def _uses_numpy(x):
    array = x.numpy()  # offending: numpy
    return x + array.shape[0]


def _uses_float(x):
    return x * float(x.sum())  # offending: float


def _uses_while(x):
    while x.mean() < 10:  # offending: while
        x = x + 1
    return x


def _uses_assert(x):
    assert (x > -100).all()  # offending: assert
    return x


def _helper(t):
    return t.abs().sum().item()  # offending: helper


def _calls_a_helper(x):
    return x * _helper(x)


def test_data_dependent_python_names_the_users_line():
    x = torch.randn(2, 3)
    before = x.clone()
    jfn = fulmen.jit(_uses_numpy)
    with pytest.raises(DataDependentError) as excinfo:
        jfn(x)
    _check_data_dependent(excinfo, _uses_numpy, "offending: numpy")
    assert torch.equal(x, before)
    with pytest.raises(DataDependentError):  # nothing half-compiled was cached
        jfn(x)
    assert isinstance(excinfo.value, RuntimeError)  # catchable as torch's own RuntimeError


@pytest.mark.parametrize("fn, marker", [
    (_uses_bool, "offending: bool"),
    (_uses_item, "offending: item"),
    (_uses_tolist, "offending: tolist"),
    (_uses_float, "offending: float"),
    (_uses_while, "offending: while"),
    (_uses_assert, "offending: assert"),
    (_calls_a_helper, "offending: helper"),
], ids=lambda v: getattr(v, "__name__", None) or v.split(": ")[-1])
def test_data_dependent_python_is_a_split_point_naming_the_users_line(fn, marker):
    # the value is read from the call's tensors and guarded (fulmen.frontend.split_points); the trace names the line
    x = torch.randn(2, 3)
    jfn = fulmen.jit(fn)
    torch.testing.assert_close(jfn(x.clone()), fn(x.clone()))
    line = _line_of(fn if fn is not _calls_a_helper else _helper, marker)
    assert f'{THIS_FILE}", line {line}' in str(fulmen.last_traces(jfn)[0])


class _BranchyModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        h = self.fc(x)
        return h + h.detach().numpy().sum()  # offending: module


def test_data_dependent_in_a_module_restores_the_module():
    model = _BranchyModule()
    weight = model.fc.weight
    jm = fulmen.jit(model)
    with torch.no_grad(), pytest.raises(DataDependentError) as excinfo:
        jm(torch.randn(2, 3))
    _check_data_dependent(excinfo, _BranchyModule.forward, "offending: module")
    # Tracing swapped parameters for proxies; the failure must have put the real ones back.
    assert model.fc.weight is weight and isinstance(model.fc.weight, nn.Parameter)
    assert torch.isfinite(model(torch.randn(2, 3))).all()


def _broadcasts_nonzero(x):
    positions = torch.nonzero(x > 0)
    return positions + torch.ones(3, 1)  # offending: nonzero


def test_data_dependent_size_question_names_the_users_line():
    # nonzero's size is traced as a data-dependent (unbacked) size; adding a tensor of 3 rows needs to know whether
    # it is 1 or 3, which only the data say
    with pytest.raises(DataDependentError) as excinfo:
        fulmen.jit(_broadcasts_nonzero, executors=["torch"])(torch.randn(4))
    _check_data_dependent(excinfo, _broadcasts_nonzero, "offending: nonzero")
    assert "u0" in str(excinfo.value)


def test_tracing_works_again_after_a_failure():
    with pytest.raises(DataDependentError):
        fulmen.jit(_uses_numpy)(torch.randn(3))
    f = fulmen.jit(lambda a: a * 2)
    x = torch.randn(3)
    torch.testing.assert_close(f(x), x * 2)
    assert "def computation(a)" in str(fulmen.last_traces(f)[0])



class _BuildsALayerEachCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        norm = nn.LayerNorm(3)  # offending: module built in forward
        return norm(self.fc(x))


def test_a_module_built_inside_the_traced_code_names_the_users_line():
    model = _BuildsALayerEachCall()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    jm = fulmen.jit(model)
    for _ in range(2):  # the same clear error again: the failed trace left nothing half-done
        with pytest.raises(NotImplementedError) as excinfo:
            jm(torch.randn(2, 3))
        message = str(excinfo.value)
        line = _line_of(_BuildsALayerEachCall.forward, "offending: module built in forward")
        assert f"{THIS_FILE}\", line {line}" in message
        assert "nn.Parameter" in message and "outside the compiled function" in message
    assert isinstance(model.fc.weight, nn.Parameter) and list(model.state_dict()) == list(state)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)

    def loose_parameter(x):
        return x * nn.Parameter(torch.ones(3))  # offending: parameter

    with pytest.raises(NotImplementedError, match="nn.Parameter") as excinfo:
        fulmen.jit(loose_parameter)(torch.randn(3))
    assert f"line {_line_of(loose_parameter, 'offending: parameter')}" in str(excinfo.value)

# ---------------------------------------------------------------------------------------------------------------
# bad op arguments: same exception type as eager, bad values in the message, inputs untouched
# ---------------------------------------------------------------------------------------------------------------

def _x():
    return torch.randn(2, 3)


def _ints():
    return torch.arange(3)


# (id, function, inputs maker, strings the message must contain)
BAD_ARGUMENTS = [
    ("add-shape-mismatch", lambda a, b: a + b, lambda: (_x(), torch.randn(4)), ["3", "4"]),
    ("matmul-mismatch", lambda a, b: a @ b, lambda: (_x(), torch.randn(4, 5)), ["3", "4"]),
    ("mm-mismatch", lambda a, b: torch.mm(a, b), lambda: (_x(), _x()), ["3", "2"]),
    ("sum-bad-dim", lambda a: a.sum(5), lambda: (_x(),), ["5"]),
    ("softmax-bad-dim", lambda a: torch.softmax(a, 3), lambda: (_x(),), ["3"]),
    ("transpose-bad-dim", lambda a: a.transpose(0, 3), lambda: (_x(),), ["3"]),
    ("unsqueeze-bad-dim", lambda a: a.unsqueeze(4), lambda: (_x(),), ["4"]),
    ("view-incompatible", lambda a: a.view(7), lambda: (_x(),), ["7", "6"]),
    ("reshape-two-inferred", lambda a: a.reshape(-1, -1), lambda: (_x(),), ["one dimension"]),
    ("expand-bad-size", lambda a: a.expand(3, 4), lambda: (_x(),), ["4", "3"]),
    ("cat-mismatch", lambda a, b: torch.cat([a, b]), lambda: (_x(), torch.randn(2, 4)), ["3", "4"]),
    ("cat-bad-dim", lambda a: torch.cat([a, a], dim=2), lambda: (_x(),), ["2"]),
    ("stack-mismatch", lambda a, b: torch.stack([a, b]), lambda: (_x(), torch.randn(3, 2)), ["2, 3", "3, 2"]),
    ("split-bad-sizes", lambda a: torch.split(a, [1, 1], dim=1), lambda: (_x(),), ["[1, 1]", "3"]),
    ("index-out-of-range", lambda a: a[5], lambda: (_x(),), ["5", "2"]),
    ("sum-duplicate-dims", lambda a: a.sum(dim=(0, 0)), lambda: (_x(),), ["0"]),
    ("layer-norm-shape", lambda a: F.layer_norm(a, (4,)), lambda: (_x(),), ["4", "2, 3"]),
    ("linear-mismatch", lambda a, w: F.linear(a, w), lambda: (_x(), torch.randn(5, 4)), ["3", "4"]),
    ("bitwise-and-float", lambda a: a & a, lambda: (_x(),), ["Float"]),
    ("softmax-int", lambda a: torch.softmax(a, -1), lambda: (_ints(),), ["Long"]),
    ("mean-int", lambda a: a.mean(), lambda: (_ints(),), ["mean"]),
    ("sub-bool", lambda a: a - a, lambda: (torch.ones(2, dtype=torch.bool),), ["bool"]),
    ("add-str", lambda a: torch.add(a, "a"), lambda: (_x(),), ["str"]),
    ("view-float-size", lambda a: a.view(2.5, 2), lambda: (_x(),), ["float"]),
    ("inplace-add-broadcast", lambda a, b: a.add_(b), lambda: (torch.randn(3), _x()), ["[3]", "[2, 3]"]),
    ("inplace-mul-int-by-float", lambda a: a.mul_(2.5), lambda: (_ints(),), ["Float", "cast"]),
    ("embedding-index-out-of-range", lambda i, w: F.embedding(i, w),
     lambda: (torch.tensor([5]), torch.randn(3, 2)), ["index out of range"]),
]


@pytest.mark.parametrize("fn, make_inputs, mentions", [c[1:] for c in BAD_ARGUMENTS],
                         ids=[c[0] for c in BAD_ARGUMENTS])
def test_bad_arguments_raise_what_torch_raises(fn, make_inputs, mentions):
    torch.manual_seed(0)
    inputs = make_inputs()
    with pytest.raises(Exception) as eager:
        fn(*[t.clone() for t in inputs])
    before = [t.clone() for t in inputs]
    with pytest.raises(Exception) as compiled:
        fulmen.jit(fn)(*inputs)
    assert isinstance(compiled.value, eager.type), (
        f"eager raised {eager.type.__name__}, fulmen raised {type(compiled.value).__name__}: {compiled.value}")
    message = str(compiled.value)
    for text in mentions:
        assert text.lower() in message.lower(), f"{text!r} not in the message: {message}"
    for t, b in zip(inputs, before):
        assert torch.equal(t, b), "a failing call changed an input"


def test_int_exp_promotes_like_torch():
    # Not an error in torch: integer inputs to exp promote to the default float dtype.
    x = _ints()
    out = fulmen.jit(torch.exp)(x)
    assert out.dtype == torch.exp(x).dtype == torch.float32
    torch.testing.assert_close(out, torch.exp(x))


def test_failure_after_an_inplace_update_leaves_the_input_untouched():
    def fn(a, b):
        a.add_(1)
        return b.view(7)  # fails while tracing, before anything runs

    a, b = torch.zeros(3), torch.randn(2, 3)
    with pytest.raises(RuntimeError, match="7"):
        fulmen.jit(fn)(a, b)
    assert torch.equal(a, torch.zeros(3))
