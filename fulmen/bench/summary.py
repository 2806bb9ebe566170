"""``fulmen examine``'s summary of a compilation: the operations of the computation trace by kind, which executor
runs each (as one call, decomposed or fused), the opaque fallback ops, and the trace and compile times."""

from __future__ import annotations

import collections
import sys
from typing import Any

from fulmen.core.bookkeeping import is_bookkeeping
from fulmen.core.codeutils import outputs_of


def _exec_index(trace) -> dict[str, Any]:
    """Output name -> the execution-trace bound symbol that produces it (values inside a fused region map to
    the region)."""
    index: dict[str, Any] = {}
    for bsym in trace.bound_symbols:
        for o in outputs_of(bsym.output):
            index[o.name] = bsym
    for bsym in trace.bound_symbols:
        for sub in bsym.subsymbols:
            for o in outputs_of(sub.output):
                index.setdefault(o.name, bsym)
    return index


def _how_run(bsym, index: dict[str, Any]) -> str:
    """Which executor runs a computation-trace op, and whether it ran as one call, decomposed or fused."""
    outs = outputs_of(bsym.output)
    if not outs:
        return "-"
    exec_bsym = index.get(outs[0].name)
    if exec_bsym is None:
        return "removed"
    ex = exec_bsym.sym.executor
    name = getattr(ex, "name", None) or "?"
    from fulmen.executors.base import FusionExecutor

    if isinstance(ex, FusionExecutor):
        return f"{name} (fused)"
    direct = exec_bsym.sym is bsym.sym or exec_bsym.sym.id.endswith(bsym.sym.id) or any(
        s is bsym for s in exec_bsym.subsymbols)
    return name if direct else f"{name} (decomposed)"


def summarize(jitted: Any, *, name: str, out=None) -> dict:
    """Facts about the last compilation of a jitted function or module, as a dict and printed to ``out``."""
    import fulmen
    from fulmen.core.symbol import OpTags

    out = out if out is not None else sys.stdout
    stats = fulmen.compile_stats(jitted)
    traces = fulmen.last_traces(jitted)
    comp, final = traces[0], traces[-1]
    ops = [b for b in comp.bound_symbols if not is_bookkeeping(b)]
    index = _exec_index(final)
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    kinds = collections.Counter()
    fallbacks = collections.Counter()
    for b in ops:
        kinds[b.sym.qualified_name] += 1
        by_kind[b.sym.qualified_name][_how_run(b, index)] += 1
        if OpTags.FALLBACK in b.sym.tags:
            fallbacks[b.sym.qualified_name] += 1
    exec_ops = [b for b in final.bound_symbols if not is_bookkeeping(b)]
    executors = collections.Counter(getattr(b.sym.executor, "name", None) or "?" for b in exec_ops)
    phases = ", ".join(f"{k} {v:.1f}" for k, v in stats.phase_times_ms.items())

    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"{name}: {len(ops)} ops in the computation trace ({len(kinds)} kinds), {len(exec_ops)} calls in the "
      "execution trace")
    p(f"  traced in {stats.last_trace_time_ms:.1f} ms; trace + transforms + codegen {stats.last_compile_time_ms:.1f} "
      f"ms ({phases} ms)")
    p("  executors: " + ", ".join(f"{k} {v}" for k, v in executors.most_common()))
    backward = fulmen.last_backward_traces(jitted)
    backward_executors: collections.Counter = collections.Counter()
    if backward:
        backward_ops = [b for b in backward[-1].bound_symbols if not is_bookkeeping(b)]
        backward_executors.update(getattr(b.sym.executor, "name", None) or "?" for b in backward_ops)
        p(f"  backward trace: {len(backward_ops)} calls; executors: "
          + ", ".join(f"{k} {v}" for k, v in backward_executors.most_common()))
    p("  ops by kind (count, run by):")
    width = max((len(k) for k in kinds), default=0)
    for kind, count in kinds.most_common():
        how = ", ".join(f"{h}" if c == count else f"{h} x{c}" for h, c in by_kind[kind].most_common())
        p(f"    {kind.ljust(width)}  {count:4d}  {how}")
    if fallbacks:
        p(f"  fallback (opaque) ops, run by torch without a fulmen rule: {sum(fallbacks.values())}")
        for kind, count in fallbacks.most_common():
            p(f"    {kind} x{count}")
    else:
        p("  fallback (opaque) ops: none")
    return {"ops": len(ops), "kinds": dict(kinds), "executors": dict(executors), "fallbacks": dict(fallbacks),
            "trace_ms": stats.last_trace_time_ms, "compile_ms": stats.last_compile_time_ms,
            "execution_calls": len(exec_ops), "backward_executors": dict(backward_executors)}
