"""Differential fuzzing: random small programs run by eager PyTorch and by ``fulmen.jit``, compared.

A program is a list of statements over a pool of values (inputs and earlier results), generated from a seed
so it is reproducible, and printed as a self-contained Python script::

    from fulmen.fuzz import generate, check
    program = generate(seed=3)
    print(program.script())          # the reproducer
    mismatch = check(program, executors="torch")   # None when fulmen agrees with eager

``check`` compares, for the first call (trace and compile) and a second (cache hit): outputs (values, NaN
positions, shapes, dtypes, requires_grad), the inputs after the call (in-place writes), gradients of the
inputs (and parameters, for a module) and errors (eager raising where fulmen does not, or the reverse).
Float tolerances depend on the dtype; where fulmen is further from eager than that, it still passes when it
is no further from a float64 run of the same program than eager is (an ill-conditioned program amplifies
rounding differences that neither side can avoid).

``fulmen fuzz --seconds N`` runs it from the command line (``run_fuzz``) and prints a minimized reproducer
(``minimize``, a delta-debugging of the statement list) for each mismatch.
"""

from __future__ import annotations

import collections
import math
import random
import re
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

import torch

_FLOATS = (torch.float32, torch.float64, torch.bfloat16)
_DTYPE_NAMES = {torch.float32: "torch.float32", torch.float64: "torch.float64", torch.bfloat16: "torch.bfloat16",
                torch.int64: "torch.int64", torch.bool: "torch.bool"}
# (rtol, atol) by dtype: a few units in the last place, as two orders of float rounding give
_TOLERANCES = {torch.float64: (1e-7, 1e-7), torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
# the share of statements eager rejects that are kept (ending the program), to check that fulmen raises too
_KEEP_REJECTED = 0.1
# fulmen may be this many times further from the float64 run than eager is (plus the dtype's tolerance)
_REF_MULTIPLIER = 3.0

DEBUG = False
CATEGORIES = ("unary", "binary", "reduction", "view", "inplace", "index", "matmul")


# ---------------------------------------------------------------------------------------------------------------
# Programs
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Input:
    """One argument: made by ``make`` (source text that builds it from the seeded generator)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str = "contiguous"  # or "transposed" (last two dims swapped) or "strided" (every other element)
    requires_grad: bool = False
    param: bool = False  # a parameter of the module form
    high: int = 0  # for an index tensor: values in [0, high)

    def make(self) -> str:
        shape = list(self.shape)
        if self.layout == "transposed" and len(shape) >= 2:
            shape[-1], shape[-2] = shape[-2], shape[-1]
        elif self.layout == "strided" and shape:
            shape[-1] *= 2
        size = repr(tuple(shape))
        if self.high:
            text = f"torch.randint(0, {self.high}, {size})"
        elif self.dtype is torch.int64:
            text = f"torch.randint(-4, 5, {size})"
        elif self.dtype is torch.bool:
            text = f"torch.rand({size}) > 0.5"
        else:
            text = f"torch.randn({size}, dtype={_DTYPE_NAMES[self.dtype]})"
        if self.layout == "transposed" and len(shape) >= 2:
            text = f"({text}).transpose(-1, -2)"
        elif self.layout == "strided" and shape:
            text = f"({text})[..., ::2]"
        if self.requires_grad:
            text = f"({text}).requires_grad_()"
        return text


@dataclass(frozen=True)
class Stmt:
    """``target = expr`` (or a bare statement, ``target`` None); ``uses`` names the values it reads."""

    target: str | None
    expr: str
    uses: tuple[str, ...]
    category: str

    def line(self) -> str:
        return f"{self.target} = {self.expr}" if self.target else self.expr


@dataclass
class Program:
    seed: int
    inputs: list[Input]
    stmts: list[Stmt]
    outputs: list[str]
    grad: bool = True  # run with grad mode on
    module: bool = False  # run as an nn.Module whose ``param`` inputs are parameters

    def args(self) -> list[Input]:
        return [i for i in self.inputs if not (self.module and i.param)]

    def params(self) -> list[Input]:
        return [i for i in self.inputs if self.module and i.param]

    def body(self, indent: str = "    ") -> list[str]:
        lines = [indent + s.line() for s in self.stmts]
        outs = ", ".join(self.outputs)
        lines.append(f"{indent}return ({outs},)" if len(self.outputs) == 1 else f"{indent}return {outs}")
        return lines

    def source(self) -> str:
        """The program as Python source: ``def program(...)``, or a ``Program`` module for the module form."""
        if not self.module:
            head = f"def program({', '.join(i.name for i in self.inputs)}):"
            return "\n".join([head, *self.body()]) + "\n"
        params = self.params()
        lines = ["class Program(torch.nn.Module):",
                 f"    def __init__(self, {', '.join(p.name for p in params)}):",
                 "        super().__init__()"]
        lines += [f"        self.{p.name} = torch.nn.Parameter({p.name}, requires_grad={p.requires_grad})"
                  for p in params]
        lines.append(f"    def forward(self, {', '.join(i.name for i in self.args())}):")
        lines += [f"        {p.name} = self.{p.name}" for p in params]
        lines += self.body("        ")
        return "\n".join(lines) + "\n"

    def make_inputs(self) -> str:
        lines = [f"torch.manual_seed({self.seed})"]
        lines += [f"{i.name} = {i.make()}" for i in self.inputs]
        return "\n".join(lines) + "\n"

    def script(self, executors: str = "torch") -> str:
        """A self-contained reproducer: the program, its inputs, and a comparison of fulmen with eager."""
        jit_args = 'executors=["torch"]' if executors == "torch" else 'compile="sync"'
        names = [i.name for i in self.inputs]
        if self.module:
            make = f"Program({', '.join(p.name for p in self.params())})"
            call = ", ".join(i.name for i in self.args())
        else:
            make, call = "program", ", ".join(names)
        grad = "" if self.grad else "@torch.no_grad()\n"
        return (f"# fulmen fuzz reproducer (seed {self.seed}): compare eager with fulmen.jit\n"
                "import torch\nimport fulmen\n\n"
                f"{self.source()}\n"
                f"{grad}def run(use_fulmen):\n"
                f"    {self.make_inputs().strip().replace(chr(10), chr(10) + '    ')}\n"
                f"    compiled = {make}\n"
                f"    compiled = fulmen.jit(compiled, {jit_args}) if use_fulmen else compiled\n"
                f"    result = compiled({call})\n"
                f"    return result, [{', '.join(names)}]\n\n"
                "expected, got = run(False), run(True)\n"
                "print('eager :', expected)\nprint('fulmen:', got)\n")


# ---------------------------------------------------------------------------------------------------------------
# Generation: each candidate statement runs eagerly on sample inputs, so the generator knows every value's shape
# and dtype and keeps only statements eager accepts (a few that eager rejects are kept, to check that fulmen
# rejects them too).
# ---------------------------------------------------------------------------------------------------------------


_UNARY_FLOAT = ["torch.sin({})", "torch.cos({})", "torch.exp({})", "torch.tanh({})", "torch.sigmoid({})",
                "torch.relu({})", "torch.abs({})", "torch.neg({})", "torch.sqrt({})", "torch.log({})",
                "torch.rsqrt({})", "torch.floor({})", "torch.ceil({})", "torch.round({})", "torch.sign({})",
                "torch.reciprocal({})", "torch.square({})", "torch.erf({})", "torch.nn.functional.gelu({})",
                "torch.nn.functional.silu({})", "torch.log1p({})", "torch.expm1({})", "torch.trunc({})",
                "{}.clamp(min=-0.5, max=0.5)", "torch.nan_to_num({})", "{}.float()", "{}.double()",
                "{}.to(torch.bfloat16)", "{}.to(torch.int64)", "{}.bool()", "torch.nn.functional.softplus({})",
                "torch.atan({})", "{}.clone()"]
_UNARY_INT = ["torch.abs({})", "torch.neg({})", "torch.sign({})", "torch.square({})", "torch.bitwise_not({})",
              "{}.float()", "{}.bool()", "{}.clamp(min=-2, max=2)", "{}.to(torch.float64)", "{}.clone()"]
_UNARY_BOOL = ["torch.logical_not({})", "torch.bitwise_not({})", "{}.float()", "{}.long()", "{}.to(torch.int64)"]
_BINARY_ANY = ["{} + {}", "{} - {}", "{} * {}", "torch.maximum({}, {})", "torch.minimum({}, {})", "{} == {}",
               "{} < {}", "{} >= {}", "torch.ne({}, {})", "torch.add({}, {}, alpha=2)"]
_BINARY_FLOAT = ["{} / {}", "torch.atan2({}, {})", "torch.pow({}.abs(), {})", "torch.remainder({}, {})",
                 "torch.nn.functional.mse_loss({}, {})", "torch.hypot({}, {})", "torch.lerp({}, {}, 0.25)",
                 "torch.copysign({}, {})", "torch.fmod({}, {})"]
_BINARY_INT = ["{} & {}", "{} | {}", "{} ^ {}", "torch.bitwise_and({}, {})"]
_SCALARS = ["2", "(-1)", "0.5", "True", "3.0", "(-2.5)"]  # parenthesized: a template may call a method on them


class _Generator:
    def __init__(self, seed: int, max_ops: int):
        self.seed = seed
        self.rng = random.Random(seed)
        self.max_ops = max_ops
        self.inputs: list[Input] = []
        self.stmts: list[Stmt] = []
        self.env: dict[str, Any] = {"torch": torch}
        self.values: list[str] = []  # pool: names of tensor values, inputs first
        self.intermediates: list[str] = []
        self.counter = 0
        self.raises = False  # the last statement makes eager raise
        self.grad = self.rng.random() < 0.75
        self.module = self.rng.random() < 0.2

    # ---- inputs ----
    def shape(self, ndim: int | None = None) -> tuple[int, ...]:
        ndim = self.rng.choice([0, 1, 2, 2, 3, 3, 4]) if ndim is None else ndim
        return tuple(self.rng.choice([1, 2, 3, 4, 5]) for _ in range(ndim))

    def new_input(self, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None,
                  high: int = 0) -> str:
        rng = self.rng
        shape = self.shape() if shape is None else shape
        if dtype is None:
            dtype = rng.choices([torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool],
                                weights=[10, 2, 1.5, 1.5, 1])[0]
        if high:
            dtype = torch.int64
        layout = "contiguous"
        if shape and rng.random() < 0.3:
            layout = rng.choice(["transposed", "strided"]) if len(shape) >= 2 else "strided"
        requires_grad = dtype in _FLOATS and not high and self.grad and rng.random() < 0.7
        param = self.module and requires_grad and rng.random() < 0.6
        name = "abcdefghijklmnopqrstuvwxyz"[len(self.inputs)] if len(self.inputs) < 26 else f"in{len(self.inputs)}"
        inp = Input(name, shape, dtype, layout, requires_grad, param, high)
        self.inputs.append(inp)
        self.env = {"torch": torch, **self.env_after(self.stmts)}
        self.values.append(name)
        return name

    # ---- statements ----
    def fresh(self) -> str:
        self.counter += 1
        return f"v{self.counter}"

    def pick(self, pred: Callable[[torch.Tensor], bool] = lambda t: True, prefer_new: bool = True) -> str | None:
        names = [n for n in self.values if isinstance(self.env.get(n), torch.Tensor) and pred(self.env[n])]
        if not names:
            return None
        if prefer_new and self.rng.random() < 0.6:
            return names[-1] if self.rng.random() < 0.5 else self.rng.choice(names[-3:])
        return self.rng.choice(names)

    def broadcastable(self, a: str) -> str:
        """Another value whose shape broadcasts with ``a``'s, or a new input of such a shape."""
        shape = tuple(self.env[a].shape)
        others = [n for n in self.values if n != a and isinstance(self.env.get(n), torch.Tensor)
                  and _broadcasts(shape, tuple(self.env[n].shape))]
        if others and self.rng.random() < 0.7:
            return self.rng.choice(others)
        k = self.rng.randint(0, len(shape))
        new = tuple(1 if self.rng.random() < 0.3 else s for s in shape[k:])
        if self.rng.random() < 0.15:
            new = (self.rng.choice([1, 2]),) + new if len(new) < 4 else new
        return self.new_input(new, self.env[a].dtype if self.rng.random() < 0.7 else None)

    def statement(self) -> Stmt | None:
        category = self.rng.choices(CATEGORIES, weights=[4, 5, 3, 4, 2.5, 2.5, 1.5])[0]
        return getattr(self, "_" + category)()

    def _unary(self):
        a = self.pick()
        dtype = self.env[a].dtype
        table = _UNARY_FLOAT if dtype in _FLOATS else _UNARY_INT if dtype is torch.int64 else _UNARY_BOOL
        return self.stmt(self.rng.choice(table).format(a), (a,), "unary")

    def _binary(self):
        rng = self.rng
        a = self.pick()
        dtype = self.env[a].dtype
        if rng.random() < 0.25:
            b, uses = rng.choice(_SCALARS), (a,)
        else:
            b = self.broadcastable(a)
            uses = (a, b)
        table = list(_BINARY_ANY)
        if dtype in _FLOATS:
            table += _BINARY_FLOAT
        elif dtype in (torch.int64, torch.bool):
            table += _BINARY_INT
        if rng.random() < 0.15:
            c = self.pick(lambda t: t.dtype is torch.bool)
            if c is not None:
                return self.stmt(f"torch.where({c}, {a}, {b})", (c, *uses), "binary")
        template = rng.choice(table)
        first, second = (a, b) if rng.random() < 0.8 else (b, a)
        return self.stmt(template.format(first, second), uses, "binary")

    def _reduction(self):
        rng = self.rng
        a = self.pick()
        t = self.env[a]
        dim = rng.randrange(-t.ndim, t.ndim) if t.ndim else None
        keep = rng.random() < 0.4
        d = f"dim={dim}, " if dim is not None else ""
        forms = [f"torch.sum({a}, {d}keepdim={keep})" if d else f"torch.sum({a})",
                 f"{a}.amax({d}keepdim={keep})" if d else f"{a}.amax()",
                 f"{a}.amin({d}keepdim={keep})" if d else f"{a}.amin()"]
        if dim is not None:
            forms += [f"{a}.argmax(dim={dim}, keepdim={keep})", f"torch.cumsum({a}, {dim})",
                      f"torch.max({a}, {dim}, keepdim={keep}).values", f"{a}.prod({dim}, keepdim={keep})"]
        if t.dtype in _FLOATS:
            forms += [f"{a}.mean({d}keepdim={keep})" if d else f"{a}.mean()"]
            if dim is not None:
                forms += [f"torch.var({a}, {dim}, keepdim={keep})", f"torch.std({a}, {dim}, correction=0)",
                          f"torch.logsumexp({a}, {dim})", f"torch.softmax({a}, {dim})",
                          f"torch.log_softmax({a}, {dim})", f"{a}.norm(dim={dim})"]
        if t.dtype is torch.bool:
            forms += [f"{a}.any({d}keepdim={keep})" if d else f"{a}.any()",
                      f"{a}.all({d}keepdim={keep})" if d else f"{a}.all()"]
        return self.stmt(rng.choice(forms), (a,), "reduction")

    def _view(self):
        rng = self.rng
        a = self.pick()
        t = self.env[a]
        n, shape = t.ndim, tuple(t.shape)
        forms = [f"{a}.reshape({_factor(t.numel(), rng)})", f"{a}.unsqueeze({rng.randint(-n - 1, n)})",
                 f"{a}.flatten()", f"{a}.view(-1)", f"{a}[None]", f"{a}.contiguous()"]
        if n >= 1:
            d = rng.randrange(n)
            size = shape[d]
            start = rng.randrange(size) if size else 0
            forms += [f"{a}.permute({_perm(n, rng)})", f"{a}.transpose({d}, {rng.randrange(n)})",
                      f"{a}[{':, ' * d}{start}:]", f"{a}[{':, ' * d}::2]", f"{a}.narrow({d}, {start}, "
                      f"{rng.randint(0, size - start)})", f"{a}.squeeze({d})", f"{a}.movedim({d}, {rng.randrange(n)})",
                      f"{a}.expand({', '.join(str(rng.choice([s, 3]) if s == 1 else s) for s in shape)})",
                      f"{a}.expand(2, {', '.join(map(str, shape))})", f"{a}.chunk(2, {d})[0]",
                      f"torch.cat([{a}, {a}], {d})", f"torch.stack([{a}, {a}], {rng.randint(0, n)})",
                      f"{a}.flip({d})", f"{a}.view({_factor(t.numel(), rng)})"]
        if n >= 2:
            forms += [f"{a}.mT", f"{a}.diagonal()", f"{a}[..., {rng.randrange(shape[-1]) if shape[-1] else 0}]"]
        if n == 2:
            forms.append(f"{a}.t()")
        return self.stmt(rng.choice(forms), (a,), "view")

    def _inplace(self):
        rng = self.rng
        on_input = rng.random() < 0.3
        pool = self.values if on_input else self.intermediates
        targets = [n for n in pool if isinstance(self.env.get(n), torch.Tensor)]
        if not targets:
            return None
        a = rng.choice(targets[-4:])
        t = self.env[a]
        b = self.broadcastable(a) if rng.random() < 0.5 else None
        src = b if b is not None else rng.choice(["2", "0.5", "(-1)"])
        uses = (a, b) if b else (a,)
        forms = [f"{a}.add_({src})", f"{a}.mul_({src})", f"{a}.sub_({src}, alpha=2)"]
        if t.ndim:
            forms += [f"{a}[{rng.randrange(t.shape[0]) if t.shape[0] else 0}] = {src}", f"{a}[..., ::2] = {src}",
                      f"{a}[:1] = {src}"]
        if b is not None:
            forms.append(f"{a}.copy_({b})")
        if t.dtype in _FLOATS:
            forms += [f"{a}.clamp_(min=-0.5)", f"{a}.relu_()", f"{a}.sigmoid_()", f"{a}.div_(3)"]
        forms += [f"{a}.zero_()", f"{a}.fill_(2)"]
        form = rng.choice(forms)
        if "=" in form.split("(")[0]:  # an assignment to an element or slice: a bare statement
            return self.stmt(form, uses, "inplace", target=None)
        return self.stmt(form, uses, "inplace")

    def _index(self):
        rng = self.rng
        a = self.pick(lambda t: t.ndim >= 1 and t.numel() > 0)
        if a is None:
            return None
        t = self.env[a]
        d = rng.randrange(t.ndim)
        size = t.shape[d]
        k = rng.randint(1, 4)
        literal = f"torch.tensor({[rng.randrange(size) for _ in range(k)]})"
        forms = [f"{a}[{rng.randrange(-size, size)}]", f"{a}[{literal}]", f"torch.index_select({a}, {d}, {literal})",
                 f"{a}[None, ..., None]", f"{a}[..., {literal}]", f"{a}[{rng.randrange(size)}:, None]"]
        if t.ndim >= 2:
            forms.append(f"{a}[{literal}, {literal}]")
            forms.append(f"{a}[:, {rng.randrange(t.shape[1])}]")
        index_shape = tuple(rng.randint(1, s) if i != d else rng.randint(1, 4) for i, s in enumerate(t.shape))
        idx = self.new_input(index_shape, high=size) if rng.random() < 0.5 else None
        if idx is not None:
            forms += [f"torch.gather({a}, {d}, {idx})", f"{a}.take_along_dim({idx}, {d})" if
                      self.env[idx].shape == tuple(s if i != d else self.env[idx].shape[d]
                                                   for i, s in enumerate(t.shape)) else f"{a}[{idx}]"]
            return self.stmt(rng.choice(forms[-2:]), (a, idx), "index")
        return self.stmt(rng.choice(forms), (a,), "index")

    def _matmul(self):
        rng = self.rng
        a = self.pick(lambda t: t.ndim >= 1 and t.dtype in _FLOATS)
        if a is None:
            return None
        t = self.env[a]
        k = t.shape[-1]
        candidates = [n for n in self.values if n != a and isinstance(self.env.get(n), torch.Tensor)
                      and self.env[n].dtype == t.dtype and self.env[n].ndim >= 1
                      and self.env[n].shape[-2 if self.env[n].ndim >= 2 else -1] == k]
        if candidates and rng.random() < 0.5:
            b = rng.choice(candidates)
        else:
            b = self.new_input((k, rng.randint(1, 5)) if rng.random() < 0.8 else (k,), t.dtype)
        forms = [f"{a} @ {b}", f"torch.matmul({a}, {b})"]
        if self.env[b].ndim == 2:
            forms.append(f"torch.nn.functional.linear({a}, {b}.mT)")
        return self.stmt(rng.choice(forms), (a, b), "matmul")

    def stmt(self, expr: str, uses: tuple[str, ...], category: str, target: str | None = "") -> Stmt:
        if target == "":
            target = self.fresh()
        return Stmt(target, expr, uses, category)

    def try_add(self, stmt: Stmt, n_inputs: int) -> bool:
        """Run the program so far and ``stmt`` eagerly on the sample inputs (forward, and backward in grad mode);
        keep ``stmt`` if eager accepts it, else forget it and the inputs made for it."""
        program = Program(self.seed, self.inputs, [*self.stmts, stmt], [], self.grad)
        env: dict[str, Any] = {"torch": torch, **make_inputs(program)}
        forward = True
        try:
            with warnings.catch_warnings(), torch.set_grad_enabled(self.grad):
                warnings.simplefilter("ignore")
                for s in program.stmts:
                    exec(s.line(), env)
                forward = False
                if self.grad:
                    _sample_backward(env, [s.target for s in program.stmts if s.target],
                                     [i.name for i in self.inputs])
            if stmt.target and not isinstance(env[stmt.target], torch.Tensor):
                raise TypeError("not a tensor")
        except Exception as e:
            if DEBUG:
                print("rejected:", stmt.line(), type(e).__name__, str(e)[:100])
            # kept as the program's last statement: fulmen must raise too
            if forward and not isinstance(e, SyntaxError) and self.rng.random() < _KEEP_REJECTED:
                self.stmts.append(stmt)
                self.raises = True
                return True
            self.forget_inputs(n_inputs)
            return False
        self.env = env
        if stmt.target:
            self.values.append(stmt.target)
            self.intermediates.append(stmt.target)
        self.stmts.append(stmt)
        return True

    def forget_inputs(self, n_inputs: int) -> None:
        for i in self.inputs[n_inputs:]:
            self.values.remove(i.name)
        del self.inputs[n_inputs:]
        self.env = {"torch": torch, **self.env_after(self.stmts)}

    def env_after(self, stmts: list[Stmt]) -> dict[str, Any]:
        program = Program(self.seed, self.inputs, stmts, [], self.grad)
        env: dict[str, Any] = {"torch": torch, **make_inputs(program)}
        with warnings.catch_warnings(), torch.set_grad_enabled(self.grad):
            warnings.simplefilter("ignore")
            for s in stmts:
                exec(s.line(), env)
        return env

    def program(self) -> Program:
        rng = self.rng
        for _ in range(rng.randint(1, 3)):
            self.new_input()
        attempts = 0
        while len(self.stmts) < self.max_ops and attempts < self.max_ops * 8 and not self.raises:
            attempts += 1
            n_inputs = len(self.inputs)
            try:
                stmt = self.statement()
            except (ValueError, IndexError, ZeroDivisionError):
                stmt = None
            if stmt is not None:
                self.try_add(stmt, n_inputs)
            elif len(self.inputs) > n_inputs:
                self.forget_inputs(n_inputs)
        targets = [s.target for s in self.stmts if s.target]
        outputs = targets[-1:] if targets else [self.inputs[0].name]
        extra = [n for n in targets[:-1] if rng.random() < 0.25]
        if rng.random() < 0.1:
            extra.append(rng.choice([i.name for i in self.inputs]))
        outputs = list(dict.fromkeys(extra + outputs))
        return Program(self.seed, self.inputs, self.stmts, outputs, grad=self.grad, module=self.module)


class _seeded:
    """Draws from ``gen``'s state through torch's global generator (restored afterwards)."""

    def __init__(self, gen: torch.Generator):
        self.gen = gen

    def __enter__(self):
        self.saved = torch.random.get_rng_state()
        torch.random.set_rng_state(self.gen.get_state())

    def __exit__(self, *exc):
        torch.random.set_rng_state(self.saved)


def _sample_backward(env: dict, outputs: list[str], inputs: list[str]) -> None:
    """Eager's backward of the sample program so far (a statement that makes it fail is not kept)."""
    outs = [env[n] for n in outputs if isinstance(env.get(n), torch.Tensor) and env[n].requires_grad]
    leaves = [env[n] for n in inputs if env[n].requires_grad]
    if outs and leaves:
        torch.autograd.grad([o.float().sum() for o in outs], leaves, allow_unused=True, retain_graph=True)


def _broadcasts(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return all(x == y or x == 1 or y == 1 for x, y in zip(reversed(a), reversed(b)))


def _factor(numel: int, rng: random.Random) -> str:
    dims = []
    n = numel
    for _ in range(rng.randint(0, 2)):
        divisors = [d for d in range(1, n + 1) if n % d == 0] if n else [0]
        d = rng.choice(divisors)
        dims.append(d)
        n = n // d if d else 0
    dims.append(-1 if rng.random() < 0.3 and numel else n)
    rng.shuffle(dims)
    return "(" + ", ".join(map(str, dims)) + ",)"


def _perm(n: int, rng: random.Random) -> str:
    p = list(range(n))
    rng.shuffle(p)
    return ", ".join(map(str, p))


def generate(seed: int, max_ops: int = 6) -> Program:
    """The random program of ``seed`` (at most ``max_ops`` statements)."""
    return _Generator(seed, max_ops).program()


# ---------------------------------------------------------------------------------------------------------------
# Running and comparing
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one run of a program gave: outputs, the inputs afterwards, gradients, or the error it raised."""

    outputs: list[Any] = field(default_factory=list)
    inputs: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor | None] = field(default_factory=list)
    error: BaseException | None = None
    stage: str = ""  # where the error happened: "forward" or "backward"
    traced: list[tuple] | None = None  # (shape, dtype) fulmen's computation trace recorded for each output


@dataclass
class Mismatch:
    kind: str  # "values", "error", "metadata", ...
    detail: str
    program: Program
    executors: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


def _build(program: Program, inputs: dict[str, torch.Tensor]) -> tuple[Callable, list[torch.Tensor], list]:
    """The callable (function or module), its arguments, and the leaves whose gradients are compared."""
    env: dict[str, Any] = {"torch": torch}
    exec(compile(program.source(), f"<fuzz program {program.seed}>", "exec"), env)
    args = [inputs[i.name] for i in program.args()]
    if not program.module:
        leaves = [inputs[i.name] for i in program.inputs if i.requires_grad]
        return env["program"], args, leaves
    module = env["Program"](*(inputs[p.name] for p in program.params()))
    leaves = [inputs[i.name] for i in program.args() if i.requires_grad]
    leaves += [getattr(module, p.name) for p in program.params() if p.requires_grad]
    return module, args, leaves


def make_inputs(program: Program, upcast: bool = False) -> dict[str, torch.Tensor]:
    """The program's inputs (the same values every time); ``upcast``: floating ones in float64."""
    env: dict[str, Any] = {"torch": torch}
    with _seeded(torch.Generator().manual_seed(program.seed)):
        exec(program.make_inputs().replace(f"torch.manual_seed({program.seed})", ""), env)
    out = {}
    for i in program.inputs:
        t = env[i.name]
        if upcast and t.dtype in _FLOATS:
            t = _upcast(t)
        out[i.name] = t
    return out


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64 with the same strides (so that layout-dependent ops act alike)."""
    base = torch.empty_strided(t.shape, t.stride(), dtype=torch.float64)
    with torch.no_grad():
        base.copy_(t)
    return base.requires_grad_(t.requires_grad)


def _cotangent(out: torch.Tensor, k: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + k)
    return torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)


def run_program(program: Program, fn_wrap: Callable[[Callable], Callable] | None = None,
                upcast: bool = False, calls: int = 1) -> list[Outcome]:
    """Run the program ``calls`` times on fresh inputs, through ``fn_wrap`` (e.g. ``fulmen.jit``) applied once: the
    second call of a compiled program is a cache hit. The module form keeps its module and copies each call's
    parameter values into it."""
    results = []
    call = module = None
    for _ in range(calls):
        inputs = make_inputs(program, upcast)
        fn, args, leaves = _build(program, inputs)
        if call is None:
            module = fn if program.module else None
            call = fn_wrap(fn) if fn_wrap is not None else fn
        elif module is not None:
            with torch.no_grad():
                for p in program.params():
                    getattr(module, p.name).copy_(inputs[p.name])
            n_params = sum(p.requires_grad for p in program.params())
            leaves = leaves[:len(leaves) - n_params] + [getattr(module, p.name) for p in program.params()
                                                        if p.requires_grad]
        outcome = Outcome()
        try:
            with torch.set_grad_enabled(program.grad), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                outcome.stage = "forward"
                outs = list(call(*args))
                outcome.outputs = outs
                if fn_wrap is not None and not results:
                    outcome.traced = _traced_outputs(call)
                outcome.stage = "backward"
                diff = [(o, k) for k, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
                if diff and leaves and program.grad:
                    grads = torch.autograd.grad([o for o, _ in diff], leaves,
                                                grad_outputs=[_cotangent(o, k) for o, k in diff], allow_unused=True)
                    outcome.grads = list(grads)
                outcome.stage = ""
        except Exception as e:  # compared with what eager did
            outcome.error = e
        outcome.inputs = [inputs[i.name] for i in program.args()]
        if module is not None:  # parameters may be written in place (``p.add_``): compared too
            outcome.inputs += [getattr(module, p.name) for p in program.params()]
        results.append(outcome)
    return results


def _traced_outputs(jitted: Any) -> list[tuple] | None:
    """The shape and dtype fulmen's computation trace recorded for each output (None when not available)."""
    from torch.utils._pytree import tree_leaves

    import fulmen

    try:
        leaves = tree_leaves(fulmen.last_traces(jitted)[0].output)
    except Exception:  # a wrapper that is not fulmen's (the comparison's own tests), or no trace
        return None
    return [(tuple(p.shape), p.dtype) if hasattr(p, "dtype") else None for p in leaves]


def _close(got: torch.Tensor, want: torch.Tensor, ref: torch.Tensor | None,
           floor: torch.dtype = torch.float64) -> str | None:
    """None when ``got`` matches ``want`` (eager); else why not. ``floor``: the least precise float dtype the program
    computes in, whose rounding a float value may carry whatever its own dtype (the float64 run keeps the program's
    casts and cannot tell how much)."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != eager's {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} != eager's {want.dtype}"
    if got.device != want.device:
        return f"device {got.device} != eager's {want.device}"
    g, w = got.detach(), want.detach()
    if w.dtype not in _FLOATS:
        bad = g != w
        if not bad.any():
            return None
        if ref is not None:
            # an int/bool value derived from floats (a comparison, a floor) can flip where eager's own value is
            # rounding-sensitive: where the float64 run disagrees with eager too
            sensitive = ref.detach().to(w.dtype) != w
            if not (bad & ~sensitive).any():
                return None
        idx = bad.nonzero()[0].tolist()
        return f"values differ at {idx}: {g[tuple(idx)].item()} != eager's {w[tuple(idx)].item()}"
    g64, w64 = g.double(), w.double()
    nan_g, nan_w = g64.isnan(), w64.isnan()
    if not torch.equal(nan_g, nan_w):
        idx = (nan_g != nan_w).nonzero()[0].tolist()
        return f"NaN positions differ at {idx}: {g64[tuple(idx)].item()} vs eager's {w64[tuple(idx)].item()}"
    finite = torch.isfinite(w64)
    inf_g, inf_w = torch.where(nan_g, 0, g64).isinf(), torch.where(nan_w, 0, w64).isinf()
    if not torch.equal(inf_g, inf_w) or not torch.equal(g64[inf_w], w64[inf_w]):
        if ref is None or not _ref_explains(g64, w64, ref.detach().double(), _tolerance(w.dtype, floor), ~nan_w):
            return "infinities differ"
    rtol, atol = _tolerance(w.dtype, floor)
    mask = finite & torch.isfinite(g64)
    err = (g64 - w64).abs()
    bad = mask & (err > atol + rtol * w64.abs())
    if not bad.any():
        return None
    if ref is not None and _ref_explains(g64, w64, ref.detach().double(), (rtol, atol), mask):
        return None
    if ref is not None and floor is torch.bfloat16 and _rms_explains(g64, w64, ref.detach().double(), atol, mask):
        return None
    idx = bad.nonzero()[0].tolist()
    return (f"values differ at {idx}: {g64[tuple(idx)].item()!r} != eager's {w64[tuple(idx)].item()!r} "
            f"(max abs diff {err[bad].max().item():.3g}, {w.dtype})")


def _tolerance(dtype: torch.dtype, floor: torch.dtype) -> tuple[float, float]:
    (rtol, atol), (floor_rtol, floor_atol) = _TOLERANCES[dtype], _TOLERANCES[floor]
    return max(rtol, floor_rtol), max(atol, floor_atol)


def _floor_dtype(program: Program) -> torch.dtype:
    """The least precise float dtype ``program`` computes in: bfloat16 if it appears; float32 if a float32 input or
    cast appears, or an integer or bool input (ops on those make float32, the default dtype); else float64."""
    source = program.source()
    if "bfloat16" in source or any(i.dtype is torch.bfloat16 for i in program.inputs):
        return torch.bfloat16
    if any(i.dtype is not torch.float64 for i in program.inputs) or ".float()" in source or "float32" in source:
        return torch.float32
    return torch.float64


def _ref_explains(g: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, tol: tuple[float, float],
                  mask: torch.Tensor) -> bool:
    """Whether fulmen is, element by element, no further from the float64 run than eager is (within a factor)."""
    if ref.shape != g.shape:
        return False
    rtol, atol = tol
    ok_ref = torch.isfinite(ref)
    err_g = torch.where(ok_ref, (g - ref).abs(), 0)
    err_w = torch.where(ok_ref, (w - ref).abs(), 0)
    err_g = torch.where(err_g.isnan(), math.inf, err_g)
    err_w = torch.where(err_w.isnan(), math.inf, err_w)
    fine = err_g <= _REF_MULTIPLIER * err_w + atol + rtol * ref.abs().where(ok_ref, 0)
    # where the float64 run is not finite (overflow in float64 is not expected of these programs) eager decides
    fine = fine | ~ok_ref & (g == w)
    return bool(fine[mask].all())


def _rms_explains(g: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, atol: float, mask: torch.Tensor) -> bool:
    """PyTorch's own accuracy check for compiled code (``torch._dynamo.utils.same`` with a float64 reference): the
    root-mean-square distance from the float64 run, fulmen's within a factor of eager's. Used where a program
    computes in bfloat16, whose sums differ by the order of their roundings element by element."""
    if ref.shape != g.shape:
        return False
    keep = mask & torch.isfinite(ref)
    if not keep.any():
        return False

    def rms(x: torch.Tensor) -> float:
        return float(((x[keep] - ref[keep]) ** 2).mean().sqrt())

    return rms(g) <= _REF_MULTIPLIER * rms(w) + atol


def _compare(program: Program, got: Outcome, want: Outcome, ref: Outcome | None, executors: str,
             call: int) -> Mismatch | None:
    where = f"call {call}"

    def mismatch(kind: str, detail: str) -> Mismatch:
        return Mismatch(kind, f"{where}: {detail}", program, executors)

    if want.error is not None:
        if "INTERNAL ASSERT FAILED" in str(want.error):
            return None  # a PyTorch bug (eager asks for a report), not a behaviour to match; counted by run_fuzz
        if got.error is None:
            return mismatch("error", f"eager raised in {want.stage} ({type(want.error).__name__}: "
                                     f"{_first_line(want.error)}) but fulmen did not")
        return None
    if got.error is not None:
        return mismatch("error", f"fulmen raised in {got.stage} but eager did not: {type(got.error).__name__}: "
                                 f"{_first_line(got.error)}")
    if len(got.outputs) != len(want.outputs):
        return mismatch("structure", f"{len(got.outputs)} outputs, eager {len(want.outputs)}")
    if got.traced is not None and len(got.traced) == len(got.outputs):
        for k, (g, meta) in enumerate(zip(got.outputs, got.traced)):
            if isinstance(g, torch.Tensor) and meta is not None and meta != (tuple(g.shape), g.dtype):
                return mismatch("metadata", f"output {k} ({program.outputs[k]}): the trace recorded {meta[1]} "
                                            f"{list(meta[0])}, the call returned {g.dtype} {list(g.shape)}")
    floor = _floor_dtype(program)
    refs = ref.outputs if ref is not None and ref.error is None else [None] * len(want.outputs)
    for k, (g, w, r) in enumerate(zip(got.outputs, want.outputs, refs)):
        if not isinstance(g, torch.Tensor) or not isinstance(w, torch.Tensor):
            if type(g) is not type(w) or g != w:
                return mismatch("values", f"output {k}: {g!r} != eager's {w!r}")
            continue
        if g.requires_grad != w.requires_grad:
            return mismatch("metadata", f"output {k} ({program.outputs[k]}): requires_grad {g.requires_grad} != "
                                        f"eager's {w.requires_grad}")
        why = _close(g, w, r if isinstance(r, torch.Tensor) else None, floor)
        if why:
            return mismatch("values", f"output {k} ({program.outputs[k]}): {why}")
    names = [i.name for i in program.args()] + [p.name for p in program.params()]
    ref_inputs = ref.inputs if ref is not None and ref.error is None else [None] * len(want.inputs)
    for name, g, w, r in zip(names, got.inputs, want.inputs, ref_inputs):
        why = _close(g, w, r, floor)
        if why:
            return mismatch("input-mutation", f"input {name} after the call: {why}")
    ref_grads = ref.grads if ref is not None and ref.error is None and len(ref.grads) == len(want.grads) \
        else [None] * len(want.grads)
    if len(got.grads) != len(want.grads):
        return mismatch("grad", f"{len(got.grads)} gradients, eager {len(want.grads)}")
    for k, (g, w, r) in enumerate(zip(got.grads, want.grads, ref_grads)):
        if (g is None) != (w is None):
            # no gradient and a zero gradient are the same to a user's optimizer; anything else is not
            other = g if g is not None else w
            if not torch.all(other == 0):
                return mismatch("grad", f"gradient {k}: {'None' if g is None else 'a tensor'} where eager has "
                                        f"{'None' if w is None else 'a nonzero tensor'}")
            continue
        if g is None:
            continue
        why = _close(g, w, r, floor)
        if why:
            return mismatch("grad", f"gradient {k}: {why}")
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().split("\n")[0]
    return text if len(text) <= 200 else text[:197] + "..."


def _jit(executors: str) -> Callable[[Callable], Callable]:
    import fulmen

    if executors == "torch":
        return lambda fn: fulmen.jit(fn, executors=["torch"])
    return lambda fn: fulmen.jit(fn, compile="sync")


def check(program: Program, executors: str = "torch", calls: int = 2) -> Mismatch | None:
    """Run ``program`` eagerly and with fulmen (``executors``: "torch" or "default"); the first difference."""
    want = run_program(program, calls=calls)
    ref = None
    try:
        ref = run_program(program, upcast=True)[0]
    except Exception:
        ref = None
    try:
        got = run_program(program, _jit(executors), calls=calls)
    except Exception as e:  # outside the call itself (never expected): a mismatch, with its traceback
        return Mismatch("crash", "".join(traceback.format_exception(e))[-2000:], program, executors)
    for k, (g, w) in enumerate(zip(got, want)):
        m = _compare(program, g, w, ref, executors, k + 1)
        if m is not None:
            return m
    return None


# ---------------------------------------------------------------------------------------------------------------
# Minimizing: delta debugging over the statements (a statement goes with those that use its value)
# ---------------------------------------------------------------------------------------------------------------


def _without(program: Program, drop: set[int]) -> Program | None:
    stmts, gone = [], set()
    for k, s in enumerate(program.stmts):
        if k in drop or any(u in gone for u in s.uses):
            if s.target:
                gone.add(s.target)
            continue
        stmts.append(s)
    outputs = [o for o in program.outputs if o not in gone]
    if not outputs:
        targets = [s.target for s in stmts if s.target]
        outputs = targets[-1:] or [program.inputs[0].name]
    used = {u for s in stmts for u in s.uses} | set(outputs)
    inputs = [i for i in program.inputs if i.name in used] or program.inputs[:1]
    return replace(program, stmts=stmts, outputs=outputs, inputs=inputs)


def minimize(mismatch: Mismatch, budget_s: float = 60.0) -> Mismatch:
    """A smaller program with the same kind of mismatch (ddmin over statements, then outputs, then options)."""
    deadline = time.monotonic() + budget_s
    best = mismatch

    def still(p: Program) -> Mismatch | None:
        if time.monotonic() > deadline:
            return None
        m = check(p, mismatch.executors)
        return m if m is not None and m.kind == mismatch.kind else None

    n = 2
    while len(best.program.stmts) >= 2 and time.monotonic() < deadline:
        stmts = best.program.stmts
        chunk = max(1, len(stmts) // n)
        reduced = False
        for start in range(0, len(stmts), chunk):
            candidate = _without(best.program, set(range(start, min(start + chunk, len(stmts)))))
            m = still(candidate) if candidate is not None and candidate.stmts != stmts else None
            if m is not None:
                best, reduced = m, True
                n = max(n - 1, 2)
                break
        if not reduced:
            if chunk == 1:
                break
            n = min(n * 2, len(stmts))
    for out in list(best.program.outputs):
        if len(best.program.outputs) > 1:
            candidate = replace(best.program, outputs=[o for o in best.program.outputs if o != out])
            m = still(candidate)
            if m is not None:
                best = m
    for change in ({"module": False}, {"grad": False}):
        if any(getattr(best.program, k) != v for k, v in change.items()):
            candidate = replace(best.program, **change)
            if not candidate.module:
                candidate.inputs = [replace(i, param=False) for i in candidate.inputs]
            m = still(candidate)
            if m is not None:
                best = m
    inputs = best.program.inputs
    for k, inp in enumerate(inputs):
        if inp.layout != "contiguous":
            candidate = replace(best.program, inputs=[*inputs[:k], replace(inp, layout="contiguous"), *inputs[k + 1:]])
            m = still(candidate)
            if m is not None:
                best, inputs = m, m.program.inputs
    return best


# ---------------------------------------------------------------------------------------------------------------
# The campaign behind ``fulmen fuzz``
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Summary:
    programs: int = 0
    ops: collections.Counter = field(default_factory=collections.Counter)
    eager_errors: int = 0
    eager_internal_errors: int = 0  # eager failed an internal assert (a PyTorch bug): no parity asked
    with_grad: int = 0
    modules: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)

    def format(self, seconds: float, executors: str) -> str:
        ops = ", ".join(f"{c} {self.ops[c]}" for c in CATEGORIES)
        kinds = collections.Counter(m.kind for m in self.mismatches)
        lines = [f"fulmen fuzz: {self.programs} programs in {seconds:.0f} s with executors={executors}",
                 f"  ops: {sum(self.ops.values())} ({ops})",
                 f"  programs with grad mode on: {self.with_grad}; modules: {self.modules}; "
                 f"where eager raised: {self.eager_errors} (internal asserts, not compared: "
                 f"{self.eager_internal_errors})",
                 f"  mismatches: {len(self.mismatches)}"
                 + (" (" + ", ".join(f"{k} {v}" for k, v in kinds.items()) + ")" if kinds else "")]
        return "\n".join(lines)


def signature(m: Mismatch) -> str:
    """What kind of mismatch ``m`` is, without its numbers and value names (for counting repeats of one bug)."""
    return m.kind + ": " + re.sub(r"\(v\d+\)|\[[^\]]*\]|-?\d[\w.+-]*", "#", m.detail.split(": ", 1)[-1])


def run_fuzz(seconds: float, seed: int = 0, executors: str = "torch", max_ops: int = 6,
             minimize_s: float = 60.0, out: TextIO | None = None, max_mismatches: int = 50) -> Summary:
    """Generate and check programs (seeds ``seed``, ``seed + 1``, ...) for ``seconds``; print a minimized reproducer
    to ``out`` for the first mismatch of each signature (later ones by seed only) and return the counts."""
    import sys

    out = out if out is not None else sys.stdout
    summary = Summary()
    seen: dict[str, list[int]] = {}
    start = time.monotonic()
    s = seed
    while time.monotonic() - start < seconds and len(summary.mismatches) < max_mismatches:
        program = generate(s, max_ops)
        s += 1
        summary.programs += 1
        summary.ops.update(st.category for st in program.stmts)
        summary.with_grad += program.grad
        summary.modules += program.module
        m = check(program, executors)
        eager = run_program(program)[0]
        summary.eager_errors += eager.error is not None
        summary.eager_internal_errors += eager.error is not None and "INTERNAL ASSERT" in str(eager.error)
        if m is None:
            continue
        summary.mismatches.append(m)
        key = signature(m)
        if key in seen:
            seen[key].append(program.seed)
            print(f"=== mismatch (seed {program.seed}) like seed {seen[key][0]}'s: {m}", file=out)
            continue
        seen[key] = [program.seed]
        small = minimize(m, minimize_s)
        print(f"\n=== mismatch (seed {program.seed}, {small.kind}): {small.detail}", file=out)
        print(small.program.script(executors), file=out)
        out.flush()
    print(summary.format(time.monotonic() - start, executors), file=out)
    for key, seeds in seen.items():
        more = ", ..." if len(seeds) > 8 else ""
        print(f"  {len(seeds)} x {key[:150]} (seeds {', '.join(map(str, seeds[:8]))}{more})", file=out)
    return summary
