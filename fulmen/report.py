"""``fulmen.report``: one self-contained HTML page showing what fulmen did with a program.

    fulmen.report(model, x, path="report.html")       # then open report.html in a browser

The page holds the pipeline of traces (each step's diff against the one before), the final forward (and
backward) trace with every fused region coloured and foldable, the time of each region measured in a profiled
run next to the same operations run op by op by PyTorch, the busiest PyTorch operations of one fulmen step
and one eager step, the peak memory of a step, and the cache's recompilations with their reasons. No server,
network, script or external stylesheet: the page is plain HTML with its CSS inline.

Times: ``speedup = eager time / fulmen time`` (above 1: fulmen is faster), with eager's and fulmen's steps
interleaved in this process so that a shared machine's load hits both alike.
"""

from __future__ import annotations

import contextlib
import difflib
import html
import re
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fulmen.core.bookkeeping import is_bookkeeping
from fulmen.frontend.jit import JittedFunction, get_stats
from fulmen.frontend.module import JittedModule

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1300px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 8px 0; } td, th { padding: 3px 10px; border-bottom: 1px solid #eee; }
th { text-align: left; background: #f5f5f5; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
pre { font: 12px/1.35 ui-monospace, monospace; margin: 0; white-space: pre; overflow-x: auto; }
details { margin: 4px 0; } summary { cursor: pointer; }
.step > summary { font-weight: 600; } .box { border: 1px solid #ddd; border-radius: 4px; padding: 6px 10px; }
.region { border-left: 6px solid; border-radius: 3px; padding: 2px 8px; margin: 3px 0; }
.region > summary { font: 12px ui-monospace, monospace; white-space: nowrap; overflow: hidden; }
.op { font: 12px ui-monospace, monospace; white-space: pre; overflow: hidden; text-overflow: ellipsis; }
details.plain { margin: 0; } details.plain > summary { list-style-position: outside; margin-left: 14px; }
details.plain > pre { color: #555; padding-left: 14px; }
.add { background: #e6ffec; } .del { background: #ffebe9; } .hunk { color: #6e7781; }
.t { display: inline-block; font: 600 11px system-ui; padding: 0 6px; border-radius: 8px; background: #eef;
     margin-right: 6px; }
.muted { color: #777; }
"""


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _is_jitted(obj: Any) -> bool:
    return isinstance(obj, JittedFunction | JittedModule)


def _original(obj: Any) -> Any:
    if isinstance(obj, JittedModule):
        return obj.original_module
    if isinstance(obj, JittedFunction):
        return obj.fn
    return obj


def _outputs(out: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def _make_step(fn: Callable, args: tuple, backward: bool, loss: Callable[[Any], torch.Tensor] | None
               ) -> Callable[[], Any]:
    """One step: the call and, with ``backward``, the backward of ``loss(output)`` (by default the sum of every
    differentiable output)."""

    def step():
        out = fn(*args)
        if backward:
            if loss is not None:
                loss(out).backward()
                return out
            diff = [o for o in _outputs(out) if o.requires_grad and o.dtype.is_floating_point]
            if diff:
                torch.autograd.backward([o.float().sum() for o in diff])
        return out

    return step


def _sync(args: tuple) -> None:
    if any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------------------
# measurements


def _regions(traces: list) -> list:
    return [b.sym for t in traces for b in t.bound_symbols if getattr(b.sym, "is_fusion", False)]


@contextlib.contextmanager
def _timed_regions(syms: list, times: dict[str, list[float]], eager_times: dict[str, list[float]],
                   sync: Callable[[], None]) -> Iterator[None]:
    """While active, each fused region's compiled kernels (and its unfused path) record their time, and after
    each call the same region runs once more op by op on PyTorch (``region.eager``), timed for comparison.
    Everything is put back on exit."""
    saved = []
    seen: set[int] = set()
    for sym in syms:
        region = sym.impl
        if id(region) in seen or not hasattr(region, "variants") or not hasattr(region, "eager"):
            continue  # a region object shared by two lines is wrapped once, so it is restored to the original
        seen.add(id(region))
        name = sym.name

        def timed(call, name=name, region=region, packs=False):
            def run(*a):
                args = list(a[0]) if packs else a  # a compiled kernel empties the list it is given
                sync()
                t0 = time.perf_counter()
                out = call(*a)
                sync()
                times.setdefault(name, []).append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                saved_eager(region)(*args)
                sync()
                eager_times.setdefault(name, []).append(time.perf_counter() - t0)
                return out

            return run

        saved.append((region, dict(region.variants), region.eager))
        _forget_fast(region)
        for key, fn in list(region.variants.items()):
            region.variants[key] = timed(fn, packs=True)
        region.eager = timed(region.eager)
    originals = {id(r): e for r, _, e in saved}

    def saved_eager(region):
        return originals[id(region)]

    try:
        yield
    finally:
        for region, variants, eager in saved:
            region.variants.clear()
            region.variants.update(variants)
            region.eager = eager
            _forget_fast(region)


def _forget_fast(region) -> None:
    """A region's C++-checked callable (``FusedRegion.fast``) is one of ``variants``': drop it when they change."""
    forget = getattr(region, "forget_fast", None)
    if forget is not None:
        forget()


def _peak_bytes(step: Callable[[], Any], cuda: bool) -> int | None:
    try:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - before
        from fulmen.bench.memory import cpu_step_peak_bytes

        return cpu_step_peak_bytes(step)
    except Exception:  # a profiler that cannot run here: the page says the figure is missing
        return None


def _op_profile(step: Callable[[], Any], cuda: bool) -> dict[str, tuple[int, float]]:
    """PyTorch operation -> (calls, self time in ms) over one step, from ``torch.profiler``."""
    from torch.profiler import ProfilerActivity, profile

    from fulmen.bench.memory import _quiet_stderr

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with _quiet_stderr(), profile(activities=activities) as prof:  # Kineto prints banners on stderr
        step()
    rows = {}
    for e in prof.key_averages():
        self_us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if e.key.startswith("aten::") or e.key.startswith("fulmen") or self_us > 0:
            rows[e.key] = (e.count, self_us / 1e3)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# HTML pieces


def _trace_text(trace) -> str:
    return str(trace)


def _title(trace, i: int) -> str:
    first = _trace_text(trace).splitlines()[0]
    m = re.match(r"# Constructed by (.*?)(?: \(took .*\))?$", first)
    return m.group(1) if m else ("the trace as recorded" if i == 0 else f"step {i}")


def _diff_html(before: str, after: str) -> str:
    rows = []
    for line in list(difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=2))[2:]:
        cls = "add" if line.startswith("+") else "del" if line.startswith("-") else "hunk" if line.startswith(
            "@@") else ""
        rows.append(f'<span class="{cls}">{_esc(line)}</span>' if cls else _esc(line))
    return "<pre>" + "\n".join(rows) + "</pre>" if rows else '<p class="muted">no change</p>'


def _pipeline_html(traces: list) -> str:
    parts = []
    for i, t in enumerate(traces):
        text = _trace_text(t)
        n = sum(1 for b in t.bound_symbols if not is_bookkeeping(b))
        took = f"{t.elapsed_ms:.1f} ms" if getattr(t, "elapsed_ms", None) is not None else ""
        head = f"{i}. {_esc(_title(t, i))} <span class=muted>({n} operations{', ' + took if took else ''})</span>"
        body = (_diff_html(_trace_text(traces[i - 1]), text) if i else "")
        body += f"<details><summary>the whole trace</summary><pre>{_esc(text)}</pre></details>"
        parts.append(f'<details class="step box"><summary>{head}</summary>{body}</details>')
    return "\n".join(parts)


def _ms(seconds: list[float] | None) -> float | None:
    return statistics.median(seconds) * 1e3 if seconds else None


def _fmt_ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.3f} ms"


def _statements(text: str) -> list[list[str]]:
    """A printed trace split into statements: each top-level line with the decomposition comments under it."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("def ")), 0)
    groups: list[list[str]] = [lines[:start + 1]]
    for ln in lines[start + 1:]:
        if ln.startswith("    ") and groups[-1] and len(groups) > 1:
            groups[-1].append(ln)
        else:
            groups.append([ln])
    return groups


def _final_trace_html(trace, times: dict, eager_times: dict) -> str:
    names = {b.sym.name for b in trace.bound_symbols if getattr(b.sym, "is_fusion", False)}
    order = sorted(names)
    groups = _statements(_trace_text(trace))
    signature = [ln for ln in groups[0] if ln.startswith("def ")]
    arg_types = []
    while len(groups) > 1 and groups[1][0].startswith("  # "):  # the argument type comments
        arg_types += groups.pop(1)
    out = [f'<details><summary class="op">{_esc(signature[0][:200] if signature else "")}</summary>'
           f'<pre>{_esc(chr(10).join(groups[0] + arg_types))}</pre></details>']
    for group in groups[1:]:
        head = group[0]
        found = [n for n in order if re.search(rf"\b{re.escape(n)}\(", head)]
        if not found or not head.startswith("  ") or head.startswith("  #"):
            if len(group) == 1:
                out.append(f'<div class="op">{_esc(head)}</div>')
            else:  # an operation outside any region, its decomposition folded under it
                out.append(f'<details class="plain"><summary class="op">{_esc(head)}</summary>'
                           f'<pre>{_esc(chr(10).join(group[1:]))}</pre></details>')
            continue
        name = found[0]
        hue = (order.index(name) * 67) % 360
        ops = [ln for ln in group[1:] if re.match(r"^    # \S", ln)]
        ours, theirs = _ms(times.get(name)), _ms(eager_times.get(name))
        badges = (f'<span class="t">{_esc(name)}</span><span class="t">{len(ops)} ops</span>'
                  f'<span class="t">fulmen {_fmt_ms(ours)}</span><span class="t">op by op {_fmt_ms(theirs)}</span>')
        out.append(f'<details class="region" style="border-color: hsl({hue} 65% 45%); '
                   f'background: hsl({hue} 80% 96%)"><summary>{badges}<br>{_esc(head.strip()[:240])}</summary>'
                   f'<pre>{_esc(chr(10).join(group[1:]))}</pre></details>')
    return "\n".join(out)


def _table(headers: list[str], rows: list[list[Any]], numeric: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f'<td{" class=n" if i in numeric else ""}>{_esc(c)}</td>'
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _profile_html(ours: dict, eager: dict, top: int = 20) -> str:
    keys = sorted(set(ours) | set(eager), key=lambda k: -max(ours.get(k, (0, 0))[1], eager.get(k, (0, 0))[1]))
    rows = []
    for k in keys[:top]:
        oc, oms = ours.get(k, (0, 0.0))
        ec, ems = eager.get(k, (0, 0.0))
        rows.append([k, oc, f"{oms:.3f}", ec, f"{ems:.3f}"])
    return _table(["operation", "fulmen calls", "fulmen self ms", "eager calls", "eager self ms"], rows,
                  {1, 2, 3, 4})


def _mb(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**20:.2f} MB"


# ---------------------------------------------------------------------------------------------------------------
# the public function


def report(fn_or_module: Callable | torch.nn.Module, *args, path: str | Path = "report.html", steps: int = 10,
           backward: bool | None = None, loss: Callable[[Any], torch.Tensor] | None = None, **jit_options) -> Path:
    """Compile ``fn_or_module`` (or use it, when it is already ``fulmen.jit``'d), run it on ``args``, and write one
    self-contained HTML page to ``path``: the pipeline of traces with a diff per step, the final trace(s) with
    each fused region coloured and foldable, per-region and per-operation times next to eager PyTorch's, the
    peak memory of a step and the recompilations with their reasons. Returns the path.

    ``backward`` (default: when an output requires grad) adds a backward to each step: of ``loss(output)`` when
    given (``loss=lambda out: out[1]`` for a model returning logits and loss), else of the sum of the outputs.
    ``jit_options`` go to ``fulmen.jit`` (e.g. ``executors=["torch"]``); regions compile before timing.

        fulmen.report(model, x, path="report.html")
    """
    import fulmen

    if steps < 1:
        raise ValueError(f"fulmen.report: steps must be at least 1, got {steps}")
    jitted = fn_or_module if _is_jitted(fn_or_module) else fulmen.jit(fn_or_module, **{"compile": "sync",
                                                                                         **jit_options})
    eager_fn = _original(fn_or_module)
    run = _measure(jitted, eager_fn, args, steps, backward, loss)
    name = getattr(eager_fn, "__name__", None) or type(eager_fn).__name__
    path = Path(path)
    path.write_text(_page(name, run), encoding="utf-8")
    return path


@dataclass
class _Measured:
    """What one report measured: fulmen's traces and statistics, and times, profiles and peak memory of a step
    next to eager's."""

    stats: Any
    forward: list
    backward_traces: list
    backward: bool
    cuda: bool
    steps: int
    step_times: dict[str, list[float]]
    region_times: dict[str, list[float]]
    region_eager: dict[str, list[float]]
    profiles: tuple[Any, Any]
    peaks: tuple[int | None, int | None]


def _measure(jitted, eager_fn, args: tuple, steps: int, backward: bool | None, loss) -> _Measured:
    """Run both, fulmen's regions compiled first; then time ``steps`` interleaved steps, profile one step each and
    measure each one's peak memory."""
    import fulmen
    from fulmen.executors import inductor

    sync = lambda: _sync(args)  # noqa: E731
    cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
    out = jitted(*args)
    if backward is None:
        backward = torch.is_grad_enabled() and any(o.requires_grad for o in _outputs(out))
    fulmen_step, eager_step = _make_step(jitted, args, backward, loss), _make_step(eager_fn, args, backward, loss)
    for _ in range(2):  # the first calls may run on PyTorch autograd while fulmen's program compiles
        fulmen_step()
    inductor.wait_for_compilations()
    eager_step()
    forward = fulmen.last_traces(jitted)
    backward_traces = fulmen.last_backward_traces(jitted) if backward else []
    m = _Measured(get_stats(jitted), forward, backward_traces, backward, cuda, steps, {"fulmen": [], "eager": []},
                  {}, {}, (None, None), (None, None))
    with _timed_regions(_regions(forward[-1:] + backward_traces[-1:]), m.region_times, m.region_eager, sync):
        fulmen_step()
    for _ in range(steps):  # interleaved: both see the same machine
        for name, step in (("eager", eager_step), ("fulmen", fulmen_step)):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            m.step_times[name].append(time.perf_counter() - t0)
    m.profiles = (_op_profile(fulmen_step, cuda), _op_profile(eager_step, cuda))
    m.peaks = (_peak_bytes(fulmen_step, cuda), _peak_bytes(eager_step, cuda))
    return m


def _summary_sections(name: str, m: _Measured) -> list[str]:
    """The page's head: what ran, the summary table, the fused regions' times and the final traces."""
    ours_ms, eager_ms = _ms(m.step_times["fulmen"]), _ms(m.step_times["eager"])
    summary = _table(["", "fulmen", "eager PyTorch"], [
        ["median step (interleaved)", _fmt_ms(ours_ms), _fmt_ms(eager_ms)],
        ["speedup = eager time / fulmen time", f"{eager_ms / ours_ms:.2f}" if ours_ms else "-", "1.00"],
        ["peak memory allocated in a step (above what was live before it)", _mb(m.peaks[0]), _mb(m.peaks[1])],
        ["fused regions (forward, backward)",
         f"{len(_regions(m.forward[-1:]))}, {len(_regions(m.backward_traces[-1:]))}", "-"],
    ], {1, 2})
    times, eager = m.region_times, m.region_eager
    region_rows = [[n, _fmt_ms(_ms(times.get(n))), _fmt_ms(_ms(eager.get(n))),
                    f"{_ms(eager[n]) / _ms(times[n]):.2f}" if times.get(n) and eager.get(n) and _ms(times[n])
                    else "-"] for n in sorted(times)]
    sections = [
        f"<h1>fulmen report: {_esc(name)}</h1>",
        f'<p class="muted">torch {_esc(torch.__version__)}, {"CUDA" if m.cuda else "CPU"}, '
        f'{torch.get_num_threads()} threads; {"forward and backward" if m.backward else "forward"} per step; '
        f"{m.steps} interleaved steps each. Speedup = eager time / fulmen time (above 1: fulmen is faster).</p>",
        "<h2>Summary</h2>", summary,
        "<h2>Fused regions</h2>",
        "<p>Each region's compiled kernel against the same operations run one by one by PyTorch "
        "(median of the profiled run's calls).</p>",
        _table(["region", "fulmen", "op by op (eager)", "speedup"], region_rows, {1, 2, 3}) if region_rows
        else '<p class="muted">No fused regions (the executors list has no fusion executor, or nothing fused).</p>',
        "<h2>Final forward trace</h2>",
        '<p class="muted">Coloured blocks are fused regions; open one to see its operations.</p>',
        f'<div class="box">{_final_trace_html(m.forward[-1], times, eager)}</div>',
    ]
    if m.backward_traces:
        sections += ["<h2>Final backward trace</h2>",
                     f'<div class="box">{_final_trace_html(m.backward_traces[-1], times, eager)}</div>']
    return sections


def _page(name: str, m: _Measured) -> str:
    """The whole HTML page: the summary sections, then the pipeline, the profiles and the compilation."""
    stats = m.stats
    phases = _table(["phase", "ms"], [[k, f"{v:.2f}"] for k, v in stats.phase_times_ms.items()], {1})
    reasons = stats.recompile_reasons
    recompiles = (f"<p>{stats.calls} calls, {stats.cache_hits} cache hits, {stats.cache_misses} compilations.</p>"
                  + (_table(["#", "why it recompiled"], [[i + 2, r] for i, r in enumerate(reasons)], {0})
                     if reasons else "<p>No recompilation: every call matched the first compilation's checks.</p>"))
    sections = _summary_sections(name, m) + [
        "<h2>Pipeline</h2>",
        "<p>Each step of the forward pipeline (<code>fulmen.last_traces</code>), with its diff against the one "
        "before; open a step to see it.</p>", _pipeline_html(m.forward),
    ]
    if m.backward_traces:
        sections += ["<h3>Backward pipeline</h3>", _pipeline_html(m.backward_traces)]
    sections += [
        "<h2>PyTorch operations in one step</h2>",
        "<p>Self time per operation from <code>torch.profiler</code>, one step each, busiest first. The fused "
        "regions' kernels are not PyTorch operations: their time is in the region table above, and in the self "
        "time of fulmen's forward and backward (<code>FulmenFunction</code>, <code>FulmenFunctionBackward</code>"
        ").</p>",
        _profile_html(*m.profiles),
        "<h2>Compilation</h2>", phases,
        "<h2>Recompilations</h2>", recompiles,
    ]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>fulmen report: {_esc(name)}</title><style>{_CSS}</style></head><body>\n"
            + "\n".join(sections) + "\n</body></html>\n")
