"""Seed 003, ported: a ``torch.library`` custom softmax with a registered autograd formula, through fulmen.

Run it as a script (``python examples/custom_ops.py``). fulmen needs no registration of its own:
the custom op is recorded as one call (``torch.ops.lynx_cortex.softmax.default``) whose shapes come from the
op's fake implementation, and its gradient is the op's own ``setup_context`` / ``backward``, traced into
fulmen's backward trace. It asserts what the lab asks for: forward and backward within 1e-6 of
``torch.softmax`` in float32, ``gradcheck`` passing in float64 through ``fulmen.jit``, the op staying one
call in the execution trace, and ``torch.compile(model, backend="fulmen")`` matching eager gradients.
"""

import torch
from torch.library import custom_op, register_autograd

import fulmen


# Part A -- the forward and backward as plain functions
def softmax_forward(x: torch.Tensor) -> torch.Tensor:
    m = x.max(dim=-1, keepdim=True).values
    e = (x - m).exp()
    return e / e.sum(dim=-1, keepdim=True)


def softmax_backward(grad_out: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return s * (grad_out - (s * grad_out).sum(dim=-1, keepdim=True))


# Part B -- registered as a custom op (a second import of this file must not define it again)
if "lynx_cortex::softmax" in getattr(torch._library.custom_ops, "OPDEFS", {}):
    softmax_custom = torch._library.custom_ops.OPDEFS["lynx_cortex::softmax"]
else:
    @custom_op("lynx_cortex::softmax", mutates_args=())
    def softmax_custom(x: torch.Tensor) -> torch.Tensor:
        return softmax_forward(x)

    @softmax_custom.register_fake
    def _(x):
        return torch.empty_like(x)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)  # save s, not x

    def backward(ctx, grad_out):
        (s,) = ctx.saved_tensors
        return softmax_backward(grad_out, s)

    register_autograd(softmax_custom, backward, setup_context=setup_context)


def model(x, W, b):
    h = torch.nn.functional.linear(x, W, b)
    return softmax_custom(h)


def reference(x, W, b):
    return torch.softmax(torch.nn.functional.linear(x, W, b), dim=-1)


def grads_of(fn, *args):
    args = [a.detach().clone().requires_grad_() for a in args]
    out = fn(*args)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)  # not just .sum(): its
    (out * weights).sum().backward()  # gradient through softmax is exactly zero
    return out.detach(), [a.grad for a in args]


def check_float32() -> str:
    """Part D through fulmen.jit: forward and backward against torch.softmax."""
    torch.manual_seed(1)
    x, W, b = torch.randn(8, 64), torch.randn(600, 64) / 8, torch.randn(600)
    jmodel = fulmen.jit(model)
    out, grads = grads_of(jmodel, x, W, b)
    ref_out, ref_grads = grads_of(reference, x, W, b)
    forward_err = (out - ref_out).abs().max().item()
    backward_err = max((g - r).abs().max().item() for g, r in zip(grads, ref_grads))
    assert forward_err < 1e-6, forward_err
    assert backward_err < 1e-6, backward_err
    print(f"float32 forward max-err {forward_err:.2e}, backward max-err {backward_err:.2e}")

    forward_trace = str(fulmen.last_traces(jmodel)[-1])
    backward_trace = str(fulmen.last_backward_traces(jmodel)[-1])
    calls = [ln for ln in forward_trace.splitlines() if "torch.ops.lynx_cortex.softmax.default(" in ln
             and not ln.strip().startswith("#")]
    assert len(calls) == 1, forward_trace  # the op stays one call
    assert "lynx_cortex" not in backward_trace and "autograd_vjp" not in backward_trace, backward_trace
    return forward_trace


def check_gradcheck() -> None:
    """Part C through fulmen.jit, in float64."""
    torch.manual_seed(0)
    jmodel = fulmen.jit(model)
    x = torch.randn(2, 16, dtype=torch.float64, requires_grad=True)
    W = torch.randn(24, 16, dtype=torch.float64, requires_grad=True)
    b = torch.randn(24, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(jmodel, (x, W, b), eps=1e-6, atol=1e-5)
    xs = torch.randn(2, 64, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fulmen.jit(softmax_custom), (xs,), eps=1e-6, atol=1e-5)
    print("gradcheck: True")


def check_torch_compile() -> None:
    """Part E with fulmen as the torch.compile backend; gradients against eager."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fulmen")
    torch.manual_seed(2)
    x, W, b = torch.randn(2, 64), torch.randn(600, 64) / 8, torch.randn(600)
    for _ in range(2):  # a second run must not raise (nor recompile into something else)
        out, grads = grads_of(compiled, x, W, b)
    ref_out, ref_grads = grads_of(model, x, W, b)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    print("torch.compile(backend='fulmen'):", tuple(out.shape), f"{out.sum().item():.4f}")


if __name__ == "__main__":
    print(check_float32())
    check_gradcheck()
    check_torch_compile()
    print("OK")
