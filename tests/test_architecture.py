"""The layering rules of fulmen's code: imports point down the layers, the core is steered through one Tracer
interface, and only the core writes a proxy's private state."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import pathlib

import torch

import fulmen
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import Symbol
from fulmen.core.trace import Trace
from fulmen.core.tracer import Tracer, tracectx, tracing

PACKAGE = pathlib.Path(fulmen.__file__).parent

#: Rank of each layer: a module may import its own layer and those below it. Everything else in the package (the
#: public API in ``__init__``, ``api``, ``extend``, ``report``, ``bench``, ``fuzz``, ``launch``, ``testing``, the
#: OpInfo database in ``tests``) sits on top.
LAYERS = {"core": 0, "prims": 1, "clang": 2, "torch": 3, "transforms": 4, "executors": 4, "frontend": 5}
TOP = "the package's top"


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else TOP


def _rank(layer: str) -> int:
    return LAYERS.get(layer, len(LAYERS) + 1)


def _module_name(path: pathlib.Path) -> str:
    parts = ["fulmen", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The fulmen modules an import statement (or an ``importlib.import_module("...")`` call) brings in."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        package = module if is_package else module.rpartition(".")[0]
        base = (
            importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level else node.module
        )
        if base != "fulmen":
            return [base]
        # `from fulmen import prims` imports a module; `from fulmen import jit` the package's top
        return [
            f"fulmen.{a.name}" if (PACKAGE / a.name).exists() or (PACKAGE / f"{a.name}.py").exists() else "fulmen"
            for a in node.names
        ]
    if (
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", None) == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def upward_imports() -> list[str]:
    """Every import, at module level or inside a function, that points up the layers: "file:line: ..."."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        mine = _layer(module)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported(node, module, path.name == "__init__.py"):
                if not (target == "fulmen" or target.startswith("fulmen.")):
                    continue
                theirs = _layer(target)
                if _rank(theirs) > _rank(mine):
                    found.append(
                        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {mine} imports {target} "
                        f"({theirs}, a higher layer)"
                    )
    return found


def test_no_import_points_up_the_layers():
    found = upward_imports()
    assert not found, (
        "imports that point up the layers (frontend > transforms, executors > torch > clang > "
        "prims > core):\n" + "\n".join(found)
    )


def test_the_import_walk_sees_every_form_of_import():
    source = (
        "import fulmen.executors.torchex\n"
        "def f():\n"
        "    from fulmen.frontend.jit import JittedFunction\n"
        "    from ..prims import PrimIDs\n"
        "    from fulmen import jit, clang\n"
        "    importlib.import_module('fulmen.transforms.autodiff')\n"
    )
    targets = [t for node in ast.walk(ast.parse(source)) for t in _imported(node, "fulmen.core.codegen", False)]
    assert sorted(targets) == sorted(
        [
            "fulmen.executors.torchex",
            "fulmen.frontend.jit",
            "fulmen.prims",
            "fulmen",
            "fulmen.clang",
            "fulmen.transforms.autodiff",
        ]
    )
    assert {t: _layer(t) for t in targets} == {
        "fulmen.executors.torchex": "executors",
        "fulmen.frontend.jit": "frontend",
        "fulmen.prims": "prims",
        "fulmen": TOP,
        "fulmen.clang": "clang",
        "fulmen.transforms.autodiff": "transforms",
    }
    # from the core every one points up; from clang all but prims and clang; from the frontend only the top
    assert {t for t in targets if _rank(_layer(t)) > _rank("core")} == set(targets)
    assert {t for t in targets if _rank(_layer(t)) > _rank("clang")} == set(targets) - {"fulmen.prims", "fulmen.clang"}
    assert {t for t in targets if _rank(_layer(t)) > _rank("frontend")} == {"fulmen"}


#: TensorProxy's private slots: its aliasing and in-place state, which only fulmen.core.proxies writes
_PRIVATE = {name for name in TensorProxy.__slots__ if name.startswith("_")}


def _written_attributes(target: ast.AST) -> list[ast.Attribute]:
    """The attributes an assignment target writes: ``a.x = ...``, ``a.x, b.y = ...``, ``a.x[:] = ...``."""
    if isinstance(target, ast.Tuple | ast.List):
        return [a for t in target.elts for a in _written_attributes(t)]
    while isinstance(target, ast.Subscript | ast.Starred):
        target = target.value
    return [target] if isinstance(target, ast.Attribute) else []


def test_only_the_core_writes_a_proxys_private_state():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "core" / "proxies.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            else:
                continue
            for attribute in (a for t in targets for a in _written_attributes(t)):
                if attribute.attr in _PRIVATE and not (
                    isinstance(attribute.value, ast.Name) and attribute.value.id == "self"
                ):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: writes .{attribute.attr}")
    assert not found, (
        "writes to TensorProxy's private slots outside fulmen.core.proxies (use its methods: "
        "mark_input, make_view_of, replace_with, ...):\n" + "\n".join(found)
    )


def test_symbol_call_hands_the_call_to_the_tracer():
    lines = inspect.getsource(Symbol.__call__).strip().splitlines()
    assert len(lines) <= 10, f"Symbol.__call__ is {len(lines)} lines; it should only hand the call to the tracer"
    for hook in ("capture", "autocast", "on_user_op", "replay", "read_value"):
        assert not hasattr(Trace("t"), hook), f"Trace carries the frontend hook {hook!r}"


class _Counting(Tracer):
    """A tracer that records as the core's does and counts the calls at each depth."""

    def __init__(self, trace: Trace):
        super().__init__(trace)
        self.calls: list[tuple[str, int]] = []

    def process_symbol(self, sym, args, kwargs):
        self.calls.append((sym.name, len(self.trace.scopes)))
        return super().process_symbol(sym, args, kwargs)


def test_a_tracer_sees_every_symbol_call_and_its_decomposition():
    import fulmen.torch as ltorch

    trace = Trace("t")
    counting = _Counting(trace)
    with tracing(counting):
        a = TensorProxy("a", shape=(2, 3), dtype=torch.float32, device="cpu")
        out = ltorch.add(ltorch.mul(a, 2.0), a)
    assert [b.sym.name for b in trace.bound_symbols] == ["mul", "add"]
    assert ("mul", 1) in counting.calls and ("add", 1) in counting.calls
    assert any(depth > 1 for _, depth in counting.calls), "the decompositions' calls reach the tracer too"
    assert out.shape == (2, 3)
    # the core's tracer (what transforms use) records the same program
    plain = Trace("t")
    with tracectx(plain):
        ltorch.add(ltorch.mul(a, 2.0), a)
    assert [b.sym.name for b in plain.bound_symbols] == ["mul", "add"]
    assert [len(b.subsymbols) for b in plain.bound_symbols] == [len(b.subsymbols) for b in trace.bound_symbols]


def test_the_core_tracer_refuses_to_read_a_value():
    trace = Trace("t")
    with tracectx(trace):
        a = TensorProxy("a", shape=(), dtype=torch.float32, device="cpu")
        try:
            bool(a)
        except fulmen.DataDependentError as e:
            assert "bool(tensor)" in str(e) and "a (cpu f32[])" in str(e)
        else:
            raise AssertionError("bool() of a proxy returned under the core tracer")
