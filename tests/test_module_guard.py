"""Every kind of change to a jitted module's tree is seen by the next call, however it was made (issue 45 goal 5:
the check reads the tree's dictionaries, not wrappers around torch's methods)."""

import importlib
import threading

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module

import fulmen
from fulmen.frontend import tree_guard


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 4)})
        self.extra = nn.ModuleList()
        self.scale = 2.0
        self.register_buffer("offset", None)

    def forward(self, x):
        y = self.body(x) * self.scale
        for head in self.heads.values():
            y = y + head(y)
        for m in self.extra:
            y = m(y)
        if self.offset is not None:
            y = y + self.offset
        if hasattr(self, "gain"):
            y = y * self.gain
        return y + 1 if self.training else y


def _tanh_hook(mod, args, out):
    return torch.tanh(out)


_CHANGES = {
    "attribute": lambda m: setattr(m, "scale", 3.0),
    "attribute through object.__setattr__": lambda m: object.__setattr__(m, "scale", 3.0),
    "eval": lambda m: m.eval(),
    "new submodule": lambda m: m.extra.append(nn.Tanh()),
    "Sequential.insert": lambda m: m.body.insert(1, nn.Sigmoid()),
    "Sequential item replaced": lambda m: m.body.__setitem__(1, nn.Tanh()),
    "Sequential item deleted": lambda m: m.body.__delitem__(1),
    "ModuleList.insert": lambda m: m.extra.insert(0, nn.Sigmoid()),
    "ModuleDict item deleted": lambda m: m.heads.__delitem__("a"),
    "ModuleDict.clear": lambda m: m.heads.clear(),
    "ModuleDict.pop": lambda m: m.heads.pop("a"),
    "submodule written into _modules": lambda m: m.body._modules.__setitem__("1", nn.Tanh()),
    "class swapped": lambda m: setattr(m.body[1], "__class__", nn.Tanh),
    "buffer set": lambda m: setattr(m, "offset", torch.ones(4, dtype=torch.float64)),
    "buffer registered": lambda m: m.register_buffer("gain", torch.full((4,), 2.0, dtype=torch.float64)),
    "parameter registered": lambda m: m.register_parameter("gain", nn.Parameter(torch.full((4,), 2.0).double())),
    "parameter removed from _parameters": lambda m: m.heads["a"]._parameters.__setitem__("bias", None),
    "forward hook": lambda m: m.body[0].register_forward_hook(_tanh_hook),
    "forward pre-hook": lambda m: m.body[0].register_forward_pre_hook(lambda mod, args: (args[0] * 2,)),
    "global forward hook": lambda m: torch_module.register_module_forward_hook(_tanh_hook),
}


def _uses_guard_tree(jm) -> bool:
    return getattr(jm._fulmen_jitted.state.check, "tree", None) is not None


# a tree unchanged for this many calls is checked by PyTorch's C++ guard tree, before that by a Python loop
@pytest.mark.parametrize("calls", [2, tree_guard._STABLE_CALLS + 2])
@pytest.mark.parametrize("change", list(_CHANGES))
def test_the_next_call_sees_the_change(change, calls):
    if calls > tree_guard._STABLE_CALLS:  # a small tree is checked in Python while Dynamo is not loaded
        importlib.import_module("torch._dynamo.guards")
    torch.manual_seed(0)
    m = _Net().double()
    jm, x = fulmen.jit(m, executors=["torch"]), torch.randn(3, 4, dtype=torch.float64)
    handle = None
    try:
        with torch.no_grad():
            torch.testing.assert_close(jm(x), m(x))
            for _ in range(calls - 1):
                jm(x)
            assert _uses_guard_tree(jm) == (calls > tree_guard._STABLE_CALLS)
            handle = _CHANGES[change](m)
            torch.testing.assert_close(jm(x), m(x))
            assert fulmen.cache_misses(jm) == 2, "the change should have made the call compile again"
            torch.testing.assert_close(jm(x), m(x))
            assert fulmen.cache_misses(jm) == 2
    finally:
        if isinstance(handle, torch.utils.hooks.RemovableHandle):
            handle.remove()


@pytest.mark.parametrize("where", ["on a submodule", "global"])
def test_a_removed_hook_is_seen(where):
    torch.manual_seed(0)
    m = _Net().double()
    if where == "global":
        handle = torch_module.register_module_forward_hook(_tanh_hook)
    else:
        handle = m.body[0].register_forward_hook(_tanh_hook)
    jm, x = fulmen.jit(m, executors=["torch"]), torch.randn(3, 4, dtype=torch.float64)
    try:
        with torch.no_grad():
            torch.testing.assert_close(jm(x), m(x))
            handle.remove()
            torch.testing.assert_close(jm(x), m(x))
            assert fulmen.cache_misses(jm) == 2
    finally:
        handle.remove()


def test_a_change_made_by_another_thread_is_seen():
    torch.manual_seed(0)
    m = _Net().double()
    jm, x = fulmen.jit(m, executors=["torch"]), torch.randn(3, 4, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(jm(x), m(x))
        for change in ("attribute", "Sequential item replaced", "forward hook"):
            t = threading.Thread(target=_CHANGES[change], args=(m,))
            t.start()
            t.join()
            torch.testing.assert_close(jm(x), m(x))
    assert fulmen.cache_misses(jm) == 4


class _Recorder(nn.Module):
    """Writes its own attribute and rebinds its own buffer on every call (fulmen's writes, not structure)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = 2.0
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        y = self.lin(x) * self.scale
        self.last = y  # a program output
        self.count = self.count + 1  # a rebound buffer
        return y


@pytest.mark.parametrize("change", ["attribute", "buffer registered", "output overwritten"])
def test_changes_to_dicts_fulmen_writes_on_every_call_are_seen(change):
    torch.manual_seed(0)
    m = _Recorder().double()
    ref = _Recorder().double()
    ref.load_state_dict(m.state_dict())
    importlib.import_module("torch._dynamo.guards")  # the C++ guard tree checks the dicts fulmen does not write
    jm, x = fulmen.jit(m, executors=["torch"]), torch.randn(3, 4, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(tree_guard._STABLE_CALLS + 2):
            torch.testing.assert_close(jm(x), ref(x))
        assert fulmen.cache_hits(jm) >= 1, "calls that only write the program's outputs should hit the cache"
        misses = fulmen.cache_misses(jm)
        for mod in (m, ref):
            if change == "attribute":
                mod.scale = 3.0
            elif change == "buffer registered":
                mod.register_buffer("extra", torch.ones(4, dtype=torch.float64))
            else:
                mod.last = None
        torch.testing.assert_close(jm(x), ref(x))
        torch.testing.assert_close(m.last, ref.last)
        torch.testing.assert_close(m.count, ref.count)
        if change == "attribute":
            assert fulmen.cache_misses(jm) == misses + 1


def test_a_dict_that_keeps_changing_leaves_the_guard_tree_in_place():
    """An attribute toggled between calls is checked by version in Python while the rest of the tree stays in the
    C++ guard tree, which keeps seeing changes elsewhere."""
    importlib.import_module("torch._dynamo.guards")
    torch.manual_seed(0)
    m = _Net().double()
    jm, x = fulmen.jit(m, executors=["torch"]), torch.randn(3, 4, dtype=torch.float64)
    with torch.no_grad():
        for scale in (3.0, 2.0):  # both structures compiled
            m.scale = scale
            torch.testing.assert_close(jm(x), m(x))
        period = tree_guard._STABLE_CALLS + 2  # long enough for the tree to be built between two toggles
        trees = []
        for k in range(4 * period):
            if k % period == 0:
                m.scale = 5.0 - m.scale
            torch.testing.assert_close(jm(x), m(x))
            trees.append(jm._fulmen_jitted.state.check.tree)
        last_two_periods = trees[-2 * period :]
        assert None not in last_two_periods and len({id(t) for t in last_two_periods}) == 1, "the tree is kept"
        assert fulmen.cache_misses(jm) == 2
        handle = m.body[0].register_forward_hook(_tanh_hook)
        try:
            torch.testing.assert_close(jm(x), m(x))
        finally:
            handle.remove()
        assert fulmen.cache_misses(jm) == 3


def test_dict_versions_on_this_python_change_on_every_write_or_no_check_is_trusted():
    from fulmen.frontend import tree_guard

    if tree_guard._guards is None:  # versions untrusted: every check fails, so every call walks the tree
        assert tree_guard.build([torch.nn.Linear(2, 2)])() is False
    else:
        assert tree_guard._versions_track_writes()


def _scale_block_output(mod, args, out):
    return (out[0] * 0.5, *out[1:]) if isinstance(out, tuple) else out * 0.5


@pytest.mark.parametrize(
    "change",
    ["block replaced in the ModuleList", "forward hook on a block", "layer-norm eps", "eval to train, no dropout"],
)
def test_a_hugging_face_model_checked_by_the_guard_tree_sees_each_change(change):
    """The C++ guard tree (built after the tree stayed unchanged) lets a later call reuse the program only where the
    slow path (a fresh snapshot) would: on Hugging Face's GPT-2, which nobody here wrote, each change is seen and
    the outputs stay eager's."""
    pytest.importorskip("transformers")
    from fulmen.bench.hf import hf_model

    importlib.import_module("torch._dynamo.guards")
    model = hf_model("gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).eval()
    jm, ids = fulmen.jit(model, executors=["torch"]), torch.randint(0, 64, (2, 8))
    handle = None
    try:
        with torch.no_grad():
            for _ in range(tree_guard._STABLE_CALLS + 2):
                out = jm(input_ids=ids, use_cache=False).logits
            assert _uses_guard_tree(jm)
            torch.testing.assert_close(out, model(input_ids=ids, use_cache=False).logits)
            if change == "block replaced in the ModuleList":
                model.transformer.h[1] = model.transformer.h[0]
            elif change == "forward hook on a block":
                handle = model.transformer.h[0].register_forward_hook(_scale_block_output)
            elif change == "layer-norm eps":
                model.transformer.ln_f.eps = 0.5
            else:
                model.train()
            for _ in range(2):
                torch.testing.assert_close(jm(input_ids=ids, use_cache=False).logits,
                                           model(input_ids=ids, use_cache=False).logits)
            assert fulmen.cache_misses(jm) == 2, "the change should have made the call compile again"
    finally:
        if handle is not None:
            handle.remove()


@pytest.mark.parametrize("calls", [2, tree_guard._STABLE_CALLS + 2])
def test_fulmens_swaps_of_a_key_pass_the_check_and_a_users_write_does_not(calls):
    """``swap_owned`` (generate's router putting ``forward`` in a model's ``__dict__`` and removing it) leaves the
    checks that held passing; a user's write before, between or after fulmen's swaps still fails them."""
    importlib.import_module("torch._dynamo.guards")  # the C++ guard tree is built after _STABLE_CALLS
    m = _Net()
    tree_guard.mark_swapped(m, "__dict__")
    for user_write in (None, "before", "between"):
        check = tree_guard.build(list(m.modules()))
        for _ in range(calls):
            assert check()
        if user_write == "before":
            m.scale = 7.0
        saved = tree_guard.swap_owned(vars(m), "forward", _tanh_hook)
        assert saved is tree_guard.MISSING_KEY and vars(m)["forward"] is _tanh_hook
        if user_write == "between":
            m.scale = 8.0
        assert check() is (user_write is None)
        tree_guard.swap_owned(vars(m), "forward", saved)
        assert "forward" not in vars(m)
        assert check() is (user_write is None)
    assert check.tree is None or all(d is not vars(m) for i, d in enumerate(check.dicts) if i in check.tree_indices)
