"""The module wrapper ``fulmen.jit(module)`` returns.

It shares the original module's parameter, buffer and submodule dictionaries, so ``parameters()``,
``state_dict()``, ``load_state_dict()``, ``to()`` and optimizers see exactly the original's tensors under
the original names. Calling it traces the original ``forward`` with parameters and buffers swapped for
proxies (``module._parameters`` entries are replaced for the duration of tracing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from fulmen.core.codeutils import sanitize_name
from fulmen.executors.base import Executor
from fulmen.executors.inductor_compile import call_leaving_a_core
from fulmen.frontend.cache import args_key, global_state_key
from fulmen.frontend.jit import JittedFunction
from fulmen.frontend.tracing import _arg_names, trace_program


class _ModuleState:
    """Where every parameter and buffer lives: (module, dict name, key), tied tensors counted once."""

    def __init__(self, root: nn.Module):
        self.root = root
        self.refresh()

    def refresh(self) -> None:
        self.modules = list(self.root.modules())
        slots, unique, first_slot, names = [], [], {}, []
        for mod_name, mod in self.root.named_modules(remove_duplicate=False):
            for dict_name in ("_parameters", "_buffers"):
                for key, t in getattr(mod, dict_name).items():
                    if t is None:
                        continue
                    qualified = f"{mod_name}.{key}" if mod_name else key
                    if id(t) not in first_slot:
                        first_slot[id(t)] = len(names)
                        names.append(sanitize_name(qualified.replace(".", "_")))
                        unique.append((mod, dict_name, key, first_slot[id(t)]))
                    slots.append((mod, dict_name, key, first_slot[id(t)]))
        self.slots = slots
        self.names = names
        self.unique_slots = unique

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(mod, dict_name)[key] for mod, dict_name, key, _ in self.unique_slots]

    @contextlib.contextmanager
    def swapped(self, proxies: Sequence) -> Iterator[None]:
        saved = [(mod, dict_name, key, getattr(mod, dict_name)[key]) for mod, dict_name, key, _ in self.slots]
        try:
            for mod, dict_name, key, index in self.slots:
                getattr(mod, dict_name)[key] = proxies[index]
            yield
        finally:
            for mod, dict_name, key, t in saved:
                getattr(mod, dict_name)[key] = t


class _ModuleProgram(JittedFunction):
    """The JittedFunction behind a JittedModule: the module's state is its first inputs."""

    def __init__(self, module: nn.Module, executors, **options):
        super().__init__(module.forward, executors, **options)
        self.module = module
        self.state = _ModuleState(module)

    def __call__(self, *args, **kwargs):
        state = self.state
        tensors = state.tensors()
        flat: list[torch.Tensor] = []
        key = (
            tuple(m.training for m in state.modules),
            tuple(id(t) for t in tensors),
            args_key((tensors,), {}, flat),
            args_key(args, kwargs, flat),
        ), global_state_key()
        entry = self._cache.get(key)
        self._stats.calls += 1
        if entry is None:
            entry = self._miss(key, args, kwargs, flat)
        else:
            self._stats.cache_hits += 1
        if entry.spec.captured:
            flat += entry.spec.captured
        return call_leaving_a_core(entry.program.run, flat)  # a flag read, unless regions are compiling

    def _n_state(self) -> int:
        return len(self.state.unique_slots)

    def _trace(self, args, kwargs, sizes=None):
        state = self.state
        state.refresh()
        named = list(zip(state.names, state.tensors()))
        module = self.module

        def forward(state_proxies, *a, **k):
            with state.swapped(state_proxies):
                return module(*a, **k)

        names = _arg_names(module.forward, args, kwargs)
        return trace_program(forward, args, kwargs, state=named, fn_name="computation", arg_names=names,
                             sizes=sizes)


class JittedModule(nn.Module):
    """``fulmen.jit(module)``: behaves as the module (same parameters, buffers, state_dict, train/eval)."""

    def __init__(self, module: nn.Module, executors: Sequence[Executor | str] | None = None, **options):
        super().__init__()
        # Share the original's dictionaries: one set of tensors, the original's names.
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._modules = module._modules
        self._non_persistent_buffers_set = module._non_persistent_buffers_set
        object.__setattr__(self, "_fulmen_module", module)
        object.__setattr__(self, "_fulmen_jitted", _ModuleProgram(module, executors, **options))
        self.training = module.training

    @property
    def original_module(self) -> nn.Module:
        return self._fulmen_module

    def forward(self, *args, **kwargs):
        return self._fulmen_jitted(*args, **kwargs)

    def train(self, mode: bool = True):
        self._fulmen_module.train(mode)
        self.training = mode
        return self

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._fulmen_module, name)

    def __repr__(self) -> str:
        return f"fulmen.jit({self._fulmen_module!r})"
