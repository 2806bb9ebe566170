"""Programs nobody on the team wrote, as users write them: each must match eager PyTorch call after call.

Every test here reproduces a silently wrong result found by running such a program under ``fulmen.jit``: the
values, gradients and buffers are compared with eager's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fulmen


def _reads_after_inplace(x, n):
    n.add_(1)
    return x * float(n), x * n.item(), x + int(n), x[: n.tolist()]


def test_value_read_after_an_inplace_update_is_the_updated_value():
    """``n.add_(1); float(n)`` reads n after the update: the read is a split point on the value now, not on the
    tensor the caller passed in (which still held the old value)."""
    jfn = fulmen.jit(_reads_after_inplace, executors=["torch"])
    x = torch.arange(4.0)
    n_eager, n_jit = torch.tensor(1), torch.tensor(1)
    for _ in range(3):  # the value changes every call: a new branch each time, each eager's
        want, got = _reads_after_inplace(x, n_eager), jfn(x, n_jit)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert torch.equal(n_jit, n_eager)


def test_batchnorm_cumulative_average_momentum_none():
    """``BatchNorm1d(momentum=None)`` averages its running stats with ``1 / float(num_batches_tracked)`` after
    incrementing it in place; the read must see the incremented count (it saw 0 and divided by zero)."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=None)).double()
    jitted_module = copy.deepcopy(eager)
    jm = fulmen.jit(jitted_module, executors=["torch"])
    for step in range(3):
        x = torch.randn(6, 3, dtype=torch.float64)
        torch.testing.assert_close(jm(x), eager(x))
        for name, want in eager.named_buffers():
            torch.testing.assert_close(dict(jitted_module.named_buffers())[name], want, msg=f"{name} step {step}")


def _grad_inside(x, w):
    with torch.enable_grad():
        y = (x * w).sin()
    return y, x * 2


def test_enable_grad_inside_a_function_called_under_no_grad():
    """``torch.enable_grad()`` inside the function turns grad mode on for its operations even when the caller is
    under ``torch.no_grad()`` (input-gradient code in an eval loop): the result requires grad and its gradients
    are eager's. It was run as an inference program, so the result silently had no history."""
    jfn = fulmen.jit(_grad_inside, executors=["torch"])
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    for _ in range(2):
        grads = []
        for fn in (_grad_inside, jfn):
            with torch.no_grad():
                y, z = fn(x, w)
            assert (y.requires_grad, z.requires_grad) == (True, False)
            grads.append(torch.autograd.grad(y.sum(), (x, w)))
        for got, want in zip(grads[1], grads[0]):
            torch.testing.assert_close(got, want)
    with torch.no_grad():  # a function with no enable_grad stays an inference program
        assert not fulmen.jit(lambda a: a.sin(), executors=["torch"])(x).requires_grad


def _saves_tensors(x):
    return (x.exp() * x).sin().sum()


def _grad_under_hooks(fn, x):
    # an unpack hook that changes values (as activation compression does): the gradient depends on what is saved
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 1, lambda t: t * 2):
        y = fn(x)
    return torch.autograd.grad(y, x)[0]


def test_saved_tensors_hooks_see_what_eager_saves():
    """Under ``saved_tensors_hooks`` a compiled program's backward saved other tensors than eager's operations (and
    only part of them went through the hooks), so the gradient differed; such calls now run eagerly, and calls
    outside the hooks still run the compiled program."""
    jfn = fulmen.jit(_saves_tensors, executors=["torch"])
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    want = _grad_under_hooks(_saves_tensors, x)
    for _ in range(2):  # the first call (compiling) and a cache hit
        torch.testing.assert_close(_grad_under_hooks(jfn, x), want)
    hits = fulmen.cache_hits(jfn)
    torch.testing.assert_close(torch.autograd.grad(jfn(x), x)[0], torch.autograd.grad(_saves_tensors(x), x)[0])
    assert fulmen.cache_hits(jfn) == hits + 1
    with torch.autograd.graph.save_on_cpu():  # a module under PyTorch's offloading hooks
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
        jitted = fulmen.jit(copy.deepcopy(model), executors=["torch"])
        x = torch.randn(5, 3, dtype=torch.float64)
        model(x).sum().backward()
        jitted(x).sum().backward()
    for p, q in zip(model.parameters(), jitted.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def _marks_its_input(x):
    x.requires_grad_()
    return (x * x).sum()


def test_requires_grad_on_an_input_is_refused_naming_the_line():
    """``x.requires_grad_()`` on an input changes the caller's tensor in eager (its ``.grad`` fills on backward);
    the compiled program left it unchanged, so ``x.grad`` silently stayed None. It is refused, naming the line."""
    with pytest.raises(NotImplementedError, match=r"requires_grad_\(True\) on an input(.|\n)*x\.requires_grad_\(\)"):
        fulmen.jit(_marks_its_input, executors=["torch"])(torch.arange(3.0))
    x = torch.arange(3.0, requires_grad=True)  # the flag it already has: nothing changes, as in eager
    fulmen.jit(_marks_its_input, executors=["torch"])(x).backward()
    torch.testing.assert_close(x.grad, 2 * x.detach())


def _turns_grad_off(x):
    torch.set_grad_enabled(False)
    return x * 2


def test_grad_mode_left_changed_for_the_caller_is_refused():
    """``torch.set_grad_enabled(False)`` called as a function leaves grad mode off for the caller in eager; a cache
    hit did not, so a later call's result silently required grad. It is refused, and grad mode is left as it was."""
    jfn = fulmen.jit(_turns_grad_off, executors=["torch"])
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(NotImplementedError, match="turns grad mode off for its caller"):
        jfn(x)
    assert torch.is_grad_enabled()
    with torch.set_grad_enabled(False):  # the `with` form restores the mode: compiled as usual
        torch.testing.assert_close(fulmen.jit(lambda a: a * 2, executors=["torch"])(x), x * 2)


def _forces(pos, w):  # an energy's gradient taken inside the function, as molecular-dynamics code does
    with torch.enable_grad():
        energy = ((pos @ w) ** 2).sum()
        (grad,) = torch.autograd.grad(energy, w, create_graph=True)
    return energy, -grad


def _steps_inside(x, w):
    loss = (x @ w).sum()
    loss.backward()
    return loss


@pytest.mark.parametrize(
    "fn, what", [(_forces, r"torch\.autograd\.grad\(\)"), (_steps_inside, r"Tensor\.backward\(\)")]
)
def test_differentiating_inside_the_function_is_refused_naming_the_line(fn, what):
    """``torch.autograd.grad`` / ``backward()`` inside a compiled function ran on fake tensors and failed with
    PyTorch's "appears to not have been used in the graph" or "does not require grad"; now a clear error names
    the call and the ways out."""
    with pytest.raises(NotImplementedError, match=what + r" inside a function fulmen compiles(.|\n)*at File"):
        fulmen.jit(fn, executors=["torch"])(torch.randn(4, 3), torch.randn(3, 3, requires_grad=True))
