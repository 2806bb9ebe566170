"""Whether an operation draws random numbers from torch's generator: the one definition every layer asks.

A draw matters wherever code could be removed, merged, copied, recomputed, fused or traced down a branch eager does
not take: eager advances the generator on every draw, so later draws (and the generator's state the program leaves
behind) match eager's only if each draw runs exactly where and as often as eager runs it.

Three questions, each with its own function:

- ``is_draw(bsym)``: is this bound symbol a draw *itself* (a random prim, or an opaque op that draws): a random
  operation that runs as it is, with no decomposition. Code that walks decompositions on its own asks this of
  every node (replay, CUDA graphs).
- ``draws(bsym)``: does running this call draw, at any depth of its decomposition. A composite tagged
  ``RANDOM_OP`` (dropout, attention) only *can* draw: ``scaled_dot_product_attention`` without dropout decomposes
  into no draw, and it draws nothing. A composite that is not tagged but whose decomposition draws (a user's
  symbol calling dropout) does draw. Dead-code elimination keeps such calls, CSE never merges two, Inductor leaves
  them outside its regions, and a checkpointed region or a ``torch.cond`` branch that holds one is refused where
  eager would draw other numbers.
- ``callable_draws(fn)``: whether an opaque torch callable (no fulmen symbol, so no decomposition to look in) draws;
  its symbol is then tagged ``RANDOM_OP`` and is a draw itself.
"""

from __future__ import annotations

from collections.abc import Callable

from fulmen.core.symbol import BoundSymbol, OpTags


def is_draw(bsym: BoundSymbol) -> bool:
    """A random operation that runs as it is (no decomposition): a random prim, or an opaque op that draws."""
    return not bsym.subsymbols and OpTags.RANDOM_OP in bsym.sym.tags


def draws(bsym: BoundSymbol) -> bool:
    """Whether running ``bsym`` draws from torch's generator: a draw itself, or a composite whose decomposition holds
    one at any depth, whatever the composite's own tags. An unused draw still advances the generator."""
    if bsym.subsymbols:
        return any(map(draws, bsym.subsymbols))
    return OpTags.RANDOM_OP in bsym.sym.tags


_RANDOM_NAME_PARTS = (
    "dropout",
    "rrelu",
    "bernoulli",
    "rand",
    "normal",
    "multinomial",
    "poisson",
    "gumbel",
    "fractional_max_pool",
    "uniform",
    "exponential",
    "geometric",
    "cauchy",
)
_RANDOM_PARAMETERS = frozenset(("generator", "_random_samples"))


def callable_draws(fn: Callable) -> bool:
    """Whether an opaque torch callable draws random numbers: ``fn.draws_random`` (set on user autograd Functions'
    ``apply``), a name that says so, or a Python signature that takes a ``generator`` or the ``_random_samples`` it
    otherwise draws (the fractional max-pools)."""
    if getattr(fn, "draws_random", False):
        return True
    name = getattr(fn, "__name__", "") or ""
    if any(part in name for part in _RANDOM_NAME_PARTS):
        return True
    code = getattr(fn, "__code__", None)
    return code is not None and not _RANDOM_PARAMETERS.isdisjoint(
        code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    )
