"""One row of the Hugging Face family matrix: a family through ``fulmen.jit`` or the ``torch.compile`` backend,
checked against eager PyTorch on the same weights and inputs.

``check_family(name, path)`` builds two copies of the family's model (same seed, so identical weights), runs one
eagerly and one compiled, and raises ``AssertionError`` naming the first thing that differs: an output tensor
(every tensor the ``ModelOutput`` holds, caches included), the loss, or the gradient of any parameter. For the
backend it also checks that fulmen compiled every graph Dynamo captured, so a silent fallback to eager PyTorch
cannot pass as a success::

    stats = check_family("llama", "backend")    # {"graphs": 1, "graph_breaks": 0}

Tolerances: everything is float32 and fulmen runs the same torch kernels as eager, but a decomposed op (a
softmax or a norm written as prims, a matmul whose operand was transposed differently) may sum in another order,
which moves a result by a few ulps of the largest value involved. So the absolute tolerance is ``1e-5`` scaled by
the largest magnitude of the reference tensor, with a relative tolerance of ``1e-5``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fulmen.bench.hf_families import FAMILIES

__all__ = ["PATHS", "check_backend_graphs", "check_family", "compare_grads", "compare_outputs", "compile_model",
           "tensors_of", "watch_backend_fallbacks"]

PATHS = ("jit", "backend")
RTOL, ATOL = 1e-5, 1e-5


def tensors_of(value, prefix: str = "", depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in an output, with a path naming it: ModelOutputs, dicts, lists and tuples, and the
    attributes of the library's own objects (a ``DynamicCache``'s layers and their keys and values)."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):  # ModelOutput is an OrderedDict of its non-None fields
        for k, v in value.items():
            yield from tensors_of(v, f"{prefix}.{k}", depth + 1)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from tensors_of(v, f"{prefix}[{i}]", depth + 1)
    elif depth < 6 and type(value).__module__.startswith("transformers") and hasattr(value, "__dict__"):
        for k, v in sorted(vars(value).items()):
            if isinstance(v, torch.Tensor | list | tuple | dict) or hasattr(v, "__dict__"):
                yield from tensors_of(v, f"{prefix}.{k}", depth + 1)


def _close(actual, expected, what: str) -> None:
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{what}: expected a tensor, got {type(actual).__name__}")
    scale = max(1.0, expected.detach().abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual.detach(), expected.detach(), rtol=RTOL, atol=ATOL * scale,
                               msg=lambda m: f"{what}: {m}")


class _FallbackLog(logging.Handler):
    """Collects the warnings the backend logs when it hands a graph back to eager PyTorch."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextmanager
def watch_backend_fallbacks():
    """Yields the list of warnings the fulmen backend logs while the block runs. Its one warning today is a graph
    handed back to eager PyTorch; any other would be worth a failing row too, so all are collected."""
    handler = _FallbackLog()
    logger = logging.getLogger("fulmen.dynamo")
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def compile_model(model: nn.Module, path: str, *, reset: bool = True, **options) -> tuple[nn.Module, list]:
    """``fulmen.jit(model)`` or ``torch.compile(model, backend=<fulmen>)``, and the list the backend appends each
    graph's compiled function to (empty for jit). ``options`` go to ``fulmen.jit`` / the backend. ``reset``
    empties Dynamo's caches first (which makes every other ``torch.compile``'d model compile again)."""
    import fulmen
    from fulmen.frontend.dynamo import fulmen_backend

    if path == "jit":
        return fulmen.jit(model, **options), []
    if path != "backend":
        raise ValueError(f"unknown path {path!r}; expected one of {PATHS}")
    graphs: list = []

    def backend(gm, example_inputs):  # fulmen's backend, recording what it returned
        compiled = fulmen_backend(gm, example_inputs, options=options)
        graphs.append(compiled)
        return compiled

    if reset:
        torch._dynamo.reset()
    return torch.compile(model, backend=backend), graphs


def compare_outputs(actual, expected, name: str) -> None:
    """Every tensor of ``actual`` (a ModelOutput, caches included) matches ``expected``'s, path for path."""
    if type(actual) is not type(expected):
        raise AssertionError(f"{name}: returned {type(actual).__name__}, eager returns {type(expected).__name__}")
    expected_tensors, actual_tensors = dict(tensors_of(expected)), dict(tensors_of(actual))
    if expected_tensors.keys() != actual_tensors.keys():
        raise AssertionError(f"{name}: output tensors {sorted(actual_tensors)}, eager has {sorted(expected_tensors)}")
    for where, t in expected_tensors.items():
        _close(actual_tensors[where], t, f"{name} output{where}")


def compare_grads(model: nn.Module, ref: nn.Module, name: str) -> None:
    """Every parameter of ``model`` has the gradient its namesake in ``ref`` has (or none where it has none)."""
    params = dict(model.named_parameters())
    for pname, p_ref in ref.named_parameters():
        p = params[pname]
        if p_ref.grad is None:
            if p.grad is not None:
                raise AssertionError(f"{name}: {pname} got a gradient eager does not compute")
            continue
        if p.grad is None:
            raise AssertionError(f"{name}: {pname} has no gradient")
        _close(p.grad, p_ref.grad, f"{name} grad of {pname}")


def check_backend_graphs(graphs: list, fallbacks: list[str], name: str) -> None:
    """Dynamo handed fulmen at least one graph, fulmen compiled each, and none ran with eager PyTorch."""
    import fulmen

    if fallbacks:
        raise AssertionError(f"{name}: the backend ran a graph with eager PyTorch: {fallbacks[0]}")
    if not graphs:
        raise AssertionError(f"{name}: Dynamo handed no graph to the fulmen backend")
    untraced = [i for i, g in enumerate(graphs) if fulmen.cache_misses(g._fulmen_jitted) == 0]
    if untraced:
        raise AssertionError(f"{name}: graphs {untraced} of {len(graphs)} were never compiled by fulmen")


def check_family(name: str, path: str, *, train: bool = True, config: dict | None = None, **options) -> dict:
    """Compare family ``name`` through ``path`` with eager: outputs, loss and (``train``) every parameter's
    gradient. ``config`` replaces config fields (e.g. ``{"use_cache": False}``). Returns
    ``{"graphs": n, "graph_breaks": n}`` (Dynamo's counts; 0 for jit)."""
    from torch._dynamo.utils import counters

    family = FAMILIES[name]
    ref, model = family.build(**(config or {})), family.build(**(config or {}))
    compiled, graphs = compile_model(model, path, **options)
    kwargs = family.inputs(ref.config)
    counters.clear()
    with torch.set_grad_enabled(train), watch_backend_fallbacks() as fallbacks:
        expected = ref(**kwargs)
        actual = compiled(**kwargs)
        if train:
            expected.loss.backward()
            actual.loss.backward()
    compare_outputs(actual, expected, name)
    if train:
        compare_grads(model, ref, name)
    if path == "backend":
        check_backend_graphs(graphs, fallbacks, name)
    return {"graphs": len(graphs), "graph_breaks": sum(counters["graph_break"].values())}
