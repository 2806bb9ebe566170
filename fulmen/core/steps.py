"""A step of fulmen's pipeline: a named trace -> trace function.

The pipeline is data: ``fulmen.frontend.compile`` keeps the lists of steps it runs, and every trace a step
builds is kept, under the step's name, for ``fulmen.last_traces`` (``fulmen.compile_stats(f).last_trace_steps``
gives the names). Executors and users add steps without editing the pipeline:

- an executor lists its steps in ``Executor.steps``; they run for every program it is listed for;
- a user passes them to ``fulmen.jit(fn, steps=[...])``.

Example: common-subexpression elimination once more, on the computation trace before autodiff and claiming::

    from fulmen.transforms.passes import cse

    jfn = fulmen.jit(fn, steps=[fulmen.Step("early_cse", lambda trace, executors: cse(trace))])

A step's function receives the trace and the executors of the compilation and returns a new trace (it must
not edit the one it is given: earlier traces are kept as they were).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: Where a step runs. "computation": on the computation trace, before autodiff (training) and claiming; the
#: place for rewrites of the program's math (fused_linear_ce's). "execution": on every trace the execution
#: pipeline compiles (the inference program, the forward and each backward), after claiming and fusion and
#: before the last uses are deleted. "backward": on each backward trace before the execution pipeline.
STAGES = ("computation", "execution", "backward")


@dataclass(frozen=True)
class Step:
    """``fn(trace, executors) -> trace`` under ``name``, run at ``stage`` (one of ``STAGES``); ``when(executors)``,
    when given, says whether the step runs for a compilation, and ``for_trace(trace)`` whether it has work on a
    given trace (the "overlap" step: only traces that communicate). A step that does not run keeps no trace."""

    name: str
    fn: Callable[[Any, Sequence[Any]], Any]
    stage: str = "computation"
    when: Callable[[Sequence[Any]], bool] | None = None
    for_trace: Callable[[Any], bool] | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"Step: name must be an identifier (it labels the step's trace), got {self.name!r}")
        if not callable(self.fn):
            raise TypeError(
                f"Step {self.name!r}: fn must be a function (trace, executors) -> trace, got {type(self.fn).__name__}"
            )
        if self.stage not in STAGES:
            raise ValueError(
                f"Step {self.name!r}: stage must be one of {', '.join(map(repr, STAGES))}, got {self.stage!r}"
            )

    def applies(self, executors: Sequence[Any]) -> bool:
        return self.when is None or bool(self.when(executors))


def check_steps(steps: Sequence[Any], owner: str) -> tuple[Step, ...]:
    """``steps`` as a tuple of ``Step``, or a TypeError naming ``owner`` (``fulmen.jit``, an executor)."""
    steps = tuple(steps or ())
    for s in steps:
        if not isinstance(s, Step):
            raise TypeError(
                f"{owner}: steps must be fulmen.Step objects (Step(name, fn, stage)), got {type(s).__name__}"
            )
    return steps
