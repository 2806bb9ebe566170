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

Modes beyond the default: ``generate(seed, extended=True)`` adds expanded (stride 0) and channels_last inputs,
nn ops (seeded dropout, normalizations, cross-entropy with ignored targets) and in-place writes through views;
``check(program, dynamic=True)`` calls the program again on inputs of other sizes (so that sizes turn dynamic and
later calls hit the cache), ``autocast=True`` runs every call under CPU autocast, and ``executors="backend"``
compiles with ``torch.compile(backend="fulmen")``.

``fulmen fuzz --seconds N`` runs it from the command line (``run_fuzz``) and prints a minimized reproducer
(``minimize``, a delta-debugging of the statement list) for the first mismatch of each kind.

Files: ``program`` (inputs, statements, source), ``generate``, ``compare`` (running and comparing), ``campaign``
(minimizing, counting).
"""

from fulmen.fuzz.campaign import Summary, minimize, run_fuzz, signature
from fulmen.fuzz.compare import Mismatch, Outcome, check, run_program
from fulmen.fuzz.generate import CATEGORIES, generate
from fulmen.fuzz.program import Input, Program, Stmt, make_inputs

__all__ = ["CATEGORIES", "Input", "Mismatch", "Outcome", "Program", "Stmt", "Summary", "check", "generate",
           "make_inputs", "minimize", "run_fuzz", "run_program", "signature"]
