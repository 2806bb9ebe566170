"""Fuzz programs: inputs (made from the program's seed), statements over a pool of values, and their source."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_INTS = (torch.int64, torch.int32, torch.int8, torch.uint8)
_DTYPE_NAMES = {d: str(d) for d in (*_FLOATS, *_INTS, torch.bool, torch.complex64)}
# the special values a ``special`` input holds at some elements: where fused code and eager most often part ways
_SPECIAL = "torch.tensor([float('nan'), float('inf'), float('-inf'), -0.0, 0.0])"


@dataclass(frozen=True)
class Input:
    """One argument: made by ``make`` (source text that builds it from the seeded generator)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    # or "transposed" (last two dims swapped), "strided" (every other element), "expanded" (the first dim of size
    # above 1 broadcast from size 1: stride 0) or "channels_last" (a 4-d tensor in that memory format)
    layout: str = "contiguous"
    requires_grad: bool = False
    param: bool = False  # a parameter of the module form
    high: int = 0  # for an index tensor: values in [0, high)
    special: bool = False  # a float input with NaN, infinities and signed zeros at some elements

    def make(self) -> str:
        shape = list(self.shape)
        if self.layout == "transposed" and len(shape) >= 2:
            shape[-1], shape[-2] = shape[-2], shape[-1]
        elif self.layout == "strided" and shape:
            shape[-1] *= 2
        broadcast = next((d for d, n in enumerate(shape) if n > 1), None) if self.layout == "expanded" else None
        if broadcast is not None:
            shape[broadcast] = 1
        size = repr(tuple(shape))
        if self.high:
            text = f"torch.randint(0, {self.high}, {size})"
        elif self.dtype is torch.int64:
            text = f"torch.randint(-4, 5, {size})"
        elif self.dtype in _INTS:  # the whole range: sums and products of these overflow (and wrap, in eager)
            low, high = (0, 256) if self.dtype is torch.uint8 else (-128, 128)
            text = f"torch.randint({low}, {high}, {size}, dtype={_DTYPE_NAMES[self.dtype]})"
        elif self.dtype is torch.bool:
            text = f"torch.rand({size}) > 0.5"
        else:
            text = f"torch.randn({size}, dtype={_DTYPE_NAMES[self.dtype]})"
        if self.special:
            text = (f"torch.where(torch.rand({size}) < 0.4, {_SPECIAL}[torch.randint(0, 5, {size})]"
                    f".to({_DTYPE_NAMES[self.dtype]}), {text})")
        if self.layout == "transposed" and len(shape) >= 2:
            text = f"({text}).transpose(-1, -2)"
        elif self.layout == "strided" and shape:
            text = f"({text})[..., ::2]"
        elif broadcast is not None:
            text = f"({text}).expand{tuple(self.shape)}"
        elif self.layout == "channels_last" and len(shape) == 4:
            text = f"({text}).contiguous(memory_format=torch.channels_last)"
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
    wide: bool = False  # made by ``generate(wide=True)``: outputs' strides and aliasing are compared too
    hunt: bool = False  # made by ``generate(hunt=True)``: strides, aliasing and the sign of zeros compared too

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



class _seeded:
    """Draws from ``gen``'s state through torch's global generator (restored afterwards)."""

    def __init__(self, gen: torch.Generator):
        self.gen = gen

    def __enter__(self):
        self.saved = torch.random.get_rng_state()
        torch.random.set_rng_state(self.gen.get_state())

    def __exit__(self, *exc):
        torch.random.set_rng_state(self.saved)



def resized(program: Program, sizes: dict[int, int]) -> Program:
    """``program`` with its inputs' sizes renamed by ``sizes`` (sizes not in it kept; index bounds follow the size
    they index): the same statements on inputs of other sizes, as a dynamic-shape call sees them."""
    inputs = [replace(i, shape=tuple(sizes.get(n, n) for n in i.shape), high=sizes.get(i.high, i.high))
              for i in program.inputs]
    return replace(program, inputs=inputs)


def restyled(program: Program, change: str) -> Program:
    """``program`` with its arguments in other layouts (``change="layout"``: contiguous ones strided or transposed,
    the others contiguous) or float32 ones in float64 (``"dtype"``): what a later call with the same sizes but other
    strides or dtypes brings, which must not reuse the first call's compilation."""
    def one(i: Input) -> Input:
        if i.param or i.high:
            return i
        if change == "dtype":
            return replace(i, dtype=torch.float64) if i.dtype is torch.float32 else i
        if not i.shape or i.layout == "expanded" and i.requires_grad:
            return i
        if i.layout != "contiguous":
            return replace(i, layout="contiguous")
        return replace(i, layout="transposed" if len(i.shape) >= 2 else "strided")

    return replace(program, inputs=[one(i) for i in program.inputs])


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
