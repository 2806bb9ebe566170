"""PyTorch's own OpInfo database (``op_db``) through ``fulmen.jit`` on CPU: forward and gradients against eager.

For every op of ``torch.testing._internal.common_methods_invocations.op_db`` that supports the dtype on CPU, up to
``--samples`` of its sample inputs run through eager PyTorch and through ``fulmen.jit`` of the same callable (fresh
copies of the inputs each). An op passes forward when every sample's outputs match eager's; it passes gradients
(ops with ``supports_autograd``, float32 and float64) when every sample's input gradients for the same random
output cotangents match eager's. Random ops run under the same ``torch.manual_seed`` and must match exactly as
other ops do: with the torch executor fulmen draws the numbers eager draws.

Tolerances: torch.testing's defaults for the dtype, widened to the largest ``toleranceOverride`` the OpInfo itself
declares for that dtype (in any of its tests), since that is what PyTorch accepts between its own variants.

    python benchmarks/op_db_coverage.py                         # float32, torch executor
    python benchmarks/op_db_coverage.py --dtype bfloat16
    python benchmarks/op_db_coverage.py --ops gather scatter    # op names containing these
    python benchmarks/op_db_coverage.py --default-executors     # fulmen's default executors (Inductor fusion)

Each op prints one line: ``ok`` or ``fail`` with the reason class (error type, mismatch, ...) and the first line
of the reason, forward and gradients separately; totals at the end. Needs ``expecttest`` (PyTorch's internal test
utilities import it): ``pip install expecttest``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
import warnings

import torch
from torch.utils._pytree import tree_flatten

import fulmen

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
GRAD_DTYPES = (torch.float32, torch.float64)
SEED = 20240607
#: Ops whose values are uninitialized memory: only their shape, dtype and strides are compared.
UNINITIALIZED = frozenset(("empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"))


class OpTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    def raise_timeout(signum, frame):
        raise OpTimeout(f"took more than {seconds:g} s")

    old = signal.signal(signal.SIGALRM, raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def tolerances(op, dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol): torch.testing's default for ``dtype``, widened to the OpInfo's own overrides for it."""
    from torch.testing._comparison import default_tolerances
    from torch.testing._internal.common_device_type import toleranceOverride

    rtol, atol = default_tolerances(dtype)
    for info in op.decorators:
        for dec in getattr(info, "decorators", (info,)):
            if isinstance(dec, toleranceOverride) and dtype in dec.d:
                rtol, atol = max(rtol, dec.d[dtype].rtol), max(atol, dec.d[dtype].atol)
    return rtol, atol


def clone(x):
    from fulmen.testing import clone_args

    return clone_args(x)


class Mismatch(Exception):
    pass


def compare(actual, expected, rtol: float, atol: float, what: str, values: bool = True) -> None:
    a_flat, a_spec = tree_flatten(actual)
    e_flat, e_spec = tree_flatten(expected)
    if len(a_flat) != len(e_flat):
        raise Mismatch(f"{what}: {len(a_flat)} values, eager returns {len(e_flat)} ({a_spec} vs {e_spec})")
    for i, (a, e) in enumerate(zip(a_flat, e_flat)):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                raise Mismatch(f"{what}[{i}]: {type(a).__name__}, eager returns a tensor")
            if e.layout != torch.strided or a.layout != torch.strided:
                if a.layout != e.layout:
                    raise Mismatch(f"{what}[{i}]: layout {a.layout}, eager {e.layout}")
                a, e = a.to_dense(), e.to_dense()
            if not values:
                if (a.shape, a.dtype, a.stride()) != (e.shape, e.dtype, e.stride()):
                    raise Mismatch(f"{what}[{i}]: {a.dtype}{list(a.shape)} strides {a.stride()}, eager "
                                   f"{e.dtype}{list(e.shape)} strides {e.stride()}")
                continue
            try:
                torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True)
            except AssertionError as err:
                raise Mismatch(f"{what}[{i}]: " + " ".join(str(err).split("\n")[:3])) from None
        elif a != e and not (isinstance(e, float) and e != e and a != a):
            raise Mismatch(f"{what}[{i}]: {a!r}, eager {e!r}")


def differentiable(x) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad and (x.is_floating_point() or x.is_complex())


def call(fn, sample):
    first, rest, kwargs = clone((sample.input, sample.args, sample.kwargs))
    inputs = first, *rest
    torch.manual_seed(SEED)
    return fn(*inputs, **kwargs), (inputs, kwargs)


def grads(out, inputs):
    """Gradients of ``out`` (seeded random cotangents) with respect to the differentiable tensors in ``inputs``."""
    outs = [o for o in tree_flatten(out)[0] if differentiable(o)]
    ins = [i for i in tree_flatten(inputs)[0] if differentiable(i)]
    if not outs or not ins:
        return None
    gen = torch.Generator().manual_seed(SEED)
    cotangents = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
    got = torch.autograd.grad(outs, ins, cotangents, allow_unused=True)
    return [torch.zeros_like(i) if g is None else g for g, i in zip(got, ins)]


def reason(err: BaseException) -> tuple[str, str]:
    first = str(err).strip().split("\n")[0][:200] if str(err).strip() else ""
    return type(err).__name__, first


def check_op(op, dtype, *, executors, max_samples: int, timeout: float) -> dict:
    """Forward and (when applicable) gradient results of one op: {"fwd": (cls, msg) | None, "grad": ... | "n/a"}."""
    want_grad = op.supports_autograd and dtype in GRAD_DTYPES
    rtol, atol = tolerances(op, dtype)
    result = {"fwd": None, "grad": None if want_grad else "n/a", "samples": 0}

    def jitted(*args, **kwargs):
        return op.op(*args, **kwargs)

    try:
        with time_limit(timeout):
            samples = op.sample_inputs("cpu", dtype, requires_grad=want_grad)
            for sample in samples:
                if result["samples"] >= max_samples:
                    break
                try:
                    expected, (e_inputs, _) = call(op.op, sample)
                    expected_grads = grads(expected, e_inputs) if want_grad else None
                except Exception:
                    continue  # a sample eager rejects tells nothing about fulmen
                result["samples"] += 1
                fn = fulmen.jit(jitted, executors=executors)
                try:
                    actual, (a_inputs, _) = call(fn, sample)
                except OpTimeout:
                    raise
                except Exception as err:
                    result["fwd"] = result["fwd"] or reason(err)
                    if want_grad and result["grad"] is None:
                        result["grad"] = ("forward failed", "")
                    continue
                try:
                    compare(actual, expected, rtol, atol, "output", values=op.name not in UNINITIALIZED)
                except Mismatch as err:
                    result["fwd"] = result["fwd"] or ("mismatch", str(err))
                if want_grad and result["grad"] is None:
                    try:
                        actual_grads = grads(actual, a_inputs)
                        if (actual_grads is None) != (expected_grads is None):
                            raise Mismatch(f"gradient {'missing' if actual_grads is None else 'unexpected'}")
                        if expected_grads is not None:
                            compare(actual_grads, expected_grads, rtol, atol, "grad")
                    except OpTimeout:
                        raise
                    except Mismatch as err:
                        result["grad"] = ("mismatch", str(err))
                    except Exception as err:
                        result["grad"] = reason(err)
    except OpTimeout as err:
        result["fwd"] = result["fwd"] or ("timeout", str(err))
    except Exception as err:  # the sample generator itself failed
        result["fwd"] = result["fwd"] or ("samples failed", reason(err)[0] + ": " + reason(err)[1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--samples", type=int, default=4, help="samples per op (default 4)")
    parser.add_argument("--ops", nargs="*", default=None, help="only ops whose name contains one of these")
    parser.add_argument("--exact", action="store_true", help="--ops names must match exactly")
    parser.add_argument("--default-executors", action="store_true",
                        help="fulmen's default executors (Inductor fusion, sdpa, ...) instead of torch alone")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per op before it counts as failed")
    parser.add_argument("--failures-only", action="store_true", help="print only the ops that fail")
    parser.add_argument("--json", help="write per-op results to this file")
    args = parser.parse_args(argv)

    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except ModuleNotFoundError as err:
        print(f"op_db_coverage: PyTorch's OpInfo database needs {err.name!r}: pip install {err.name}", file=sys.stderr)
        return 2

    dtype = DTYPES[args.dtype]
    executors = None if args.default_executors else ["torch"]
    ops = [op for op in op_db if dtype in op.supported_dtypes("cpu")]
    if args.ops:
        ops = [op for op in ops if any((n == op.full_name if args.exact else n in op.full_name) for n in args.ops)]
    warnings.filterwarnings("ignore")
    torch.set_grad_enabled(True)

    results = {}
    start = time.perf_counter()
    for op in ops:
        r = check_op(op, dtype, executors=executors, max_samples=args.samples, timeout=args.timeout)
        if r["samples"] == 0 and r["fwd"] is None:
            continue  # no sample eager accepts: nothing to compare
        results[op.full_name] = r
        fwd = "ok" if r["fwd"] is None else f"fail {r['fwd'][0]}: {r['fwd'][1]}"
        grad = {"n/a": "", None: "  | grad ok"}.get(r["grad"]) if not isinstance(r["grad"], tuple) else (
            f"  | grad fail {r['grad'][0]}: {r['grad'][1]}")
        if not args.failures_only or r["fwd"] is not None or isinstance(r["grad"], tuple):
            print(f"{op.full_name:<45} {fwd}{grad}", flush=True)

    n_fwd = len(results)
    ok_fwd = sum(r["fwd"] is None for r in results.values())
    graded = [r for r in results.values() if r["grad"] != "n/a"]
    ok_grad = sum(r["grad"] is None for r in graded)
    executors_name = "default executors" if args.default_executors else "torch executor"
    print(f"\n{args.dtype}, {executors_name}, up to {args.samples} samples per op, "
          f"{time.perf_counter() - start:.0f} s")
    print(f"forward:   {ok_fwd}/{n_fwd} ops ({100 * ok_fwd / max(n_fwd, 1):.1f}%)")
    if graded:
        print(f"gradients: {ok_grad}/{len(graded)} ops ({100 * ok_grad / len(graded):.1f}%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "executors": executors_name, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
