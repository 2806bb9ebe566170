"""Generated code cannot be hijacked through a value's repr or a type's name, and its names are unique.

Every payload here is harmless: it appends to a list that the test then checks is still empty.
"""

import builtins
import collections
import enum

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.core.codeutils import Printer, sanitize_name

_RAN: list = []
builtins._fulmen_test_payload_ran = _RAN  # what the payloads reach through __import__('builtins')
_PAYLOAD = "__import__('builtins')._fulmen_test_payload_ran.append(1)"


@pytest.fixture(autouse=True)
def _no_payload_ran():
    _RAN.clear()
    yield
    assert _RAN == [], "text from a user object's repr or __name__ ran as code"


def _jit(fn):
    return fulmen.jit(fn, executors=["torch"])


def _source(jf) -> str:
    return str(fulmen.last_traces(jf)[-1])


def _code_lines(source: str) -> list[str]:
    return [ln for ln in source.splitlines() if ln.strip() and not ln.strip().startswith("#")]


class _EvilInt(int):
    def __repr__(self):
        return f"({_PAYLOAD} or 3)"

    __str__ = __repr__


class _EvilFloat(float):
    def __repr__(self):
        return f"({_PAYLOAD} or 3.0)\nimport os"


class _EvilStr(str):
    def __repr__(self):
        return f"({_PAYLOAD} or 'none')"


def test_int_subclass_repr_is_not_code():
    x = torch.randn(5)
    jf = _jit(lambda x, n: x * n)
    torch.testing.assert_close(jf(x, _EvilInt(2)), x * 2)
    assert not any("_fulmen_test_payload_ran" in ln for ln in _code_lines(_source(jf)))


def test_float_subclass_repr_with_newline_stays_in_comment():
    x = torch.randn(5)
    jf = _jit(lambda x, s: x + s)
    torch.testing.assert_close(jf(x, _EvilFloat(0.5)), x + 0.5)
    source = _source(jf)
    assert not any("import os" in ln or "_fulmen_test_payload_ran" in ln for ln in _code_lines(source))
    compile(source, "<printed trace>", "exec")  # the printed trace is still one valid program


def test_str_subclass_repr_is_not_code():
    x = torch.randn(5)
    jf = _jit(lambda x, a: F.gelu(x, approximate=a))
    torch.testing.assert_close(jf(x, _EvilStr("tanh")), F.gelu(x, approximate="tanh"))


def test_namedtuple_with_crafted_name():
    Pair = collections.namedtuple("Pair", ["a", "b"])
    Pair.__name__ = Pair.__qualname__ = f"x; {_PAYLOAD}; y"
    x = torch.randn(4)
    out = _jit(lambda x: Pair(x + 1, x * 2))(x)
    assert type(out) is Pair
    torch.testing.assert_close(out.a, x + 1)
    torch.testing.assert_close(out.b, x * 2)


def test_structseq_lookalike_is_not_looked_up_by_name():
    # a tuple class claiming to live in torch.return_types, under a name that is code
    Fake = collections.namedtuple("Fake", ["values", "indices"])
    Fake.__module__ = "torch.return_types"
    Fake.__name__ = f"max(({_PAYLOAD}, 0)) or torch.return_types.max"
    x = torch.randn(3, 4)

    def f(x):
        v, i = torch.max(x, 1)
        return Fake(v, i)

    out = _jit(f)(x)
    assert type(out) is Fake
    ref = torch.max(x, 1)
    torch.testing.assert_close(out.values, ref.values)
    torch.testing.assert_close(out.indices, ref.indices)


def test_autograd_function_with_crafted_name():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 3  # deliberately not the true derivative: proves the user's backward runs

    Double.__name__ = Double.__qualname__ = f"x({_PAYLOAD}); y"
    x = torch.randn(4, requires_grad=True)
    out = _jit(lambda x: Double.apply(x) + 1)(x)
    out.sum().backward()
    torch.testing.assert_close(out, x.detach() * 2 + 1)
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))


class _Color(enum.IntEnum):
    RED = 1
    GREEN = 2


class _Perm(enum.IntFlag):
    R = 1
    W = 2


class _Reduction(str, enum.Enum):
    SUM = "sum"
    MEAN = "mean"


def test_int_enum_and_int_flag_scalars_match_eager():
    x = torch.randn(3, 4)

    def f(x, n, dim):
        return x * n, x.sum(dim)

    for n, dim in ((_Color.GREEN, _Color.RED), (_Perm.R | _Perm.W, _Perm.R)):
        got = _jit(f)(x, n, dim)
        want = f(x, n, dim)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


def test_str_enum_argument_matches_eager():
    x, y = torch.randn(6), torch.randn(6)

    def f(x, y, reduction):
        return F.mse_loss(x, y, reduction=reduction)

    for r in _Reduction:
        torch.testing.assert_close(_jit(f)(x, y, r), f(x, y, r))


def test_int_enum_gradient_matches_eager():
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(_jit(lambda x, n: (x ** n).sum())(x, _Color.GREEN), x)
    torch.testing.assert_close(gx, 2 * x.detach())


def test_namedtuple_with_space_in_its_name():
    Base = collections.namedtuple("Base", ["a", "b"])
    MyPoint = type("My Point", (Base,), {"__slots__": ()})
    Renamed = collections.namedtuple("Renamed", ["a", "def", "a"], rename=True)  # fields a, _1, _2
    x = torch.randn(3)
    p = _jit(lambda x: MyPoint(x + 1, x - 1))(x)
    assert type(p) is MyPoint
    torch.testing.assert_close(tuple(p), (x + 1, x - 1))
    r = _jit(lambda x: Renamed(x, x * 2, x * 3))(x)
    assert type(r) is Renamed
    torch.testing.assert_close(tuple(r), (x, x * 2, x * 3))


def test_namedtuple_argument_with_space_in_its_name():
    MyPoint = type("My Point", (collections.namedtuple("Base", ["a", "b"]),), {"__slots__": ()})
    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(_jit(lambda p: p.a * p.b)(MyPoint(x, y)), x * y)


# ---- names ----

def test_names_are_unique_after_nfkc_normalisation():
    # "ｔ0" (fullwidth t) is the identifier t0 to Python, the name of the first value tracing makes
    a, b = torch.randn(3), torch.randn(3)

    def f(x, **kw):
        return x + 1, kw["ｔ0"]

    got = _jit(f)(a, **{"ｔ0": b})
    torch.testing.assert_close(got[0], a + 1)
    torch.testing.assert_close(got[1], b)


def test_two_spellings_of_one_identifier_stay_two_inputs():
    a, b = torch.randn(3), torch.randn(3)

    def f(**kw):
        return kw["ｘ"] - kw["x"]

    torch.testing.assert_close(_jit(f)(**{"ｘ": a, "x": b}), a - b)


def test_argument_named_like_a_constant_is_not_shadowed():
    x = torch.randn(3)
    p = Printer({})
    constant = p.constant(_Color.GREEN, "color")  # the name the printer gives the first IntEnum constant

    def f(x, n, **kw):
        return kw[constant] * n + x

    got = _jit(f)(x, _Color.GREEN, **{constant: x * 10})
    torch.testing.assert_close(got, x * 10 * 2 + x)


@pytest.mark.parametrize("name", ["torchex", "_", "torch", "inf", "len", "computation"])
def test_argument_named_like_a_global_of_generated_code(name):
    x, y = torch.randn(3), torch.randn(3)

    def f(x, **kw):
        a, b = torch.max(x.reshape(3, 1), 1)  # one output unused: printed as "_"
        return kw[name] * 2 + a

    torch.testing.assert_close(_jit(f)(x, **{name: y}), y * 2 + x)


def test_sanitize_name():
    assert sanitize_name("ｔ0") == "t0"
    assert sanitize_name("ﬁle") == "file"
    assert sanitize_name("My Point") == "My_Point"
    assert sanitize_name("①") == "_1"
    assert sanitize_name("class") == "class_"
    assert sanitize_name("print") == "print_"
    for raw in ("ｔ0", "a\u0301", "x.y", "名前", "①②", "__import__('os')"):
        name = sanitize_name(raw)
        assert name.isidentifier() and name == __import__("unicodedata").normalize("NFKC", name)


def test_arguments_named_like_size_symbols_with_dynamic_sizes():
    # traces with dynamic sizes bind ShapeEnv's symbols (s0, s1, ...) as locals: no input may take their names
    names = [f"s{i}" for i in range(100)] + ["u0", "u1", "zf0"]
    kw = {n: torch.randn(2 + i % 3) for i, n in enumerate(names)}

    def f(**kw):
        out = torch.zeros(())
        for v in kw.values():
            out = out + v.sum() * v.shape[0]
        return out

    got = fulmen.jit(f, executors=["torch"], dynamic=True)(**kw)
    torch.testing.assert_close(got, f(**kw))
    assert sanitize_name("s0") == "s0_" and sanitize_name("u12") == "u12_" and sanitize_name("s0x") == "s0x"
