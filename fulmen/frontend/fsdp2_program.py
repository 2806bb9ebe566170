"""FSDP2 models under ``fulmen.jit`` traced whole, with FSDP2's all-gathers and reduce-scatters in the trace.

``fully_shard`` keeps each unit's parameters as DTensors sharded on dim 0 (``FSDPParam``: each rank holds a chunk of
``ceil(rows / world)`` rows, the last ranks fewer or none, padded to that size for the all-gather). In eager, FSDP's
forward pre-hook all-gathers a unit's parameters into full-size tensors, its post-hook frees them again, and
autograd hooks reduce-scatter the gradients. Here the model is traced once with those hooks bypassed:

- each FSDP parameter's **local shard** (``param.to_local()``) is an input of the program;
- where a unit's forward begins (its FSDP pre-hook would run), the program pads each shard to the padded size,
  concatenates the unit's flattened shards, all-gathers them once (``param_all_gather``, printed as
  ``torch.ops._c10d_functional.all_gather_into_tensor``) and takes each parameter's rows out of the result, as
  FSDP2's copy-in and copy-out do; the unit's body reads those full tensors, and where it ends they are out of
  reach again;
- the all-gather's gradient is FSDP2's reduction: the reduce-scatter of the full gradient averaged over the ranks
  (``collective_grads``), giving each shard's gradient; ``to_local``'s backward makes it a DTensor with the
  parameter's placements, accumulated into ``param.grad`` as FSDP2 does;
- the all-gather is ``RECOMPUTABLE``: rematerialization gathers again in the backward rather than saving full-size
  parameters from the forward (FSDP2's ``reshard_after_forward=True``). Each unit's all-gather starts while the
  unit before it computes and each reduce-scatter while the next unit's gradients are computed, one of each in
  flight at a time as FSDP2 prefetches (``fulmen.transforms.overlap``), which holds one more unit's full-size
  parameters than without; ``overlap_communication=False`` keeps the collectives where the program made them.

Only FSDP2's default policies are traced here (the 2-D program, ``fulmen.frontend.fsdp2_2d``, also traces
``reshard_after_forward=False`` and mixed precision, through ``_unit``'s ``traced``): one module per ``fully_shard``
call, dim-0 shards of plain (non-DTensor) parameters, no mixed precision, no CPU offload, ``reshard_after_forward``
True (or the root's automatic False), the default gradient divide factor, gradient sync on. Other models keep the
unit-wise path (``fulmen.frontend.fsdp2``), with a log line saying why; a policy changed later
(``set_requires_gradient_sync(False)``, ``set_gradient_divide_factor``) or parameters no longer FSDP2's sharded ones
(``unshard()``, a replaced parameter) make the call run eagerly through FSDP's own hooks, with a log line.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from fulmen.core.proxies import TensorProxy
from fulmen.frontend.module import _ModuleProgram, _ModuleState, _Swaps
from fulmen.torch import collectives

log = logging.getLogger("fulmen")


@dataclass(frozen=True)
class _ParamLayout:
    """One FSDP parameter: where modules read it, and how its shard is gathered (``FSDPParam``'s sizes and dtypes)."""

    fsdp_param: object
    places: tuple[tuple[nn.Module, str], ...]  # (module, name): the parameter and the names it is tied to
    local_shape: tuple[int, ...]  # this rank's shard (``sharded_size``)
    padded_rows: int  # every rank's chunk as all-gathered (``padded_sharded_param_size[0]``)
    full_rows: int  # the parameter's rows (``_orig_size[0]``)
    world: int
    group: str
    param_dtype: torch.dtype | None = None  # mixed precision: the dtype gathered and computed in (None: the shard's)
    reduce_dtype: torch.dtype | None = None  # the dtype the gradient is reduced in (None: the gathered one's)


@dataclass
class _Unit:
    """One ``fully_shard`` call: its module, the ids of FSDP's forward hooks on it and its parameters, and the
    policies traced (each group's ``_policy``; whether the backward gathers again; the dtypes FSDP's forward hooks
    cast the unit's inputs and outputs to)."""

    module: nn.Module
    groups: list
    pre_id: int
    post_id: int
    layouts: list[_ParamLayout]
    is_root: bool
    policies: list[tuple] = field(default_factory=list)
    reshard: bool = True
    input_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None


#: The FSDP2 policies a program may trace besides the default ones (``_unit``'s ``traced``): keeping the gathered
#: parameters for the backward, and mixed precision (``MixedPrecisionPolicy``: gathering and computing in
#: ``param_dtype``, reducing gradients in ``reduce_dtype``)
NO_RESHARD, MIXED_PRECISION = "reshard_after_forward=False", "mixed precision"

#: Each entry of ``_policy``: its value under FSDP2's defaults, and the option a user set where it differs
_POLICY = (
    (None, "set_gradient_divide_factor"),
    (False, "set_force_sum_reduction_for_comms(True)"),
    (True, "set_requires_gradient_sync(False)"),
    (True, "set_requires_all_reduce(False)"),
    (True, "set_all_reduce_hook"),
    (True, "set_custom_all_gather"),
    (True, "set_custom_reduce_scatter"),
    (False, "reshard_after_forward=<int> (resharding to a smaller group after forward)"),
    (True, NO_RESHARD),
)


def _policy(group, is_root: bool) -> tuple:
    """The parameter group's policy as the traced program reads it (``_POLICY`` says what each entry is); read on
    every call, since ``set_requires_gradient_sync`` and its siblings change it between steps. The root's automatic
    "no resharding" counts as resharding: the backward gathers its parameters again, with the same values."""
    return (
        group.gradient_divide_factor,
        group.force_sum_reduction_for_comms,
        group.reduce_grads,
        group.all_reduce_grads,
        group._all_reduce_hook is None,
        type(group._all_gather_comm).__name__ == "DefaultAllGather",
        type(group._reduce_scatter_comm).__name__ == "DefaultReduceScatter",
        bool(group._use_post_forward_mesh),
        bool(is_root or group._reshard_after_forward),
    )


def _untraced(policy: tuple, traced: frozenset[str]) -> list[str]:
    """The options set in ``policy`` that the program does not trace."""
    return [
        option
        for value, (default, option) in zip(policy, _POLICY)
        if value != default and not (option == NO_RESHARD and option in traced)
    ]


def _layout(fsdp_param, traced: frozenset[str]) -> _ParamLayout | str:
    """The parameter's layout, or why it is not traced."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    info = fsdp_param._module_info
    name = f"{type(info.module).__name__}.{info.param_name}"
    if type(fsdp_param.mesh_info) is not FSDPMeshInfo:
        hsdp = fsdp_param.mesh_info.shard_mesh_dim is not None
        how = "a (replicate, shard) mesh (HSDP)" if hsdp else "a replicate-only mesh"
        return f"{name} is sharded over {how}: fulmen traces fully_shard on a 1-D mesh of the data-parallel ranks"
    if fsdp_param.fsdp_placement.dim != 0 or fsdp_param.offload_to_cpu:
        return f"{name} is sharded on dim {fsdp_param.fsdp_placement.dim} or offloaded to the CPU"
    param_dtype, reduce_dtype = fsdp_param.param_dtype, fsdp_param.reduce_dtype
    if (param_dtype is not None or reduce_dtype is not None) and MIXED_PRECISION not in traced:
        return f"{name} has a mixed precision policy (MixedPrecisionPolicy)"
    reduced_in = reduce_dtype or param_dtype or fsdp_param.orig_dtype
    if reduced_in not in (torch.float32, torch.bfloat16):  # FSDP2 then divides before and after the reduction
        return f"{name}'s gradients are reduced in {reduced_in} (MixedPrecisionPolicy's reduce_dtype)"
    places = ((info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names))
    mesh = fsdp_param.mesh_info
    return _ParamLayout(
        fsdp_param,
        tuple(places),
        tuple(fsdp_param.sharded_size),
        int(fsdp_param.padded_sharded_param_size[0]),
        int(fsdp_param._orig_size[0]),
        mesh.shard_mesh_size,
        collectives.group_name(mesh.shard_process_group, "fully_shard"),
        param_dtype,
        reduce_dtype,
    )


def _unit(module: nn.Module, state, traced: frozenset[str] = frozenset()) -> _Unit | str:
    """The unit of one ``fully_shard`` call, or why it is not traced: a policy other than FSDP2's defaults and
    those in ``traced`` (``NO_RESHARD``, ``MIXED_PRECISION``)."""
    if len(state._modules) != 1:
        return "a fully_shard call groups several modules"
    pre, post = state._pre_forward_hook_handle, state._post_forward_hook_handle
    layouts, policies = [], []
    for group in state._fsdp_param_groups:
        policies.append(_policy(group, bool(state._is_root)))
        untraced = _untraced(policies[-1], traced)
        if untraced:
            return f"{type(module).__name__}'s FSDP policy sets {', '.join(untraced)}"
        for fsdp_param in group.fsdp_params:
            layout = _layout(fsdp_param, traced)
            if isinstance(layout, str):
                return layout
            layouts.append(layout)
    if len({(x.param_dtype, x.reduce_dtype) for x in layouts}) > 1:
        return f"{type(module).__name__}'s parameters are gathered or reduced in different dtypes"
    mp = state._mp_policy
    return _Unit(
        module,
        list(state._fsdp_param_groups),
        pre.id,
        post.id,
        layouts,
        bool(state._is_root),
        policies,
        reshard=all(p[-1] for p in policies),
        input_dtype=mp.param_dtype if mp.cast_forward_inputs else None,
        output_dtype=mp.output_dtype,
    )


def fsdp_states(model: nn.Module, fsdp_module: type) -> list[tuple[nn.Module, object]]:
    """(module, FSDP2 state) of each ``fully_shard`` call under ``model`` once (a call of several modules shares
    one state)."""
    states = {}
    for m in model.modules():
        if isinstance(m, fsdp_module):
            states.setdefault(id(m._get_fsdp_state()), (m, m._get_fsdp_state()))
    return list(states.values())


def set_up(states: list[tuple[nn.Module, object]]) -> list[tuple[nn.Module, object]]:
    """``states``, FSDP's own first-forward setup (FQNs, the root's resharding) done as in eager where not yet."""
    for _, state in states:
        if state._is_root is None:
            state._lazy_init()
    return states


def plan(model: nn.Module, fsdp_module: type) -> list[_Unit] | str:
    """The FSDP2 units of ``model`` whose collectives the trace holds, or why the model is not traced whole. Models
    that also hold DTensors of their own (FSDP2 over tensor parallelism, 2-D) are ``fulmen.frontend.fsdp2_2d``'s."""
    states = set_up(fsdp_states(model, fsdp_module))
    if not states:
        return "no module is sharded"
    units = []
    for m, state in states:
        unit = _unit(m, state)
        if isinstance(unit, str):
            return unit
        units.append(unit)
    return units


def traced_all_gather(flat: TensorProxy, world: int, group: str, param_dtype=None, reduce_dtype=None) -> TensorProxy:
    """FSDP2's all-gather of a unit's flat shards as fulmen traces it (``param_all_gather``, ``RECOMPUTABLE``); its
    gradient is FSDP2's averaged reduce-scatter (``collective_grads``). No mixed precision: ``plan`` leaves such
    units to the unit-wise path."""
    if param_dtype is not None or reduce_dtype is not None:
        raise AssertionError("fulmen's traced FSDP2 gather has no mixed precision; plan() should have said so")
    return collectives.param_wait(collectives.param_all_gather(flat, world, group))


def _as_is(layout: _ParamLayout, full):
    return full


@dataclass(frozen=True)
class GatherPath:
    """How a program issues FSDP2's gather of a unit; the layout itself (``gather_unit``) is one for every program.

    ``all_gather(flat, world, group, param_dtype, reduce_dtype)``: the ``(world * flat.numel(),)`` gathered tensor
    (in ``param_dtype`` where not None), whose gradient is FSDP2's averaged reduce-scatter (in ``reduce_dtype``,
    then in ``flat``'s dtype): ``traced_all_gather`` here; an autograd Function over c10d's ops where AOTAutograd
    traces the program, ``fulmen.frontend.fsdp2_2d``. ``shard_type``: what a shard is while the program is traced,
    checked with its shape before it is gathered. ``as_parameter(layout, full)``: what the unit's modules read in
    the parameter's place (the full tensor; a DTensor with the tensor-parallel spec in 2-D)."""

    all_gather: Callable
    shard_type: type
    as_parameter: Callable = _as_is


TRACED = GatherPath(traced_all_gather, TensorProxy)


def gather_unit(layouts: list[_ParamLayout], shards: list, all_gather: Callable) -> list:
    """The full parameters (TP-local tensors in 2-D) from this rank's shards of one unit, as FSDP2's copy-in and
    copy-out lay them out: each shard padded to the all-gathered chunk and flattened, all concatenated, one
    all-gather (``GatherPath.all_gather``), and each parameter's columns of the (ranks, chunk) result reshaped to
    its rows and narrowed to the parameter's. The gradient takes the same path back: one reduce-scatter."""
    flat = []
    for layout, shard in zip(layouts, shards):
        missing = layout.padded_rows - layout.local_shape[0]
        if missing:
            shard = torch.nn.functional.pad(shard, (0, 0) * (shard.ndim - 1) + (0, missing))
        flat.append(shard.reshape(-1))
    sizes = [x.numel() for x in flat]
    world, group = layouts[0].world, layouts[0].group
    chunk = flat[0] if len(flat) == 1 else torch.cat(flat)
    gathered = all_gather(chunk, world, group, layouts[0].param_dtype, layouts[0].reduce_dtype).view(world, sum(sizes))
    fulls = []
    # split, not one slice per parameter: its gradient is one concatenation of the parameters' gradients
    for layout, piece in zip(layouts, torch.split(gathered, sizes, dim=1)):
        full = piece.reshape(world * layout.padded_rows, *layout.local_shape[1:])
        fulls.append(full if layout.full_rows == full.shape[0] else full.narrow(0, 0, layout.full_rows))
    return fulls


def _cast_floats(tree, dtype: torch.dtype | None):
    """``tree`` with its floating-point tensors cast to ``dtype`` (FSDP2's casts of a unit's inputs and outputs)."""
    if dtype is None:
        return tree
    from torch.distributed.fsdp._fully_shard._fsdp_common import _cast_fp_tensor
    from torch.distributed.utils import _apply_to_tensors

    return _apply_to_tensors(functools.partial(_cast_fp_tensor, dtype), tree)


def _pre_forward(unit: _Unit, shards: dict, path: GatherPath, module, args, kwargs) -> tuple:
    for layout in unit.layouts:
        module_, name = layout.places[0]
        shard = module_._parameters[name]
        if not isinstance(shard, path.shard_type) or tuple(shard.shape) != layout.local_shape:
            raise NotImplementedError(
                f"fulmen.jit: {type(module_).__name__}.{name} is not FSDP2's sharded parameter while the FSDP2 model "
                "is traced (replaced or unsharded); call the model without fulmen.jit, or reshard it first"
            )
        shards[id(layout)] = shard
    by_group: dict[tuple, list[_ParamLayout]] = {}  # one all-gather per process group (FSDP2: one per unit)
    for layout in unit.layouts:
        by_group.setdefault((layout.world, layout.group), []).append(layout)
    for layouts in by_group.values():
        for layout, full in zip(layouts, gather_unit(layouts, [shards[id(x)] for x in layouts], path.all_gather)):
            parameter = path.as_parameter(layout, full)
            for m, n in layout.places:
                m._parameters[n] = parameter
    return _cast_floats(args, unit.input_dtype), _cast_floats(kwargs, unit.input_dtype)


def _post_forward(unit: _Unit, shards: dict, module, args, output):
    for layout in unit.layouts:  # outside the unit, the parameters are the shards again (as FSDP2 leaves them)
        for m, n in layout.places:
            m._parameters[n] = shards[id(layout)]
    return _cast_floats(output, unit.output_dtype)


@contextlib.contextmanager
def gathering(units: list[_Unit], path: GatherPath = TRACED) -> Iterator[None]:
    """While the model is traced (this thread holds the swap lock, or AOTAutograd runs it), FSDP's forward hooks on
    each unit are replaced by ones gathering the unit's shards in the program (``gather_unit``, issued as ``path``
    says); FSDP's own are put back after."""
    saved = []
    shards: dict = {}
    try:
        for unit in units:
            pre, post = unit.module._forward_pre_hooks, unit.module._forward_hooks
            saved += [(pre, unit.pre_id, pre[unit.pre_id]), (post, unit.post_id, post[unit.post_id])]
            pre[unit.pre_id] = functools.partial(_pre_forward, unit, shards, path)
            post[unit.post_id] = functools.partial(_post_forward, unit, shards)
        yield
    finally:
        for hooks, key, hook in reversed(saved):
            hooks[key] = hook


def _pending_grad(fsdp_param) -> bool:
    """Whether FSDP keeps an unsharded gradient of this parameter to reduce with the next one (a backward without
    gradient sync; FSDP's ``post_backward`` reads the same two places)."""
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    return fsdp_param.unsharded_accumulated_grad is not None or (unsharded is not None and unsharded.grad is not None)


def fsdp_state_changed(units: list[_Unit]) -> str | None:
    """Why FSDP's state is no longer the one the program was traced with (a policy changed, or gradients
    accumulated without sync that FSDP would add in), or None."""
    for unit in units:  # a backward without gradient sync left FSDP an unsharded gradient to add in
        for layout in unit.layouts:
            if _pending_grad(layout.fsdp_param):
                return "FSDP holds gradients accumulated without gradient sync"
    for unit in units:
        if [_policy(group, unit.is_root) for group in unit.groups] != unit.policies:
            return f"{type(unit.module).__name__}'s FSDP policy changed since the model was traced"
    return None


class _ShardedState(_ModuleState):
    """The model's tensors, FSDP2's sharded parameters as their local shards (``to_local()``, through which the
    shards' gradients become DTensor gradients of the parameters), and whether each is still FSDP2's."""

    def __init__(self, root: nn.Module, units: list[_Unit]):
        self.units = units
        self.stale: str | None = None
        super().__init__(root)

    def refresh(self) -> None:
        from torch.distributed.tensor import DTensor

        super().refresh()
        self.stale = None
        shards = set()
        for unit in self.units:
            for layout in unit.layouts:
                m, n = layout.places[0]
                shards.add(id(layout.fsdp_param.sharded_param))
                if m._parameters.get(n) is not layout.fsdp_param.sharded_param:
                    self.stale = f"{type(m).__name__}.{n} is not FSDP2's sharded parameter (unsharded, or replaced)"
        # a DTensor the plan does not gather (fully_shard applied to another module after fulmen.jit): its local
        # tensor would stand for the whole parameter
        for mod, dict_name, key, _ in self.unique_slots:
            if isinstance(getattr(mod, dict_name)[key], DTensor) and id(getattr(mod, dict_name)[key]) not in shards:
                self.stale = f"{type(mod).__name__}.{key} is a DTensor the model was not traced with; jit it again"

    def tensors(self) -> list[torch.Tensor]:
        from torch.distributed.tensor import DTensor

        return [t.to_local() if isinstance(t, DTensor) else t for t in super().tensors()]


class FSDP2Program(_ModuleProgram):
    """What ``fulmen.jit(model)`` calls for a model sharded by FSDP2 with its default policies (see the module
    doc): the whole model's program, FSDP2's collectives in it."""

    def __init__(self, module: nn.Module, executors, units: list[_Unit], **options):
        super().__init__(module, executors, **options)
        self.units = units
        self.state = _ShardedState(module, units)
        self._warned: set[str] = set()
        log.info(
            "fulmen: %s is sharded by FSDP2 (%d units): fulmen traces the whole model, with each unit's "
            "all-gather and the gradients' reduce-scatter in its program",
            type(module).__name__,
            len(units),
        )

    def __reduce__(self):
        """Pickled (``copy.deepcopy`` of the jitted model): the copy plans its own units and traces again."""
        return _rebuild, (self.module, self._init_args[1], self.options)

    def _why_eager(self) -> str | None:
        """Why this call runs through FSDP's own hooks instead of the program, or None."""
        state = self.state
        if not state.check():
            with _Swaps.lock, self._lock:
                state.revalidate()
        return state.stale or fsdp_state_changed(self.units)

    def __call__(self, *args, **kwargs):
        if not _Swaps.active:
            why = self._why_eager()
            if why is not None:
                if why not in self._warned:
                    self._warned.add(why)
                    log.warning("fulmen: %s runs eagerly (FSDP's hooks): %s", type(self.module).__name__, why)
                return self.module(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def _trace(self, args, kwargs, sizes=None):
        with gathering(self.units):
            return super()._trace(args, kwargs, sizes)


def _rebuild(module: nn.Module, executors, options):
    from fulmen.frontend.module import _program_for

    return _program_for(module, executors, {"options": options})


def whole_program(module: nn.Module, fsdp_module: type, executors, options: dict) -> FSDP2Program | None:
    """The whole-model program of an FSDP2 model, or None (logged, with why) where only the units are compiled."""
    try:
        units = plan(module, fsdp_module)
    except AttributeError as e:  # FSDP2's internals (FSDPParam, FSDPParamGroup) are not this module's to rely on
        units = f"this torch's FSDP2 state is not the one fulmen reads ({e})"
    if isinstance(units, str):
        log.info(
            "fulmen: %s is sharded by FSDP2 but is not traced whole (%s): fulmen compiles its innermost units "
            "and FSDP's hooks run around them",
            type(module).__name__,
            units,
        )
        return None
    return FSDP2Program(module, executors, units, **options)
