"""Running a program eagerly and with ``fulmen.jit``, and comparing what each did (``check``)."""

from __future__ import annotations

import contextlib
import math
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fulmen.fuzz.program import _FLOATS, Program, make_inputs, resized, restyled

# (rtol, atol) by dtype: a few units in the last place, as two orders of float rounding give
_TOLERANCES = {torch.float64: (1e-7, 1e-7), torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2),
               torch.float16: (2e-3, 2e-3)}
_HALVES = (torch.bfloat16, torch.float16)
# fulmen may be this many times further from the float64 run than eager is (plus the dtype's tolerance)
_REF_MULTIPLIER = 3.0


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
    options: dict = field(default_factory=dict)  # check()'s keyword options that found it (minimize keeps them)

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



def _cotangent(out: torch.Tensor, k: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + k)
    return torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)


def run_program(program: Program, fn_wrap: Callable[[Callable], Callable] | None = None,
                upcast: bool = False, calls: int = 1, variants: list[Program] | None = None,
                autocast: bool = False) -> list[Outcome]:
    """Run the program ``calls`` times on fresh inputs, through ``fn_wrap`` (e.g. ``fulmen.jit``) applied once: the
    second call of a compiled program is a cache hit. The module form keeps its module and copies each call's
    parameter values into it. ``variants``: the program each call makes its inputs from (the same statements on
    inputs of other sizes); ``autocast``: calls run under CPU autocast to bfloat16. Each call seeds torch's
    generator first, so random ops draw the same numbers in every run."""
    results = []
    call = module = None
    for k in range(len(variants) if variants else calls):
        inputs = make_inputs(variants[k] if variants else program, upcast)
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
        torch.manual_seed(program.seed + k)
        outcome = _run_call(program, call, args, leaves, autocast, trace_of=call if fn_wrap and not results else None)
        outcome.inputs = [inputs[i.name] for i in program.args()]
        if module is not None:  # parameters may be written in place (``p.add_``): compared too
            outcome.inputs += [getattr(module, p.name) for p in program.params()]
        results.append(outcome)
    return results


def _run_call(program: Program, call: Callable, args: list, leaves: list, autocast: bool,
              trace_of: Callable | None) -> Outcome:
    """One call and its backward (random cotangents), or the error either raised."""
    outcome = Outcome()
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    try:
        with torch.set_grad_enabled(program.grad), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outcome.stage = "forward"
            with cast:
                outs = list(call(*args))
            outcome.outputs = outs
            if trace_of is not None:
                outcome.traced = _traced_outputs(trace_of)
            outcome.stage = "backward"
            diff = [(o, k) for k, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
            if diff and leaves and program.grad:
                grads = torch.autograd.grad([o for o, _ in diff], leaves,
                                            grad_outputs=[_cotangent(o, k) for o, k in diff], allow_unused=True)
                outcome.grads = list(grads)
            outcome.stage = ""
    except Exception as e:  # compared with what eager did
        outcome.error = e
    return outcome


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
    if w.is_complex():  # real and imaginary parts compared as floats of their own dtype
        r = torch.view_as_real(ref.detach().resolve_conj()) if ref is not None and ref.is_complex() else None
        return _close(torch.view_as_real(g.resolve_conj()), torch.view_as_real(w.resolve_conj()), r, floor)
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
    if ref is not None and floor in _HALVES and _rms_explains(g64, w64, ref.detach().double(), atol, mask):
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
    if "float16" in source or ".half()" in source or any(i.dtype is torch.float16 for i in program.inputs):
        return torch.float16
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
    computes in bfloat16 or float16, whose sums differ by the order of their roundings element by element."""
    if ref.shape != g.shape:
        return False
    keep = mask & torch.isfinite(ref)
    if not keep.any():
        return False

    def rms(x: torch.Tensor) -> float:
        return float(((x[keep] - ref[keep]) ** 2).mean().sqrt())

    return rms(g) <= _REF_MULTIPLIER * rms(w) + atol


def _compare(program: Program, got: Outcome, want: Outcome, ref: Outcome | None, executors: str,
             call: int, floor: torch.dtype | None = None) -> Mismatch | None:
    """The first way fulmen's call differs from eager's (errors, outputs, inputs written, gradients), or None."""
    if want.error is not None or got.error is not None:
        found = _error_difference(got, want)
    else:
        floor = floor or _floor_dtype(program)
        ok_ref = ref if ref is not None and ref.error is None else None
        found = (_output_difference(program, got, want, ok_ref, floor)
                 or _input_difference(program, got, want, ok_ref, floor) or _grad_difference(got, want, ok_ref, floor))
    return Mismatch(found[0], f"call {call}: {found[1]}", program, executors) if found else None


def _error_difference(got: Outcome, want: Outcome) -> tuple[str, str] | None:
    if want.error is not None:
        if "INTERNAL ASSERT FAILED" in str(want.error):
            return None  # a PyTorch bug (eager asks for a report), not a behaviour to match; counted by run_fuzz
        if got.error is None:
            return "error", (f"eager raised in {want.stage} ({type(want.error).__name__}: "
                             f"{_first_line(want.error)}) but fulmen did not")
        return None
    return "error", (f"fulmen raised in {got.stage} but eager did not: {type(got.error).__name__}: "
                     f"{_first_line(got.error)}")


def _output_difference(program: Program, got: Outcome, want: Outcome, ref: Outcome | None,
                       floor) -> tuple[str, str] | None:
    if len(got.outputs) != len(want.outputs):
        return "structure", f"{len(got.outputs)} outputs, eager {len(want.outputs)}"
    if got.traced is not None and len(got.traced) == len(got.outputs):
        for k, (g, meta) in enumerate(zip(got.outputs, got.traced)):
            if isinstance(g, torch.Tensor) and meta is not None and meta != (tuple(g.shape), g.dtype):
                return "metadata", (f"output {k} ({program.outputs[k]}): the trace recorded {meta[1]} "
                                    f"{list(meta[0])}, the call returned {g.dtype} {list(g.shape)}")
    refs = ref.outputs if ref is not None else [None] * len(want.outputs)
    for k, (g, w, r) in enumerate(zip(got.outputs, want.outputs, refs)):
        if not isinstance(g, torch.Tensor) or not isinstance(w, torch.Tensor):
            if type(g) is not type(w) or g != w:
                return "values", f"output {k}: {g!r} != eager's {w!r}"
            continue
        if g.requires_grad != w.requires_grad:
            return "metadata", (f"output {k} ({program.outputs[k]}): requires_grad {g.requires_grad} != "
                                f"eager's {w.requires_grad}")
        why = _close(g, w, r if isinstance(r, torch.Tensor) else None, floor)
        if not why and program.hunt:
            why = _zero_sign_difference(g, w)
        if why:
            return "values", f"output {k} ({program.outputs[k]}): {why}"
    return _layout_difference(program, got.outputs, want.outputs) if program.wide or program.hunt else None


def _zero_sign_difference(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """Where both are zero, whether eager's zero is -0.0 and fulmen's +0.0 or the reverse (a later ``1 / x``,
    ``atan2`` or ``copysign`` turns that into a different value)."""
    if not want.dtype.is_floating_point or got.shape != want.shape:
        return None
    g, w = got.detach(), want.detach()
    bad = (g == 0) & (w == 0) & (g.signbit() != w.signbit())
    if not bad.any():
        return None
    idx = bad.nonzero()[0].tolist()
    return f"zero of another sign at {idx}: {g[tuple(idx)].item()!r} != eager's {w[tuple(idx)].item()!r}"


def _significant_strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(s for s, n in zip(t.stride(), t.shape) if n > 1)  # a size-1 dim's stride is never observable


def _layout_difference(program: Program, got: list, want: list) -> tuple[str, str] | None:
    """Strides of the outputs, and which outputs share memory with which, as eager's."""
    tensors = [k for k, w in enumerate(want) if isinstance(w, torch.Tensor) and isinstance(got[k], torch.Tensor)]
    for k in tensors:
        if got[k].numel() > 1 and _significant_strides(got[k]) != _significant_strides(want[k]):
            return "layout", (f"output {k} ({program.outputs[k]}): strides {got[k].stride()} != eager's "
                              f"{want[k].stride()}")
    for i in tensors:
        for j in tensors:
            if i < j and want[i].numel() and want[j].numel():
                shares = [x[i].untyped_storage().data_ptr() == x[j].untyped_storage().data_ptr() for x in (got, want)]
                if shares[0] != shares[1]:
                    return "aliasing", (f"outputs {i} ({program.outputs[i]}) and {j} ({program.outputs[j]}) "
                                        f"{'share' if shares[0] else 'do not share'} memory; eager's "
                                        f"{'do' if shares[1] else 'do not'}")
    return None


def _input_difference(program: Program, got: Outcome, want: Outcome, ref: Outcome | None,
                      floor) -> tuple[str, str] | None:
    names = [i.name for i in program.args()] + [p.name for p in program.params()]
    ref_inputs = ref.inputs if ref is not None else [None] * len(want.inputs)
    for name, g, w, r in zip(names, got.inputs, want.inputs, ref_inputs):
        why = _close(g, w, r, floor)
        if why:
            return "input-mutation", f"input {name} after the call: {why}"
    return None


def _grad_difference(got: Outcome, want: Outcome, ref: Outcome | None, floor) -> tuple[str, str] | None:
    ref_grads = ref.grads if ref is not None and len(ref.grads) == len(want.grads) else [None] * len(want.grads)
    if len(got.grads) != len(want.grads):
        return "grad", f"{len(got.grads)} gradients, eager {len(want.grads)}"
    for k, (g, w, r) in enumerate(zip(got.grads, want.grads, ref_grads)):
        if (g is None) != (w is None):
            # no gradient and a zero gradient are the same to a user's optimizer; anything else is not
            other = g if g is not None else w
            if not torch.all(other == 0):
                return "grad", (f"gradient {k}: {'None' if g is None else 'a tensor'} where eager has "
                                f"{'None' if w is None else 'a nonzero tensor'}")
            continue
        if g is None:
            continue
        why = _close(g, w, r, floor)
        if why:
            return "grad", f"gradient {k}: {why}"
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().split("\n")[0]
    return text if len(text) <= 200 else text[:197] + "..."


def _jit(executors: str) -> Callable[[Callable], Callable]:
    import fulmen

    if executors == "torch":
        return lambda fn: fulmen.jit(fn, executors=["torch"])
    if executors == "backend":
        torch._dynamo.reset()
        return lambda fn: torch.compile(fn, backend="fulmen", dynamic=False)
    return lambda fn: fulmen.jit(fn, compile="sync")


# how a dynamic-shape check renames sizes (1 stays 1, so that broadcasting is unchanged)
_RESIZES = ({2: 3, 3: 5, 4: 2, 5: 4}, {2: 5, 3: 2, 4: 3, 5: 6})


def check(program: Program, executors: str = "torch", calls: int = 2, dynamic: bool = False,
          autocast: bool = False, restyle: bool = False) -> Mismatch | None:
    """Run ``program`` eagerly and with fulmen (``executors``: "torch", "default" or "backend", the last
    ``torch.compile(backend="fulmen")``); the first difference. ``dynamic``: the calls see the inputs at their sizes,
    then at two other sizes, then at the first two again (where eager rejects a size, fulmen must too);
    ``autocast``: every call runs under CPU autocast to bfloat16; ``restyle``: the calls see the inputs, then in
    other layouts, then as first, then with float32 ones in float64 (sizes kept: the cache must tell them apart)."""
    if dynamic and program.module:  # a module's parameters keep their sizes: resize the function form
        program = replace(program, module=False, inputs=[replace(i, param=False) for i in program.inputs])
    variants = [program, *(resized(program, r) for r in _RESIZES), program, resized(program, _RESIZES[0])] \
        if dynamic else None
    if restyle:
        variants = [program, restyled(program, "layout"), program, restyled(program, "dtype")]
    want = run_program(program, calls=calls, variants=variants, autocast=autocast)
    refs: list[Outcome | None] = []
    for variant in variants or [program]:
        try:
            refs.append(run_program(variant, upcast=True)[0])
        except Exception:
            refs.append(None)
    try:
        got = run_program(program, _jit(executors), calls=calls, variants=variants, autocast=autocast)
    except Exception as e:  # outside the call itself (never expected): a mismatch, with its traceback
        return Mismatch("crash", "".join(traceback.format_exception(e))[-2000:], program, executors)
    for k, (g, w) in enumerate(zip(got, want)):
        ref = refs[k] if variants else refs[0]
        m = _compare(program, g, w, ref, executors, k + 1, torch.bfloat16 if autocast else None)
        if m is not None:
            m.options = {"dynamic": dynamic, "autocast": autocast, "restyle": restyle, "calls": calls}
            return m
    return None
