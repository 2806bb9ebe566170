"""The statements of ``generate(hunt=True)``: kinds of programs where fused code most often parts from eager.

Chains of views written in place (across ops that end a fused region), ``out=`` into values read later, narrow
integer dtypes (wrapping sums, floor division and remainder of negatives, shifts), complex values, NaN/inf/-0.0
through ``where``/masks/min/max, reductions over ``dim=()``/keepdim/empty dims, random ops under a seed, small
nn layers (conv, norms, pools) on non-contiguous inputs. Each function takes the generator and returns a
statement, or None when the pool holds nothing it applies to."""

from __future__ import annotations

import torch

from fulmen.fuzz.program import _FLOATS, _INTS, Stmt

# statements of the kinds below, by weight
KINDS = {"viewchain": 3, "outarg": 2, "integer": 3, "special": 3, "reduce": 2, "random": 1.5, "layer": 2,
         "complex": 1, "boundary": 2}

# a nonzero divisor with the divisor's dtype and sign (eager raises on an integer division by zero)
_NONZERO = "torch.where({b} == 0, 1, {b})"


def statement(g) -> Stmt | None:
    kind = g.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    return globals()["_" + kind](g)


def _floats(g, ndim: int = 0):
    return g.pick(lambda t: t.dtype in _FLOATS and t.ndim >= ndim)


def _viewchain(g) -> Stmt | None:
    """A view of a view of a value, or an in-place write through such a view (its base read later)."""
    rng = g.rng
    views = [s for s in g.stmts if s.category == "viewchain" and s.target]
    if views and rng.random() < 0.5:
        v = rng.choice(views).target
        t = g.env[v]
        src = rng.choice(["2", "(-1.5)", g.broadcastable(v)])
        forms = [f"{v}.mul_({src})", f"{v}.add_({src})", f"{v}.copy_({src})" if not src[0].isdigit()
                 and src[0] != "(" else f"{v}.fill_({src})", f"{v}.zero_()"]
        if t.ndim:
            forms.append(f"{v}[0] = {src}")
        form = rng.choice(forms)
        uses = (v,) if src[0].isdigit() or src[0] == "(" else (v, src)
        return g.stmt(form, uses, "viewchain", target=None if "] =" in form else "")
    a = g.pick(lambda t: t.ndim >= 2 and t.numel() > 0)
    if a is None:
        return None
    t = g.env[a]
    chain = rng.choice([".t()" if t.ndim == 2 else ".transpose(0, -1)", ".mT", "[1:]", "[:, ::2]",
                        f".unflatten(-1, ({t.shape[-1]}, 1))", ".unsqueeze(1)", f".narrow(-1, 0, {t.shape[-1]})",
                        ".flip(0)"])
    chain += rng.choice(["[..., :1]", ".squeeze(0)", ".unsqueeze(0)", ".diagonal()" if t.ndim == 2 else "[0]",
                         ".view_as(" + a + chain + ")" if "flip" not in chain else "[0]", ".expand_as(" + a + chain
                         + ")" if "flip" not in chain else ".unsqueeze(-1)"])
    return g.stmt(f"{a}{chain}", (a,), "viewchain")


def _outarg(g) -> Stmt | None:
    """An op writing into an earlier value (or a view of one) through ``out=``, that value read again later."""
    rng = g.rng
    a = g.pick(lambda t: t.numel() > 0)
    if a is None:
        return None
    t = g.env[a]
    same = [n for n in g.intermediates if n != a and isinstance(g.env.get(n), torch.Tensor)
            and g.env[n].shape == t.shape and g.env[n].dtype == t.dtype]
    out = rng.choice(same) if same and rng.random() < 0.7 else None
    uses = (a, out) if out else (a,)
    # (eager resizes an empty out=; fulmen refuses that with a clear error, a known limit not worth re-finding)
    target = out or f"torch.empty_like({a})"
    forms = [f"torch.add({a}, {a}, alpha=2, out={target})", f"torch.mul({a}, 3, out={target})",
             f"torch.neg({a}, out={target})", f"torch.clamp({a}, 0, 1, out={target})",
             f"torch.cumsum({a}, 0, out={target})" if t.ndim else f"torch.abs({a}, out={target})"]
    if t.dtype in _FLOATS:
        forms += [f"torch.exp({a}, out={target})", f"torch.sigmoid({a}, out={target})"]
    if t.ndim and out is None:
        forms += [f"torch.sum({a}, 0, out=torch.empty_like({a}[0]))"]
    return g.stmt(rng.choice(forms), uses, "outarg")


def _integer(g) -> Stmt | None:
    """Integer arithmetic: floor division and remainder with negatives, shifts, wrap-around in narrow dtypes."""
    rng = g.rng
    a = g.pick(lambda t: t.dtype in _INTS)
    if a is None or rng.random() < 0.3:
        a = g.new_input(dtype=rng.choice([torch.int8, torch.uint8, torch.int32, torch.int64]))
    b = g.broadcastable(a)
    nz = _NONZERO.format(b=b)
    small = f"({b} & 7)" if g.env[b].dtype in _INTS else "3"
    forms = [f"{a} // {nz}", f"torch.floor_divide({a}, {nz})", f"torch.remainder({a}, {nz})",
             f"torch.fmod({a}, {nz})", f"torch.div({a}, {nz}, rounding_mode='floor')",
             f"torch.div({a}, {nz}, rounding_mode='trunc')", f"{a} % (-3)", f"{a} // (-2)", f"{a} << {small}",
             f"{a} >> {small}", f"{a} * {a}", f"{a} + {a}.flip(-1)" if g.env[a].ndim else f"{a} + 100",
             f"{a}.sum(-1)" if g.env[a].ndim else f"{a} - 100", f"{a}.cumsum(0)" if g.env[a].ndim else f"{a} * 3",
             f"torch.abs({a})", f"-{a}", f"{a}.to(torch.int8)", f"{a}.float() / {a}", f"{a} / {nz}",
             f"torch.bitwise_xor({a}, {b})", f"{a}.prod()", f"torch.true_divide({a}, 2)"]
    return g.stmt(rng.choice(forms), (a, b), "integer")


def _special(g) -> Stmt | None:
    """NaN, infinities and signed zeros through where/masks, min/max, NaN-aware and sign-reading ops."""
    rng = g.rng
    a = _floats(g)
    if a is None or rng.random() < 0.5:
        a = g.new_input(dtype=rng.choice([torch.float32, torch.float32, torch.float64, torch.float16]), special=True)
    b = g.broadcastable(a)
    forms = [f"torch.where({a}.isnan(), 0.0, {a})", f"torch.where({a} > {b}, {a}, {b})",
             f"torch.maximum({a}, {b})", f"torch.minimum({a}, {b})", f"torch.fmax({a}, {b})",
             f"torch.fmin({a}, {b})", f"{a}.masked_fill({b} != {b}, float('inf'))", f"torch.nan_to_num({a})",
             f"torch.clamp({a}, min={b})", f"torch.clamp({a}, -1.0, 1.0)", f"1 / {a}", f"torch.atan2({a}, {b})",
             f"torch.copysign({b}, {a})", f"torch.signbit({a})", f"torch.sign({a})", f"{a} * 0",
             f"{a}.amax()", f"{a}.amin(-1)" if g.env[a].ndim else f"{a}.amin()", f"{a}.argmax()",
             f"torch.nansum({a})", f"{a}.sum()", f"{a}.isinf()", f"torch.relu({a})", f"{a}.abs()",
             f"torch.sqrt({a})", f"{a}.log()", f"torch.where({a} == 0, {a}, 1 / {a})", f"{a}.round()",
             f"torch.sort({a}, -1).values" if g.env[a].ndim else f"{a}.neg()",
             f"{a}.max(-1).indices" if g.env[a].ndim else f"{a}.sign()", f"{a} == {b}", f"{a}.floor()",
             f"torch.logsumexp({a}, -1)" if g.env[a].ndim else f"{a}.exp()"]
    form = rng.choice(forms)
    return g.stmt(form, (a, b) if b in form else (a,), "special")


def _reduce(g) -> Stmt | None:
    """Reductions over no dims, all dims as a tuple, with keepdim, over empty inputs or empty dims."""
    rng = g.rng
    a = g.pick()
    if a is None or rng.random() < 0.25:
        shape = list(g.shape(rng.choice([1, 2, 3])))
        shape[rng.randrange(len(shape))] = 0
        a = g.new_input(tuple(shape), dtype=rng.choice([torch.float32, torch.int64, torch.bool]))
    t = g.env[a]
    keep = rng.choice([True, False])
    dims = rng.choice(["()", "[]", tuple(range(t.ndim)), (0, -1) if t.ndim >= 2 else "()", (-1,) if t.ndim else "()"])
    forms = [f"{a}.sum(dim={dims}, keepdim={keep})", f"torch.sum({a}, {dims})", f"{a}.amax(dim={dims})",
             f"{a}.any(dim={dims})" if isinstance(dims, tuple) else f"{a}.any()", f"{a}.prod()",
             f"{a}.count_nonzero()", f"{a}.sum(dtype=torch.int32)" if t.dtype in _INTS else f"{a}.sum()"]
    if t.dtype in _FLOATS:
        forms += [f"{a}.mean(dim={dims}, keepdim={keep})", f"torch.var({a}, dim={dims}, keepdim={keep})",
                  f"{a}.std({dims}, correction=0)", f"torch.nansum({a}, {dims})",
                  f"torch.linalg.vector_norm({a}, 2, {dims})", f"{a}.logsumexp({dims})"]
    if t.dtype in _INTS:
        forms += [f"{a}.float().mean(dim={dims}, keepdim={keep})"]
    return g.stmt(rng.choice(forms), (a,), "reduce")


def _random(g) -> Stmt | None:
    """Random ops drawing from torch's generator (seeded before each call): eager's numbers are expected."""
    rng = g.rng
    a = _floats(g)
    if a is None:
        return None
    t = g.env[a]
    forms = [f"torch.rand_like({a})", f"{a} + torch.randn({tuple(t.shape)}, dtype={a}.dtype)",
             f"torch.bernoulli(torch.sigmoid({a}).detach())", f"torch.nn.functional.dropout({a}, 0.5)",
             f"{a} * torch.randint(0, 3, {tuple(t.shape)})", f"torch.normal({a}.detach(), 1.0)",
             f"{a}.detach().clone().uniform_(-1, 1)", f"{a}[torch.randperm({t.shape[0]})]" if t.ndim
             else f"torch.rand_like({a})", f"torch.randn_like({a}) * {a}",
             f"torch.nn.functional.dropout({a}.t(), 0.25)" if t.ndim == 2 else f"torch.rand(3) + {a}.sum()"]
    return g.stmt(rng.choice(forms), (a,), "random")


def _layer(g) -> Stmt | None:
    """A small nn layer (conv, batch/group/instance norm, pooling, interpolation) on an input of any layout."""
    rng = g.rng
    n, c, h, w = rng.choice([1, 2]), rng.choice([2, 3, 4]), rng.choice([3, 4, 5]), rng.choice([3, 4, 5])
    x = g.new_input((n, c, h, w), dtype=rng.choice([torch.float32, torch.float32, torch.float64]))
    dtype = g.env[x].dtype
    weight = g.new_input((rng.choice([1, 2, 3]), c, 2, 2), dtype=dtype)
    stats = [g.new_input((c,), dtype=dtype, grad=False) for _ in range(2)]
    forms = [f"torch.nn.functional.conv2d({x}, {weight}, stride={rng.choice([1, 2])}, padding=1)",
             f"torch.nn.functional.conv2d({x}, {weight}.mT)",
             f"torch.nn.functional.batch_norm({x}, {stats[0]}, {stats[1]}.abs(), training=True, momentum=0.3)",
             f"torch.nn.functional.batch_norm({x}, {stats[0]}, {stats[1]}.abs(), training=False)",
             f"torch.nn.functional.group_norm({x}, 1)", f"torch.nn.functional.instance_norm({x})",
             f"torch.nn.functional.max_pool2d({x}, 2)", f"torch.nn.functional.avg_pool2d({x}, 2, ceil_mode=True)",
             f"torch.nn.functional.adaptive_avg_pool2d({x}, (2, 1))", f"torch.nn.functional.interpolate({x}, "
             f"scale_factor=2, mode='{rng.choice(['nearest', 'bilinear'])}')",
             f"torch.nn.functional.layer_norm({x}, ({w},), {weight}[0, 0, 0, :1].expand({w}))",
             f"torch.nn.functional.max_pool2d({x}.transpose(2, 3), 2, return_indices=True)[1]"]
    form = rng.choice(forms)
    uses = tuple(v for v in (x, weight, *stats) if v in form)
    return g.stmt(form, uses, "layer")


def _complex(g) -> Stmt | None:
    """Complex values: made from floats, computed with, and taken apart again."""
    rng = g.rng
    a = g.pick(lambda t: t.dtype in (torch.float32, torch.float64) and t.ndim >= 1)
    if a is None:
        return None
    z = f"torch.complex({a}, {a}.flip(-1))"
    forms = [f"({z} * {z}).real", f"torch.view_as_real({z} * 1j)", f"({z} / ({z}.abs() + 1)).imag",
             f"{z}.abs()", f"torch.angle({z})", f"({z}.conj() * 2).imag", f"torch.exp({z}).real",
             f"torch.polar({a}.abs(), {a})", f"({z} + 1).sum(-1).real"]
    return g.stmt(rng.choice(forms), (a,), "complex")


def _boundary(g) -> Stmt | None:
    """Ops that no fusion region holds (sorting, matrix products, scans, index writes): a value crosses a region
    boundary before the next statement reads or writes it."""
    rng = g.rng
    a = _floats(g, 1)
    if a is None:
        return None
    t = g.env[a]
    k = t.shape[-1]
    forms = [f"torch.sort({a}, -1).values", f"{a}.topk({min(k, 2)}, -1).values" if k
             else f"{a}.cumsum(-1)", f"{a} @ {a}.mT" if t.ndim >= 2 else f"{a} @ {a}", f"{a}.cumsum(-1)",
             f"{a}.index_add(-1, torch.tensor([0] * {k}), {a})" if k else f"{a}.cummax(-1).values",
             f"{a}.cummax(-1).values", f"{a}.scatter_add(-1, torch.zeros_like({a}, dtype=torch.int64), {a})"]
    return g.stmt(rng.choice(forms), (a,), "boundary")
