"""Generating a random program from a seed: each candidate statement runs eagerly on the sample inputs, so the
generator knows every value's shape and dtype and keeps only statements eager accepts (a few it rejects end their
program, to check that fulmen rejects them too)."""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from typing import Any

import torch

from fulmen.fuzz import hunt as hunt_kinds
from fulmen.fuzz.program import _FLOATS, Input, Program, Stmt, make_inputs

# the share of statements eager rejects that are kept (ending the program), to check that fulmen raises too
_KEEP_REJECTED = 0.1

DEBUG = False
CATEGORIES = ("unary", "binary", "reduction", "view", "inplace", "index", "matmul")


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
    def __init__(self, seed: int, max_ops: int, extended: bool = False, wide: bool = False, hunt: bool = False):
        self.seed = seed
        self.hunt = hunt  # the statements of fulmen.fuzz.hunt, and strides, aliasing and signed zeros compared
        self.extended = extended  # more layouts, nn ops, in-place writes through views
        self.wide = wide  # grad-mode regions, requires_grad_, 0-d promotion, out=, empty reductions, aliasing
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
                  high: int = 0, special: bool = False, grad: bool = True) -> str:
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
            if (self.extended or self.hunt) and rng.random() < 0.5:
                layout = "channels_last" if len(shape) == 4 and rng.random() < 0.5 else "expanded"
        requires_grad = dtype in _FLOATS and not high and self.grad and rng.random() < 0.7 and grad
        # a parameter is refilled in place between calls, which an expanded tensor refuses
        param = self.module and requires_grad and rng.random() < 0.6 and layout != "expanded"
        name = "abcdefghijklmnopqrstuvwxyz"[len(self.inputs)] if len(self.inputs) < 26 else f"in{len(self.inputs)}"
        inp = Input(name, shape, dtype, layout, requires_grad, param, high, special)
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
        if self.hunt and self.rng.random() < 0.5:
            return hunt_kinds.statement(self)
        if self.wide and self.rng.random() < 0.3:
            return self._wide()
        if self.extended:
            category = self.rng.choices(CATEGORIES + ("nn",), weights=[4, 5, 3, 4, 3.5, 2.5, 1.5, 2.5])[0]
        else:
            category = self.rng.choices(CATEGORIES, weights=[4, 5, 3, 4, 2.5, 2.5, 1.5])[0]
        return getattr(self, "_" + category)()

    def _nn(self):
        rng = self.rng
        a = self.pick(lambda t: t.dtype in _FLOATS and t.ndim >= 1)
        if a is None:
            return None
        t = self.env[a]
        last = t.shape[-1]
        forms = [f"torch.nn.functional.dropout({a}, 0.3)", f"torch.nn.functional.layer_norm({a}, ({last},))",
                 f"torch.nn.functional.normalize({a}, dim=-1)", f"torch.softmax({a}, -1, dtype=torch.float32)",
                 f"torch.nn.functional.rms_norm({a}, ({last},))", f"{a}.masked_fill({a} > 0.5, -1.0)",
                 f"torch.where({a} > 0, {a}, 0.0)", f"torch.nn.functional.leaky_relu({a}, 0.2)",
                 f"torch.nn.functional.hardtanh({a})", f"torch.nn.functional.elu({a})",
                 f"torch.clamp({a}, min=0.1)", f"torch.addcmul({a}, {a}, {a}, value=0.5)"]
        if t.ndim >= 2 and t.numel():
            forms += [f"torch.nn.functional.cross_entropy({a}.flatten(0, -2), "
                      f"torch.tensor({[rng.choice([-100, *range(last)]) for _ in range(t.numel() // last)]}))",
                      f"torch.nn.functional.log_softmax({a}, -1).mean(0)"]
        return self.stmt(rng.choice(forms), (a,), "nn")

    def _wide(self):
        """Statements the other categories never make: grad-mode regions, requires_grad_ asking for a value's own
        flag, type promotion with 0-d tensors and Python scalars, out=, where with scalar branches, empty reductions."""
        rng = self.rng
        a = self.pick()
        t = self.env[a]
        floating = t.dtype in _FLOATS
        scalar = rng.choice(["2", "(-1)", "0.5", "True", "3.0"])
        zero_d = rng.choice(["torch.tensor(2)", "torch.tensor(1.5)", "torch.tensor(0.5, dtype=torch.float64)",
                             "torch.tensor(True)", "torch.tensor(-3, dtype=torch.int64)"])
        forms = [f"torch.no_grad()(lambda: {a} * 2)()", f"torch.enable_grad()(lambda: {a} + 1)()",
                 f"torch.no_grad()(lambda: torch.enable_grad()(lambda: {a} * {a})())()",
                 f"{a} + {zero_d}", f"{zero_d} * {a}", f"{a} - {zero_d} * {scalar}", f"torch.mul({a}, {zero_d})",
                 f"torch.where({a} > 0, {scalar}, {a})" if t.dtype is not torch.bool else f"torch.where({a}, 1, 0)",
                 f"torch.where({a} != 0, 1.0, 0)", f"torch.add({a}, {scalar}, out=torch.empty_like({a}))",
                 f"torch.mul({a}, {a}, out=torch.empty({tuple(t.shape)}, dtype={a}.dtype))",
                 f"{a}.sum(dim=())", f"{a}.sum(dim=[])", f"{a}.narrow(0, 0, 0).sum(0)" if t.ndim else f"{a}.sum()",
                 f"{a}[..., :0].sum(-1)" if t.ndim else f"{a}.sum()", f"{a}.unsqueeze(0).amax(dim=0)",
                 f"{a} // 2", f"{a} / 2", f"2 ** {a}" if floating else f"{a} ** 2", f"{a}.clone().t()"
                 if t.ndim == 2 else f"{a}.clone()"]
        if floating:
            # requires_grad_() changing a flag is refused inside a compiled function (fulmen.torch.hooks)
            forms += [f"{a}.detach().requires_grad_(False) * 2", f"{a}[..., :0].mean(-1)" if t.ndim else f"{a}.mean()",
                      f"torch.where({a} > 0, 0.5, -1)"]
        return self.stmt(rng.choice(forms), (a,), "wide")

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
        if self.extended and t.ndim:  # through a view of the target
            forms += [f"{a}.transpose(0, -1).mul_(2)", f"{a}.unsqueeze(0).sub_(0.5)", f"{a}[..., 1:].mul_({src})",
                      f"{a}.view(-1)[::2].fill_(3)", f"{a}.flatten()[:2].add_(1)"]
            if t.ndim >= 2:
                forms += [f"{a}.diagonal().add_(1)", f"{a}.mT[0].zero_()", f"{a}.narrow(-1, 0, 1).mul_(-1)"]
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
        if self.wide and targets and rng.random() < 0.3:  # a view returned with its base
            views = [s for s in self.stmts if s.target and s.category == "view" and s.uses[0] in targets]
            if views:
                view = rng.choice(views)
                outputs = list(dict.fromkeys([view.uses[0], view.target, *outputs]))
        return Program(self.seed, self.inputs, self.stmts, outputs, grad=self.grad, module=self.module,
                       wide=self.wide, hunt=self.hunt)



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


def generate(seed: int, max_ops: int = 6, extended: bool = False, wide: bool = False, hunt: bool = False) -> Program:
    """The random program of ``seed`` (at most ``max_ops`` statements). ``extended`` adds inputs that are expanded
    (stride 0) or channels_last, nn ops (dropout, normalizations, cross-entropy with ignored targets) and in-place
    writes through views; ``wide`` adds ``no_grad``/``enable_grad`` regions, ``requires_grad_()`` on detached
    values, type promotion with 0-d tensors and Python scalars, ``out=``, ``where`` with scalar branches, reductions
    over empty dims and a view returned with its base, and compares outputs' strides and aliasing; ``hunt`` adds the
    statements of ``fulmen.fuzz.hunt`` (view chains written in place, ``out=``, narrow integers, NaN/inf/-0.0, empty
    reductions, random ops, conv/norm/pool layers, complex values, region boundaries) and compares signed zeros too;
    without them a seed makes the program it always made."""
    return _Generator(seed, max_ops, extended, wide, hunt).program()
