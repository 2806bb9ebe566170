"""The primitive operations: a closed set, each declared once with meta, torch implementation, tags and doc.

Every other operation decomposes into these. ``PrimIDs`` names them; ``all_prims()`` lists them.
"""

from fulmen.prims.base import PrimIDs, all_prims, make_prim, prim_by_id  # noqa: F401
from fulmen.prims.data import (  # noqa: F401
    bernoulli,
    convert_element_type,
    copy_,
    device_put,
    empty,
    full,
    get_rng_state,
    iota,
    manual_seed,
    normal,
    randint,
    set_rng_state,
    uniform,
)
from fulmen.prims.elementwise import *  # noqa: F401,F403
from fulmen.prims.elementwise import abs, pow, round  # noqa: F401  (names that shadow builtins)
from fulmen.prims.indexing import index_add, index_put, scatter, scatter_add, take, take_along_axis  # noqa: F401
from fulmen.prims.linalg import convolution, linear, matmul  # noqa: F401
from fulmen.prims.reductions import (  # noqa: F401
    amax,
    amin,
    argmax,
    argmin,
    cumprod,
    cumsum,
    prod,
    sort,
    sum,
    topk,
    var,
    var_mean,
)
from fulmen.prims.shape import (  # noqa: F401
    broadcast_in_dim,
    cat,
    flip,
    pad,
    reshape,
    slice_prim,
    squeeze,
    stride_order,
    transpose,
    unfold,
)
