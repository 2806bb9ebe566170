"""Minimizing a mismatch (delta debugging over the statements) and the campaign behind ``fulmen fuzz``."""

from __future__ import annotations

import collections
import re
import time
from dataclasses import dataclass, field, replace
from typing import TextIO

from fulmen.fuzz.batch import batch_key, check_batch
from fulmen.fuzz.compare import Mismatch, check, run_program
from fulmen.fuzz.generate import CATEGORIES, generate
from fulmen.fuzz.program import Program


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
        m = check(p, mismatch.executors, **mismatch.options)
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

    def count(self, program: Program) -> None:
        self.programs += 1
        self.ops.update(st.category for st in program.stmts)
        self.with_grad += program.grad
        self.modules += program.module

    def format(self, seconds: float, executors: str) -> str:
        ops = ", ".join(f"{c} {self.ops[c]}" for c in [*CATEGORIES, *sorted(set(self.ops) - set(CATEGORIES))])
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
             minimize_s: float = 60.0, out: TextIO | None = None, max_mismatches: int = 50,
             modes: tuple[str, ...] = (), batch: int = 1, restyle: bool = False, stop: int | None = None) -> Summary:
    """Generate and check programs (seeds ``seed``, ``seed + 1``, ... up to ``stop``) for ``seconds``; print a
    minimized reproducer to ``out`` for the first mismatch of each signature (later ones by seed only) and return
    the counts. ``modes``: generator modes ("extended", "wide", "hunt"); ``batch``: programs checked as one (see
    ``fulmen.fuzz.batch``: one compilation for many, the point with fused regions); ``restyle``: later calls change
    the inputs' layouts and dtypes."""
    import sys

    out = out if out is not None else sys.stdout
    summary = Summary()
    seen: dict[str, list[int]] = {}
    start = time.monotonic()
    flags = {m: True for m in modes}
    pending: dict[tuple, list[Program]] = collections.defaultdict(list)
    s = seed
    while time.monotonic() - start < seconds and len(summary.mismatches) < max_mismatches and s != stop:
        program = generate(s, max_ops, **flags)
        s += 1
        if batch > 1:  # the function form (a module's parameters would need a module per member)
            program = replace(program, module=False, inputs=[replace(i, param=False) for i in program.inputs])
        summary.count(program)
        eager = run_program(program)[0]
        summary.eager_errors += eager.error is not None
        summary.eager_internal_errors += eager.error is not None and "INTERNAL ASSERT" in str(eager.error)
        group = [program]
        if batch > 1 and eager.error is None:
            group = pending[batch_key(program)]
            group.append(program)
            if len(group) < batch:
                continue
            pending.pop(batch_key(program))
        _report(check_batch(group, executors, restyle=restyle), summary, seen, minimize_s, out)
    for group in pending.values():  # the last, unfilled batches
        _report(check_batch(group, executors, restyle=restyle), summary, seen, minimize_s, out)
    print(summary.format(time.monotonic() - start, executors), file=out)
    for key, seeds in seen.items():
        more = ", ..." if len(seeds) > 8 else ""
        print(f"  {len(seeds)} x {key[:150]} (seeds {', '.join(map(str, seeds[:8]))}{more})", file=out)
    return summary


def _report(found: list[Mismatch], summary: Summary, seen: dict[str, list[int]], minimize_s: float,
            out: TextIO) -> None:
    for m in found:
        summary.mismatches.append(m)
        key = signature(m)
        if key in seen:
            seen[key].append(m.program.seed)
            print(f"=== mismatch (seed {m.program.seed}) like seed {seen[key][0]}'s: {m}", file=out)
            continue
        seen[key] = [m.program.seed]
        small = minimize(m, minimize_s)
        options = ", ".join(k for k, v in small.options.items() if v is True)
        print(f"\n=== mismatch (seed {m.program.seed}, {small.kind}{', ' + options if options else ''}): "
              f"{small.detail}", file=out)
        print(small.program.script(small.executors), file=out)
        out.flush()
