"""Split points: Python that reads a tensor's value while fulmen traces (``t.item()``, ``t.tolist()``, ``bool(t)``
in an ``if``, ``int(t)``, ``float(t)``).

Where tracing meets such a read, the part of the program traced so far runs on the call's real tensors (with the
torch executor, without autograd, with the random-number state put back after, and without its writes into inputs),
the value is read from its result, and tracing goes on with that Python value. The trace records a split point,
``value_guard``, at that line::

    fulmen.value_guard(t3, 'bool', True, 0, 'File "model.py", line 12: if h.sum() > 0:')

The compiled program checks it when it runs: the same value lets the call go on; another raises
``ValueChanged`` before the program has written anything the caller sees, and the caller (``fulmen.jit``) runs
the program compiled for that value, compiling it once the first time. The programs of one call signature form a
chain keyed by the values read in order, so each branch compiles once (``JittedFunction._value_changed``).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from fulmen.core.proxies import DataDependentError, TensorProxy, _user_location
from fulmen.core.symbol import OpTags, Symbol
from fulmen.core.trace import Trace

log = logging.getLogger("fulmen")

#: How each kind of read turns the tensor into a Python value (eager's own conversions, errors included).
READERS: dict[str, Callable[[torch.Tensor], Any]] = {
    "bool": bool, "item": lambda t: t.item(), "tolist": lambda t: t.tolist(), "int": int, "float": float,
    "index": lambda t: t.__index__(),
}

#: How the logs spell each kind of read.
_SPELLING = {"bool": "bool({})", "item": "{}.item()", "tolist": "{}.tolist()", "int": "int({})",
             "float": "float({})", "index": "{}.__index__()"}

#: How many branches (distinct sequences of values read) one call signature compiles; past that, a call whose
#: values need another branch runs eagerly (logged once), as a value that keeps changing (a float from .item()
#: that feeds later Python) would otherwise compile on every call.
MAX_BRANCHES = 8


class ValueChanged(Exception):
    """Raised by a compiled program at a split point whose value differs from the one it was traced with."""

    def __init__(self, index: int, value: Any):
        super().__init__(f"the value read at split point {index} is now {value!r}")
        self.index = index
        self.value = value


def same_value(a: Any, b: Any) -> bool:
    """Equality of values read, where NaN equals NaN (a NaN read would otherwise never match its own branch)
    and 1 differs from True (``bool`` and ``int`` reads take other branches in user code)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


def _guard_impl(t: torch.Tensor, kind: str, expected: Any, index: int, where: str) -> None:
    value = READERS[kind](t)
    if not same_value(value, expected):
        raise ValueChanged(index, value)


def _guard_meta(t, kind, expected, index, where):
    return None


value_guard = Symbol(name="value_guard", meta=_guard_meta, id="fulmen.value_guard", is_prim=True, module="fulmen",
                     tags=(OpTags.SIDE_EFFECT, OpTags.DONT_DCE, OpTags.NON_DIFFERENTIABLE), torch_impl=_guard_impl,
                     skip_meta_check=True)


class ValueReader:
    """What ``UserTracer.read_value`` asks: computes a value the traced Python needs from the call's real tensors."""

    def __init__(self, trace: Trace, real_inputs: Callable[[], list[torch.Tensor]]):
        self.trace = trace
        self.real_inputs = real_inputs  # the call's tensors, in the order of trace.args (captured ones grow)
        self.values: list[Any] = []  # the values read, in order: the key of this branch
        self.where: list[str] = []  # the user's line of each read

    def __call__(self, kind: str, proxy: TensorProxy, what: str) -> Any:
        trace = self.trace
        if len(trace.scopes) != 1 and not _defined_at_top(trace, proxy):
            # a value an operation's decomposition computed: the program has no line between its parts to split at
            raise _not_splittable(what, proxy, "it is computed inside an operation fulmen records as a whole")
        real = self._compute(proxy)
        value = READERS[kind](real)  # eager's own conversion: a tensor of several elements raises as in eager
        index = len(self.values)
        where = _user_location()
        self.values.append(value)
        self.where.append(where)
        # at the top of the trace, before the operation being recorded if the read is in its arguments
        # (torch.zeros(n, 4) with n a tensor): a guard among its subsymbols would be dropped with them
        trace.bound_symbols.append(value_guard.bind(proxy, kind, value, index, where, output=None))
        log.info("fulmen: split point %d in %s: %s read as %r at %s", index, trace.fn_name,
                 _SPELLING[kind].format(proxy.name), value, where)
        return value

    def _compute(self, proxy: TensorProxy) -> torch.Tensor:
        """Run the trace so far, up to ``proxy``, on the call's tensors."""
        from fulmen.executors.torchex import ex as torch_ex
        from fulmen.frontend.compile import execution_pipeline

        trace = self.trace
        # writes into inputs (copy_) and other side effects happen when the compiled program runs, not here
        kept = [b for b in trace.bound_symbols if OpTags.SIDE_EFFECT not in b.sym.tags]
        prefix = trace.derive("prefix (split point)", kept)
        prefix.args = list(trace.args)
        prefix.output = proxy
        fn, _ = execution_pipeline(prefix, [torch_ex], {})
        inputs = self.real_inputs()
        if len(inputs) != len(trace.args) or any(
                isinstance(p, TensorProxy) and not isinstance(t, torch.Tensor) for p, t in zip(trace.args, inputs)):
            raise _not_splittable("reading a tensor's value", proxy, "fulmen could not match the traced inputs "
                                  "with the call's tensors to compute it")
        devices = sorted({t.device.index or 0 for t in inputs if t.device.type == "cuda"})
        with torch.no_grad(), _same_random_numbers(devices):  # the program draws the same numbers again
            return fn(*inputs)


@contextlib.contextmanager
def _same_random_numbers(cuda_devices: list[int]):
    """The generators' states put back afterwards. Read through the generator, not ``torch.get_rng_state``: while
    fulmen traces, that call is recorded into the trace (``fulmen.frontend.rng_calls``) instead of run."""
    cpu = torch.default_generator.get_state()
    cuda = [torch.cuda.get_rng_state(d) for d in cuda_devices]
    try:
        yield
    finally:
        torch.default_generator.set_state(cpu)
        for d, state in zip(cuda_devices, cuda):
            torch.cuda.set_rng_state(state, d)


def _defined_at_top(trace: Trace, proxy: TensorProxy) -> bool:
    name = proxy.name
    return any(a.name == name for a in trace.args) or any(
        p.name == name for b in trace.bound_symbols for p in b.flat_proxy_outs)


def _not_splittable(what: str, proxy: TensorProxy, why: str) -> DataDependentError:
    return DataDependentError(
        f"{what} needs the value of tensor {proxy.name} ({proxy.type_string()}), and {why}.\n  at {_user_location()}"
        "\nMove the read out of that operation, express it with tensor operations (torch.where, masking), or use "
        "torch.compile(model, backend=\"fulmen\").")
