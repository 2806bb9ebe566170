"""``import fulmen`` changes nothing in torch, and nothing fulmen put in place while it traced or compiled stays once
the call returned (issue 45 goal 5).

Each check runs in a fresh interpreter, so that nothing an earlier test imported or patched is seen: it records
the identity of every attribute of the torch modules and classes fulmen reaches into (``torch``,
``torch.nn.functional``, ``nn.Module`` and the containers, ``torch.fx``, Inductor's ``sizevars`` and
``AsyncCompile``, ...) before ``import fulmen``, after it, and after jitted calls.
"""

import json
import os
import subprocess
import sys
import tempfile

import pytest

import fulmen

_SNAPSHOT = r'''
import json, sys
import torch
import torch.fx
import torch.nn.functional
import torch.random
import torch.utils.hooks
import torch._dynamo  # torch's own import-time changes (it wraps torch.manual_seed) happen before the first look
import torch._inductor.compile_fx
import torch._inductor.sizevars
import torch._inductor.async_compile
from torch import nn
from torch.nn.modules import module as torch_module

OWNERS = {
    "torch": torch, "torch.random": torch.random, "torch.nn.functional": torch.nn.functional,
    "torch.nn.modules.module": torch_module, "nn.Module": nn.Module, "nn.Sequential": nn.Sequential,
    "nn.ModuleList": nn.ModuleList, "nn.ModuleDict": nn.ModuleDict, "nn.ParameterList": nn.ParameterList,
    "RemovableHandle": torch.utils.hooks.RemovableHandle, "torch.Tensor": torch.Tensor,
    "torch.fx": torch.fx, "torch.fx._symbolic_trace": torch.fx._symbolic_trace,
    "torch._inductor.sizevars": torch._inductor.sizevars,
    "AsyncCompile": torch._inductor.async_compile.AsyncCompile,
}


def snapshot():
    """Each owner's own attributes, by identity (a module's submodules and lazily imported names aside)."""
    out = {}
    for owner_name, owner in OWNERS.items():
        for name, value in list(vars(owner).items()):
            if isinstance(value, type(torch)) or name in ("__annotations__", "__builtins__"):
                continue
            if owner is torch.utils.hooks.RemovableHandle and name == "next_id":
                continue  # the counter every hook registration advances (fulmen's scoped optimizer-step hook too)
            out[f"{owner_name}.{name}"] = id(value)
    return out


def changed(before, after):
    return sorted(k for k in before.keys() & after.keys() if before[k] != after[k])
'''

_SCRIPT = (
    _SNAPSHOT
    + r"""
held = []  # what the snapshots refer to stays alive, so no id is reused
before = snapshot()
import fulmen
after_import = snapshot()
report = {"import": changed(before, after_import)}
"""
)


def _run(body: str) -> dict:
    # the fulmen this test process imported, whatever the working directory (python -c puts it first on the path)
    root = os.path.dirname(os.path.dirname(os.path.abspath(fulmen.__file__)))
    env = dict(os.environ, FULMEN_COMPILE="sync", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT + body + "\nprint('RESULT' + json.dumps(report))"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tempfile.gettempdir(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    return json.loads(line[len("RESULT") :])


def test_import_and_a_jitted_function_change_nothing_in_torch():
    report = _run(r"""
import torch
torch.manual_seed(0)

def fn(x, y):
    torch.manual_seed(1)  # recorded while tracing (torch.manual_seed is fulmen's only while it traces)
    return (x.sin() * y + torch.rand(3)).relu().sum(0)

x, y = torch.randn(4, 3), torch.randn(4, 3)
jf = fulmen.jit(fn)
out = jf(x, y)
torch.testing.assert_close(out, fn(x, y))
jf(x, y)
report["after function calls"] = changed(before, snapshot())
""")
    assert report == {"import": [], "after function calls": []}


def test_a_jitted_module_with_inductor_regions_leaves_torch_as_it_was():
    """While a jitted module lives, fulmen watches its structure; once it is gone, torch is as before. Module
    attribute writes recorded while tracing a plain function leave nothing behind either."""
    report = _run(r"""
import gc
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
x = torch.randn(5, 8)
jm = fulmen.jit(model, executors=["inductor"], compile="sync")
torch.testing.assert_close(jm(x), model(x), rtol=1e-5, atol=1e-5)
model[1].approximate = "tanh"  # a watched change: the next call recompiles and matches eager
torch.testing.assert_close(jm(x), model(x), rtol=1e-5, atol=1e-5)
regions = [b for b in fulmen.last_traces(jm)[-1].bound_symbols if b.sym.is_fusion]
report["regions"] = len(regions)

class Counter(nn.Module):
    def forward(self, x):
        self.last = x.sum()  # a module write the trace records
        return x * 2

counter = Counter()
jf = fulmen.jit(lambda x: counter(x) + 1)
torch.testing.assert_close(jf(x), x * 2 + 1)
del jm, model, regions, jf, counter
gc.collect()
report["after module calls"] = changed(before, snapshot())
""")
    assert report.pop("regions") >= 1, "the module's program should hold an Inductor region"
    assert report == {"import": [], "after module calls": []}


@pytest.mark.parametrize("owner", ["AsyncCompile.cpp_pybinding", "torch._inductor.sizevars.sympy"])
def test_inductor_patches_are_scoped_to_a_lowering(owner):
    """The merged C++ build and the index shortcut are in place only while fulmen lowers a region."""
    report = _run(
        r"""
import torch
from fulmen.executors import inductor_cpp, inductor_sympy
from torch._inductor import sizevars
from torch._inductor.async_compile import AsyncCompile

seen = {}
with inductor_cpp.merged_cpp_build(inductor_cpp.MergedBuild()):
    seen["AsyncCompile.cpp_pybinding"] = AsyncCompile.cpp_pybinding is not torch_cpp
with inductor_sympy.shortcut_here():
    seen["torch._inductor.sizevars.sympy"] = sizevars.sympy is not torch_sympy
report["inside"] = seen
report["after"] = changed(before, snapshot())
""".replace(
            "import torch\n",
            "import torch\ntorch_cpp = torch._inductor.async_compile.AsyncCompile.cpp_pybinding\n"
            "torch_sympy = torch._inductor.sizevars.sympy\n",
            1,
        )
    )
    assert report["inside"][owner], f"{owner} should be fulmen's inside the block (the test would prove nothing)"
    assert report["import"] == [] and report["after"] == []


def test_a_live_jitted_module_leaves_torch_as_it_was():
    """While a jitted module lives (and after its structure changed and it compiled again), torch's nn.Module,
    containers, RemovableHandle and global hook registrations are torch's own: fulmen checks the module tree's
    dictionaries instead of wrapping the methods that change them."""
    report = _run(r"""
import torch
from torch import nn
from torch.nn.modules import module as torch_module

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
x = torch.randn(5, 8)
jm = fulmen.jit(model, executors=["torch"])
with torch.no_grad():
    torch.testing.assert_close(jm(x), model(x))
    handle = model[0].register_forward_hook(lambda mod, args, out: out * 2)
    torch.testing.assert_close(jm(x), model(x))
    handle.remove()
    glob = torch_module.register_module_forward_hook(lambda mod, args, out: out + 1)
    torch.testing.assert_close(jm(x), model(x))
    glob.remove()
    model.insert(1, nn.Tanh())
    model.eval()
    torch.testing.assert_close(jm(x), model(x))
report["misses"] = fulmen.cache_misses(jm)
# RemovableHandle.next_id counts the handles torch made for the hooks above
report["while the module lives"] = [k for k in changed(before, snapshot()) if k != "RemovableHandle.next_id"]
""")
    assert report.pop("misses") == 4  # the structures without the hooks are the first one again
    assert report == {"import": [], "while the module lives": []}
