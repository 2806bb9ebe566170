"""What user code reads from a traced tensor is what eager gives it: the same type and the same value.

A function records ``(type(v), v)`` for every attribute and cheap method of ``torch.Tensor`` that user code commonly
branches on, for an input, an intermediate and a view, across layouts (contiguous, transposed, channels_last,
expanded, offset into its storage), dtypes, ``requires_grad`` on and off, and grad mode on and off; the jitted
function must record exactly what the eager one does. A value fulmen cannot know while tracing (``.grad``,
``data_ptr()``, the storage) must raise a clear error naming the attribute and the user's line instead.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import fulmen

CL = torch.channels_last


def _tensor_facts(t: torch.Tensor) -> tuple:
    """A tensor-valued attribute (``x.data``, ``x.T``) is compared by what user code reads from it."""
    return (
        "tensor",
        isinstance(t, torch.Tensor),
        tuple(t.shape),
        t.stride(),
        t.dtype,
        t.device,
        t.requires_grad,
        t.is_leaf,
        t.grad_fn is None,
    )


def _device_facts(d: torch.device) -> tuple:
    return (
        type(d),
        d,
        d.type,
        d.index,
        str(d),
        repr(d),
        f"{d}",
        hash(d) == hash(torch.device(str(d))),
        pickle.loads(pickle.dumps(d)),
        copy.deepcopy(d),
        torch.device(d),
        d == torch.device("cpu"),
        {torch.device("cpu"): "cpu"}.get(d),
        type(d) is torch.device,
    )


#: attribute -> how user code reads it
READS = {
    "device": lambda t: _device_facts(t.device),
    "device-of-get_device": lambda t: t.get_device(),
    "torch.device(device)": lambda t: _device_facts(torch.device(t.device)),
    "torch.device(device.type)": lambda t: _device_facts(torch.device(t.device.type)),
    "new tensor's device": lambda t: _device_facts(torch.zeros(1, device=t.device).device),
    "dtype": lambda t: t.dtype,
    "dtype.is_floating_point": lambda t: t.dtype.is_floating_point,
    "dtype.itemsize": lambda t: t.dtype.itemsize,
    "layout": lambda t: t.layout,
    "shape": lambda t: t.shape,
    "size()": lambda t: t.size(),
    "size(-1)": lambda t: t.size(-1),
    "stride()": lambda t: t.stride(),
    "stride(1)": lambda t: t.stride(1),
    "ndim": lambda t: t.ndim,
    "dim()": lambda t: t.dim(),
    "ndimension()": lambda t: t.ndimension(),
    "is_cuda": lambda t: t.is_cuda,
    "is_cpu": lambda t: t.is_cpu,
    "is_meta": lambda t: t.is_meta,
    "is_sparse": lambda t: t.is_sparse,
    "is_sparse_csr": lambda t: t.is_sparse_csr,
    "is_quantized": lambda t: t.is_quantized,
    "is_mkldnn": lambda t: t.is_mkldnn,
    "is_nested": lambda t: t.is_nested,
    "is_xpu": lambda t: t.is_xpu,
    "is_mps": lambda t: t.is_mps,
    "is_leaf": lambda t: t.is_leaf,
    "requires_grad": lambda t: t.requires_grad,
    "grad_fn is None": lambda t: t.grad_fn is None,
    "names": lambda t: t.names,
    "data": lambda t: _tensor_facts(t.data),
    "detach()": lambda t: _tensor_facts(t.detach()),
    "T": lambda t: _tensor_facts(t.T) if t.ndim == 2 else None,
    "mT": lambda t: _tensor_facts(t.mT),
    "mH": lambda t: _tensor_facts(t.mH),
    "itemsize": lambda t: t.itemsize,
    "element_size()": lambda t: t.element_size(),
    "nbytes": lambda t: t.nbytes,
    "numel()": lambda t: t.numel(),
    "nelement()": lambda t: t.nelement(),
    "len()": lambda t: len(t),
    "storage_offset()": lambda t: t.storage_offset(),
    "is_contiguous()": lambda t: t.is_contiguous(),
    "is_contiguous(channels_last)": lambda t: t.is_contiguous(memory_format=CL),
    "is_floating_point()": lambda t: t.is_floating_point(),
    "is_complex()": lambda t: t.is_complex(),
    "is_signed()": lambda t: t.is_signed(),
    "is_conj()": lambda t: t.is_conj(),
    "is_neg()": lambda t: t.is_neg(),
    "is_inference()": lambda t: t.is_inference(),
    "type()": lambda t: t.type(),
    "isinstance Tensor": lambda t: (isinstance(t, torch.Tensor), torch.is_tensor(t)),
    "__class__ is subclass of Tensor": lambda t: issubclass(t.__class__, torch.Tensor),
    "retains_grad": lambda t: t.retains_grad,
    "is_shared()": lambda t: t.is_shared(),
    "is_pinned()": lambda t: t.is_pinned(),
    "dim_order()": lambda t: t.dim_order(),
}


#: what fulmen cannot know while tracing: refused with an error naming the attribute and the user's line
REFUSED = {"storage_offset()": "Tensor.storage_offset()"}


def _read_all(t: torch.Tensor) -> dict:
    seen = {}
    for name, read in READS.items():
        try:
            v = read(t)
        except Exception as e:  # noqa: BLE001 - recorded and compared with eager's
            v = ("raises", type(e).__name__, str(e))
        seen[name] = (type(v), v)
    return seen


def _comparable(seen: tuple) -> tuple:
    kind, v = seen  # an error is compared by its type: fulmen's messages name the traced tensor
    return (kind, v[:2]) if kind is tuple and v[:1] == ("raises",) else seen


def _refused_clearly(name: str, seen: tuple) -> bool:
    kind, v = seen
    return (
        name in REFUSED
        and kind is tuple
        and v[:2] == ("raises", "NotImplementedError")
        and REFUSED[name] in v[2]
        and f"{__file__}" in v[2]
    )


def _input(layout: str, dtype: torch.dtype, requires_grad: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    base = (
        torch.randn(40, generator=g).to(dtype)
        if dtype.is_floating_point or dtype.is_complex
        else torch.randint(0, 5, (40,), generator=g).to(dtype)
    )
    if layout == "contiguous":
        x = base[:24].reshape(2, 3, 2, 2).clone()
    elif layout == "transposed":  # not a view: eager gives views of a view its base's requires_grad under no_grad
        x = base[:24].reshape(2, 2, 3, 2).transpose(1, 2).clone()
    elif layout == "channels_last":
        x = base[:24].reshape(2, 3, 2, 2).clone().contiguous(memory_format=CL)
    elif layout == "expanded":
        x = base[:6].reshape(1, 3, 1, 2).clone()
    else:  # "offset": a view into the middle of its storage
        x = base.clone()
    x.requires_grad_(requires_grad)
    if layout == "expanded":
        x = x.expand(2, 3, 2, 2)  # with requires_grad: an input that is not a leaf
    elif layout == "offset":
        x = x[4:28].view(2, 3, 2, 2)
    return x


def _program(which: str, grad_enabled: bool):
    def f(x, seen):
        with torch.set_grad_enabled(grad_enabled):
            t = {"input": lambda: x, "intermediate": lambda: x * 2, "view": lambda: x.transpose(0, 1)}[which]()
            seen.update(_read_all(t))
            return t * 1

    return f


def _compare(layout, dtype, requires_grad, which, grad_enabled):
    f = _program(which, grad_enabled)
    eager: dict = {}
    f(_input(layout, dtype, requires_grad), eager)
    traced: dict = {}
    fulmen.jit(lambda x: f(x, traced), executors=["torch"])(_input(layout, dtype, requires_grad))
    assert traced.keys() == eager.keys()
    wrong = {
        k: (traced[k], eager[k])
        for k in eager
        if _comparable(traced[k]) != _comparable(eager[k]) and not _refused_clearly(k, traced[k])
    }
    assert not wrong, "\n".join(f"{k}: fulmen {t!r} / eager {e!r}" for k, (t, e) in wrong.items())


@pytest.mark.parametrize("grad_enabled", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("requires_grad", [False, True], ids=["plain", "requires_grad"])
@pytest.mark.parametrize("which", ["input", "intermediate", "view"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "channels_last", "expanded", "offset"])
def test_attributes_match_eager_across_layouts(layout, which, requires_grad, grad_enabled):
    _compare(layout, torch.float32, requires_grad, which, grad_enabled)


@pytest.mark.parametrize("which", ["input", "intermediate"])
@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.bfloat16, torch.complex64, torch.int64, torch.int8, torch.uint8, torch.bool], ids=str
)
def test_attributes_match_eager_across_dtypes(dtype, which):
    _compare("contiguous", dtype, False, which, True)


def _jit(fn):
    return fulmen.jit(fn, executors=["torch"])


def test_branch_on_device_type_takes_eagers_branch():
    def f(x):
        a = x * 2 if isinstance(x.device, torch.device) else x * 3
        b = a + 1 if type(x.device) is torch.device and x.device == torch.device("cpu") else a - 1
        return b + {torch.device("cpu"): 10.0}.get(x.device, 20.0)

    x = torch.ones(2)
    torch.testing.assert_close(_jit(f)(x), f(x))


def test_returned_devices_are_torch_devices():
    def f(x):
        return x + 1, x.device, {"device": torch.device(x.device), "type": x.device.type}

    x = torch.ones(2)
    jf = _jit(f)
    for _ in range(2):  # the first call (traced) and a cache hit
        _, dev, extra = jf(x)
        assert type(dev) is torch.device and dev == x.device
        assert type(extra["device"]) is torch.device and extra == {"device": x.device, "type": "cpu"}
        assert pickle.loads(pickle.dumps(dev)) == dev


class _Holder:
    def __init__(self, t):
        self.t = t
        self.device = t.device


def test_device_kept_in_a_returned_object_is_a_torch_device():
    def f(x):
        return _Holder(x * 2)

    out = _jit(f)(torch.ones(2))
    assert type(out.device) is torch.device and out.device == torch.device("cpu")
    torch.testing.assert_close(out.t, torch.full((2,), 2.0))


def test_requires_grad_of_values_made_under_no_grad_takes_eagers_branch():
    def f(x):
        with torch.no_grad():
            y = x * 2
            v = x.t()
        a = y * 3 if y.requires_grad else y * 5  # eager: y does not require grad
        b = v * 7 if v.requires_grad and v.is_leaf and v.grad_fn is None else v * 13  # eager: a leaf that does
        return (a * x).sum() + (b.t() * x).sum()

    x = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    expected = f(x)
    (g_eager,) = torch.autograd.grad(expected, x)
    got = _jit(f)(x)
    (g_fulmen,) = torch.autograd.grad(got, x)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(g_fulmen, g_eager)


@pytest.mark.parametrize(
    "read, what",
    [
        (lambda x: x.data_ptr(), "Tensor.data_ptr()"),
        (lambda x: x.untyped_storage(), "Tensor.untyped_storage()"),
        (lambda x: x.storage(), "Tensor.storage()"),
        (lambda x: x.storage_offset(), "Tensor.storage_offset()"),
        (lambda x: (x * 2).grad_fn.name(), "Tensor.grad_fn.name"),
    ],
    ids=["data_ptr", "untyped_storage", "storage", "storage_offset", "grad_fn.name"],
)
def test_values_unknown_while_tracing_raise_naming_the_line(read, what):
    def f(x):
        read(x)
        return x + 1

    with pytest.raises(NotImplementedError) as info:
        _jit(f)(torch.ones(2, requires_grad=True))
    assert what in str(info.value) and __file__ in str(info.value)


def test_executor_checker_sees_devicetype_and_user_code_a_torch_device():
    from fulmen.core.devices import DeviceType
    from fulmen.extend import OperatorExecutor

    seen = []
    ex = OperatorExecutor("devicetype_checker_ex", version="0.1")

    def checker(a, b):
        seen.append(a.device.devicetype == DeviceType.CPU and a.device == torch.device("cpu"))
        return False  # the torch executor runs it

    ex.register_implementation(
        fulmen.torch.mul, op=ex.register_operator("dt_mul", like=fulmen.torch.mul, fn=torch.mul), checker=checker
    )

    def f(x):
        y = x * x
        return y + (1.0 if type(y.device) is torch.device else 2.0)

    x = torch.ones(2)
    torch.testing.assert_close(fulmen.jit(f, executors=[ex, "torch"])(x), f(x))
    assert seen and all(seen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", 0], ids=["cuda", "cuda:0", "ordinal"])
def test_cuda_devices_match_eager(spec):
    def f(x, seen):
        seen.append(_device_facts(x.device))
        y = torch.zeros(2, device=spec) + x
        seen.append(_device_facts(y.device))
        seen.append((x.get_device(), x.is_cuda, x.type()))
        return y

    x = torch.ones(2, device="cuda")
    eager: list = []
    traced: list = []
    expected = f(x, eager)
    got = _jit(lambda t: f(t, traced))(x)
    assert traced == eager
    torch.testing.assert_close(got, expected)


VIEWS_CHANGING_NOTHING = {
    "view": lambda x: x.view(x.shape),
    "reshape": lambda x: x.reshape(x.shape),
    "squeeze": lambda x: x.squeeze(),
    "expand": lambda x: x.expand(x.shape),
    "permute": lambda x: x.permute(0, 1),
    "transpose": lambda x: x.transpose(0, 0),
    "narrow": lambda x: x.narrow(0, 0, x.shape[0]),
    "chunk": lambda x: x.chunk(1)[0],
    "flatten": lambda x: x.flatten(1, 1),  # eager returns the input itself here
    "getitem_all": lambda x: x[:],
    "getitem_ellipsis": lambda x: x[...],
    "getitem_full_slices": lambda x: x[0:3, ::1],
    # eager returns the input itself for these: under no_grad the result keeps x's history
    "contiguous": lambda x: x.contiguous(),
    "conj_of_real": lambda x: x.conj(),
    "conj_physical_of_real": lambda x: torch.conj_physical(x),
    "resolve_conj": lambda x: x.resolve_conj(),
    "resolve_neg": lambda x: x.resolve_neg(),
    # ops without a rule of their own (run as one opaque op) that eager answers with the input itself
    "atleast_2d": lambda x: torch.atleast_2d(x),
    "sum_to_size": lambda x: x.sum_to_size(x.shape),
    "alpha_dropout_eval": lambda x: torch.nn.functional.alpha_dropout(x, 0.5, training=False),
}


@pytest.mark.parametrize("view", VIEWS_CHANGING_NOTHING.values(), ids=VIEWS_CHANGING_NOTHING.keys())
def test_view_changing_nothing_is_a_new_tensor_as_in_eager(view):
    def f(x, seen):
        seen.append(view(x) is x)
        with torch.no_grad():
            v = view(x)  # eager: a new tensor, a leaf through which no gradient reaches x (unless it is x)
        return (v * 7 * x).sum()

    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    eager: list = []
    traced: list = []
    expected = f(x, eager)
    (g_eager,) = torch.autograd.grad(expected, x)
    got = _jit(lambda t: f(t, traced))(x)
    (g_fulmen,) = torch.autograd.grad(got, x)
    assert traced == eager
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(g_fulmen, g_eager)


def _resolved_copy_written(z):
    w = z * 2
    r = w.conj().resolve_conj()  # a new tensor: writing it leaves w alone
    r.add_(1)
    n = w.conj().imag.resolve_neg()  # the same for a lazy negative
    n.mul_(3)
    return w, r, n, r is w


def _contiguous_written(x):
    w = x * 2
    c = w.contiguous()  # w itself: a write through it is a write to w
    c.add_(1)
    t = w.t().contiguous()  # a copy
    t.add_(1)
    return w, c, t, c is w


@pytest.mark.parametrize(
    "program, dtype", [(_resolved_copy_written, torch.complex128), (_contiguous_written, torch.float64)]
)
def test_resolving_ops_return_the_input_or_a_copy_as_eager_does(program, dtype):
    z = torch.randn(3, 2, dtype=dtype, requires_grad=True)
    expected = program(z)
    got = _jit(program)(z)
    assert got[-1] == expected[-1]
    for g, e in zip(got[:-1], expected[:-1]):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
        assert g.stride() == e.stride() and g.requires_grad == e.requires_grad
    weights = [torch.randn(e.shape, dtype=e.dtype) for e in expected[:-1]]
    (g_eager,) = torch.autograd.grad(sum((e * w).real.sum() for e, w in zip(expected[:-1], weights)), z)
    (g_fulmen,) = torch.autograd.grad(sum((g * w).real.sum() for g, w in zip(got[:-1], weights)), z)
    torch.testing.assert_close(g_fulmen, g_eager)


def _contiguous_under_no_grad(x):
    v = x[:, :2]
    w = x.t() * 2
    with torch.no_grad():  # eager: x itself for a contiguous tensor (its history kept), else a copy (none)
        y, z, u = v.contiguous(), w.contiguous(), x.contiguous()
    return (y * v).sum() + (z * w).sum() + (u * x).sum(), y is v, z is w, u is x


def _check_contiguous_under_no_grad(shapes):
    jitted = fulmen.jit(_contiguous_under_no_grad, executors=["torch"], dynamic=True)
    for shape in shapes:
        x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        expected, got = _contiguous_under_no_grad(x), jitted(x)
        assert got[1:] == expected[1:]
        (g_eager,) = torch.autograd.grad(expected[0], x)
        (g_fulmen,) = torch.autograd.grad(got[0], x)
        torch.testing.assert_close(g_fulmen, g_eager)


def test_contiguous_under_no_grad_with_changing_sizes_is_eager_s():
    _check_contiguous_under_no_grad([(3, 4), (5, 4), (4, 3)])


def test_contiguous_of_a_contiguous_view_with_symbolic_sizes():
    # a view's strides are unknown with symbolic sizes, so contiguous() would copy where eager returns the view: the
    # symbolic trace records another program than the exact one, and the sizes stay exact (same_program)
    _check_contiguous_under_no_grad([(3, 4), (3, 2), (5, 2)])
