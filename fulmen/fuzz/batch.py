"""Many small programs checked as one: their statements side by side in one function, so that a fused run traces
and compiles once for the lot (an Inductor compile costs seconds on a CPU; a program's own ops, milliseconds).

Members are renamed apart (``p3_a``, ``p3_v2``) and keep their statements and order; the merged program's inputs
are drawn from its own seed, so a member's values differ from its standalone run. A mismatch of a batch is
re-checked member by member (standalone); when no member fails alone the merged program itself is the reproducer
(``minimize`` shrinks it like any other program)."""

from __future__ import annotations

import re
from dataclasses import replace

from fulmen.fuzz.compare import Mismatch, _floor_dtype, check, run_program
from fulmen.fuzz.program import Program, Stmt


def _renamer(names: set[str], prefix: str):
    # a name is an identifier not preceded by "." (an attribute such as ``.t()`` or ``.mT`` keeps its name)
    pattern = re.compile(r"(?<![\w.])(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True)) + r")\b")
    return lambda text: pattern.sub(lambda m: prefix + m.group(1), text) if names else text


def merge(programs: list[Program]) -> Program:
    """One function computing every program of ``programs`` (function form, grad mode of the first), its outputs
    the members' outputs in order."""
    inputs, stmts, outputs = [], [], []
    for k, p in enumerate(programs):
        prefix = f"p{k}_"
        names = {i.name for i in p.inputs} | {s.target for s in p.stmts if s.target}
        rename = _renamer(names, prefix)
        inputs += [replace(i, name=prefix + i.name, param=False) for i in p.inputs]
        stmts += [Stmt(s.target and prefix + s.target, rename(s.expr), tuple(prefix + u for u in s.uses), s.category)
                  for s in p.stmts]
        outputs += [prefix + o for o in p.outputs]
    first = programs[0]
    return Program(first.seed, inputs, stmts, outputs, grad=first.grad, module=False,
                   wide=any(p.wide for p in programs))


def batch_key(program: Program) -> tuple:
    """Programs that may share a batch: the same grad mode and the same float tolerance (a bfloat16 member would
    loosen the comparison of a float64 one)."""
    return program.grad, _floor_dtype(program)


def eager_runs(program: Program) -> bool:
    """Whether eager runs ``program`` without an error (a program that raises is checked alone: in a batch its
    error would hide the others)."""
    try:
        return run_program(program)[0].error is None
    except Exception:
        return False


def check_batch(programs: list[Program], executors: str, **options) -> list[Mismatch]:
    """The mismatches of ``programs`` checked as one merged program: none when the batch agrees with eager; else
    each member's own mismatch, or the batch's when no member fails alone."""
    if len(programs) == 1:
        m = check(programs[0], executors, **options)
        return [m] if m is not None else []
    m = check(merge(programs), executors, **options)
    if m is None:
        return []
    alone = [found for p in programs if (found := check(p, executors, **options)) is not None]
    return alone or [m]
