"""FSDP2 on top of tensor parallelism (a 2-D mesh: ``parallelize_module`` on "tp", then ``fully_shard`` on "dp")
under ``fulmen.jit``: FSDP2's all-gathers and reduce-scatters fed into the DTensor program.

``fully_shard`` of a module whose parameters are already DTensors on the tp mesh (``FSDPParam``'s TP path) shards
each parameter's *TP-local* tensor on dim 0 over the dp ranks, as it shards a plain parameter: the sharded
parameter is a DTensor on the (dp, tp) mesh, ``Shard(0)`` on dp (``_StridedShard(0, split_factor)`` where tp shards
dim 0 too, which says in what order the rows were split), the TP placement on tp; its local tensor is this rank's
dim-0 chunk of the TP-local tensor, padded to ``ceil(rows / dp)`` rows for the all-gather, as in 1-D FSDP2. Before
a unit's forward, FSDP2 all-gathers the chunks over dp into the TP-local tensor and makes it a DTensor again with
the TP spec (mesh "tp" and its placements), which the TP module code reads; the gradient reaching that DTensor is
redistributed to the TP placements, and its local tensor reduce-scattered (averaged) over dp into the shard's
gradient, a DTensor with the sharded parameter's 2-D spec.

The program here is the DTensor program (``fulmen.frontend.dtensor_program``: AOTAutograd traces the module on
fake DTensors into local operations and functional collectives, and fulmen compiles the forward and the backward)
with FSDP2's part done inside it:

- each FSDP parameter's local shard (``param.to_local()``: its backward makes the shard's gradient a DTensor with
  the parameter's 2-D spec, accumulated into ``param.grad`` as FSDP2 does) is an input of the program;
- where a unit's forward begins (its FSDP pre-hook would run), the program pads, concatenates and all-gathers the
  unit's shards over dp once, as FSDP2's copy-in and copy-out do (``fsdp2_program.gather_unit``, the one layout),
  and wraps each TP parameter's gathered TP-local tensor into a DTensor with its TP spec (``DTensor.from_local``,
  whose backward redistributes the gradient to the TP placements as FSDP2's ``_get_grad_inner_tensor`` does);
- the all-gather's gradient is FSDP2's reduction: a reduce-scatter averaged over the dp ranks.

The forward trace holds the dp all-gathers and the tp collectives DTensor issues; the backward trace the tp
collectives, the dp all-gathers again and the dp reduce-scatters: the gathers are tagged to be recomputed when
AOTAutograd partitions the program (``_recompute_gathers``), so the forward saves the shards, not the gathered
parameters, as FSDP2 reshards after forward.

Traced on a tp mesh separate from the dp mesh (``fully_shard(module, mesh=mesh["dp"])``): FSDP2's default policies
(``fsdp2_program._unit``), and two others (``TRACED_POLICIES``): ``reshard_after_forward=False``, whose gathers are
not tagged for recomputation, so the backward reads the parameters the forward gathered, as FSDP2 keeps them; and
mixed precision (``MixedPrecisionPolicy``): each unit's shards cast to ``param_dtype`` before the all-gather, the
gathered gradient cast to ``reduce_dtype`` before the reduce-scatter and the result back to the shard's dtype, the
unit's floating-point inputs cast to ``param_dtype`` and its outputs to ``output_dtype``, as FSDP2's hooks do.
``fully_shard`` on the whole 2-D mesh with ``dp_mesh_dims``, or any other policy (``reshard_after_forward`` an int
resharding to a smaller group, gradients reduced in another dtype than float32 or bfloat16, a custom collective,
...), is refused with an error naming the wrappers, the option and what works. A later call whose FSDP state is not
the traced one (``unshard()``, gradients accumulated without sync, a policy changed) runs eagerly through FSDP's
hooks, with a log line.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import nn

from fulmen.frontend import fsdp2_program
from fulmen.frontend.dtensor_program import DTensorProgram
from fulmen.frontend.fsdp2_program import _ParamLayout, _Unit

log = logging.getLogger("fulmen")


def is_two_d(model: nn.Module, fsdp_module: type) -> bool:
    """Whether ``model`` combines FSDP2 with DTensors of its own: a parameter that was a DTensor when
    ``fully_shard`` sharded it (2-D), or a DTensor parameter or buffer outside every FSDP2 unit."""
    from torch.distributed.tensor import DTensor

    shards = set()
    for _, state in fsdp2_program.fsdp_states(model, fsdp_module):
        for group in state._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                if fsdp_param.is_dtensor:
                    return True
                shards.add(id(fsdp_param.sharded_param))
    tensors = (*model.parameters(), *model.buffers())
    return any(isinstance(t, DTensor) and id(t) not in shards for t in tensors)


def _refusal(model: nn.Module, why: str) -> NotImplementedError:
    return NotImplementedError(
        f"fulmen.jit({type(model).__name__}): the model combines fully_shard (FSDP2) with parallelize_module (tensor "
        f"parallelism, 2-D), and {why}. fulmen.jit traces a 2-D model whose fully_shard calls shard on the "
        'data-parallel sub-mesh (fully_shard(module, mesh=mesh["dp"])) after parallelize_module on the '
        'tensor-parallel one (mesh["tp"]), with FSDP2\'s default policies, reshard_after_forward=False, or a '
        "MixedPrecisionPolicy (param_dtype, reduce_dtype float32 or bfloat16, output_dtype). Run this model "
        "without fulmen.jit, or use those policies."
    )


def plan(model: nn.Module, fsdp_module: type) -> list[_Unit]:
    """The FSDP2 units of a 2-D model, each parameter's gather layout; raises naming the wrappers where a unit's
    policy is not the one traced."""
    units = []
    for m, state in fsdp2_program.set_up(fsdp2_program.fsdp_states(model, fsdp_module)):
        for group in state._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                if fsdp_param.mesh_info.is_spmd_mesh:
                    raise _refusal(model, f"{type(m).__name__} was sharded on the 2-D mesh itself (dp_mesh_dims)")
        unit = fsdp2_program._unit(m, state, TRACED_POLICIES)
        if isinstance(unit, str):
            raise _refusal(model, unit)
        units.append(unit)
    return units


#: The FSDP2 policies the 2-D program traces besides the defaults: ``reshard_after_forward=False`` (the backward
#: reads the parameters gathered in the forward, ``_recompute_gathers``) and mixed precision (``_GatherShards``)
TRACED_POLICIES = frozenset({fsdp2_program.NO_RESHARD, fsdp2_program.MIXED_PRECISION})


class _GatherShards(torch.autograd.Function):
    """FSDP2's all-gather of a unit's flat shards over dp, cast first to the mixed-precision ``param_dtype`` where
    one is set (FSDP2's copy-in); its gradient is FSDP2's reduction of the gathered gradient: cast to
    ``reduce_dtype`` where one is set, reduce-scattered averaged over the dp ranks (FSDP2's default for float32 and
    bfloat16, the only reduction dtypes ``fsdp2_program._layout`` lets through), cast back to the shard's dtype."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, world: int, group: str, param_dtype, reduce_dtype) -> torch.Tensor:
        ctx.world, ctx.group, ctx.dtypes = world, group, (flat.dtype, reduce_dtype)
        c10d = torch.ops._c10d_functional
        if param_dtype is not None:
            flat = flat.to(param_dtype)
        return c10d.wait_tensor(c10d.all_gather_into_tensor(flat, world, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        c10d = torch.ops._c10d_functional
        shard_dtype, reduce_dtype = ctx.dtypes
        if reduce_dtype is not None:
            grad = grad.to(reduce_dtype)
        reduced = c10d.wait_tensor(c10d.reduce_scatter_tensor(grad.contiguous(), "avg", ctx.world, ctx.group))
        return reduced.to(shard_dtype), None, None, None, None


def _as_parameter(layout: _ParamLayout, full: torch.Tensor) -> torch.Tensor:
    """The gathered tensor as the module reads it: a DTensor with the TP spec for a tensor-parallel parameter."""
    spec = layout.fsdp_param._unsharded_dtensor_spec
    if spec is None:
        return full
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(full, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)


#: FSDP2's gather layout (``fsdp2_program.gather_unit``) issued in AOTAutograd's program: c10d's functional
#: all-gather with FSDP2's reduce-scatter as its gradient, shards as AOTAutograd's tensors, and each gathered
#: TP-local tensor made a DTensor with its TP spec
_AOT = fsdp2_program.GatherPath(_GatherShards.apply, torch.Tensor, _as_parameter)


def _recompute_gathers(graph: torch.fx.Graph, groups: set[str], kept: frozenset[torch.fx.Node] = frozenset()) -> None:
    """Tags FSDP2's all-gathers over dp in AOTAutograd's joint graph, what builds their input from the shards and
    the views of their result, to be recomputed in the backward (``CheckpointPolicy.MUST_RECOMPUTE``, which the
    partitioner honours for collectives): the forward then saves the shards rather than the gathered parameters,
    and the backward gathers them again, as FSDP2 reshards after forward. The gathers of the shards in ``kept``
    (placeholders: units with ``reshard_after_forward=False``) are left to the partitioner, which saves what the
    backward reads of them, as FSDP2 keeps such a unit's parameters gathered until its backward. Sound because every
    rank runs the same backward program, so the ranks issue the same collectives in the same order."""
    from torch.utils.checkpoint import CheckpointPolicy

    c10d = torch.ops._c10d_functional
    gathers, tagged = [], set()
    for node in graph.nodes:
        if node.target is c10d.all_gather_into_tensor.default and node.args[2] in groups:
            chain, stack = set(), [node]
            while stack:  # upward: the padding, flattening and concatenation of the shards (placeholders)
                n = stack.pop()
                if n.op == "call_function" and n not in chain:
                    chain.add(n)
                    stack += n.all_input_nodes
            if not any(p in kept for n in chain for p in n.all_input_nodes):
                gathers.append(node)
                tagged |= chain
    stack = [u for gather in gathers for u in gather.users if u.target is c10d.wait_tensor.default]
    while stack:  # downward: the views that take each parameter out of the gathered buffer
        node = stack.pop()
        tagged.add(node)
        stack += [u for u in node.users if u not in tagged and _is_view(u)]
    for node in tagged:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


def _is_view(node: torch.fx.Node) -> bool:
    """Whether ``node`` takes a piece of its input as it is: a view, or a reshape's copy (``clone`` then
    ``_unsafe_view``, as AOTAutograd decomposes the reshape of a non-contiguous column block)."""
    target = node.target
    if target is operator.getitem or target in (torch.ops.aten.clone.default, torch.ops.aten._unsafe_view.default):
        return True
    return isinstance(target, torch._ops.OpOverload) and target.is_view


class _RunEagerly(Exception):
    """This call runs through FSDP's own hooks (the message says why)."""


def _units_changed(model: nn.Module, units: list[_Unit]) -> str | None:
    """Why the model's FSDP2 units are no longer the traced ones (``fully_shard`` applied to a module after
    ``fulmen.jit``: its hooks would gather its parameters in the program, unplanned), or None."""
    from fulmen.frontend.fsdp2 import fsdp_module_class

    fsdp_module = fsdp_module_class(model)
    states = fsdp2_program.fsdp_states(model, fsdp_module) if fsdp_module is not None else []
    current = {id(state) for _, state in states}
    if current != {id(unit.module._get_fsdp_state()) for unit in units}:
        return "its FSDP2 units changed since it was traced (fully_shard applied after fulmen.jit); jit it again"
    return None


class FSDP2DTensorProgram(DTensorProgram):
    """What ``fulmen.jit(model)`` calls for a 2-D model (FSDP2 over tensor parallelism; see the module doc)."""

    def __init__(self, module: nn.Module, executors, options: dict, units: list[_Unit]):
        self.units = units
        # the sharded parameters, by identity: the program takes their local shards
        self._shards = {id(layout.fsdp_param.sharded_param): layout for unit in units for layout in unit.layouts}
        self._warned: set[str] = set()
        self._units_changed: str | None = None
        super().__init__(module, executors, options)
        log.info(
            "fulmen: %s combines FSDP2 (%d units) with tensor parallelism: fulmen traces its DTensor program with "
            "each unit's all-gather over dp and the gradients' reduce-scatter in it",
            type(module).__name__,
            len(units),
        )

    def __reduce__(self):
        """Pickled (``copy.deepcopy`` of the jitted model): the copy plans its own units and traces again."""
        return _rebuild, (self.module, self.executors, self.options)

    def _state(self) -> tuple[dict[str, torch.Tensor], tuple]:
        scan = self._scan
        state, facts = super()._state()
        if self._scan is not scan:  # the module tree changed (its classes, hooks): FSDP2's units may have too
            self._units_changed = _units_changed(self.module, self.units)
        if self._units_changed is not None:
            raise _RunEagerly(self._units_changed)
        shards = self._shards
        return {k: t.to_local() if id(t) in shards else t for k, t in state.items()}, facts

    def _run_module(self, bound: dict, args: tuple, kwargs: dict):
        with fsdp2_program.gathering(self.units, _AOT):
            return super()._run_module(bound, args, kwargs)

    def _trace(self, names: list[str]):
        self._traced_names = names  # the state's names, in the order of the joint graph's first placeholders
        return super()._trace(names)

    def _partition(self, joint: torch.fx.GraphModule, joint_inputs, **kwargs):
        state, _ = super()._state()
        kept = {id(x.fsdp_param.sharded_param) for unit in self.units if not unit.reshard for x in unit.layouts}
        primals = [n for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("primals")]
        shards = frozenset(p for p, name in zip(primals, self._traced_names) if id(state.get(name)) in kept)
        _recompute_gathers(joint.graph, {layout.group for unit in self.units for layout in unit.layouts}, shards)
        return super()._partition(joint, joint_inputs, **kwargs)

    def _why_eager(self) -> str | None:
        """Why this call runs through FSDP's own hooks instead of the program, or None."""
        for unit in self.units:
            for layout in unit.layouts:
                m, n = layout.places[0]
                if m._parameters.get(n) is not layout.fsdp_param.sharded_param:
                    return f"{type(m).__name__}.{n} is not FSDP2's sharded parameter (unsharded, or replaced)"
        return fsdp2_program.fsdp_state_changed(self.units)

    def __call__(self, *args, **kwargs):
        why = self._why_eager()
        if why is None:
            try:
                return super().__call__(*args, **kwargs)
            except _RunEagerly as e:  # raised before the program ran (``_state``)
                why = str(e)
        if why not in self._warned:
            self._warned.add(why)
            log.warning("fulmen: %s runs eagerly (FSDP's hooks): %s", type(self.module).__name__, why)
        return self.module(*args, **kwargs)


def _rebuild(module: nn.Module, executors, options: dict):
    from fulmen.frontend.fsdp2 import fsdp_module_class

    return FSDP2DTensorProgram(module, executors, options, plan(module, fsdp_module_class(module)))


def whole_program(module: nn.Module, fsdp_module: type, executors, options: dict) -> FSDP2DTensorProgram:
    """The program of a 2-D model (``is_two_d``); raises naming the wrappers where it cannot be traced."""
    try:
        units = plan(module, fsdp_module)
    except AttributeError as e:  # FSDP2's internals (FSDPParam, FSDPParamGroup) are not this module's to rely on
        raise _refusal(module, f"this torch's FSDP2 state is not the one fulmen reads ({e})") from e
    return FSDP2DTensorProgram(module, executors, options, units)
