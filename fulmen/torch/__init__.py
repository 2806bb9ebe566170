"""The torch language: one symbol per torch callable, with torch's semantics, decomposed into clang and prims.

Import as ``import fulmen.torch as ltorch``. Each symbol's id is the torch name users know
(``ltorch.cross_entropy.id == "torch.nn.functional.cross_entropy"``). Files by kind:
elementwise, reductions, linalg, shape (views, joins, splits), rearrange (pad, flip, roll, repeat, triangles),
indexing, creation, conversion, nn, embedding, nn_conv, nn_attention (multi-head attention), losses, attention.
"""

from fulmen.core.dtypes import to_torch_dtype  # noqa: F401
from fulmen.core.symbol import OpTags as _OpTags
from fulmen.torch import (  # noqa: F401  (opaque ops; cond, scans; hooks)
    collectives,  # noqa: F401  (torch.distributed collectives)
    fallback,
    higher_order,
    hooks,
    numpy_values,
)
from fulmen.torch.attention import *  # noqa: F401,F403
from fulmen.torch.conversion import *  # noqa: F401,F403
from fulmen.torch.creation import *  # noqa: F401,F403
from fulmen.torch.elementwise import *  # noqa: F401,F403
from fulmen.torch.elementwise import abs, pow, round  # noqa: F401
from fulmen.torch.embedding import *  # noqa: F401,F403
from fulmen.torch.indexing import *  # noqa: F401,F403
from fulmen.torch.linalg import *  # noqa: F401,F403
from fulmen.torch.losses import *  # noqa: F401,F403
from fulmen.torch.nn import *  # noqa: F401,F403
from fulmen.torch.nn_attention import *  # noqa: F401,F403
from fulmen.torch.nn_conv import *  # noqa: F401,F403
from fulmen.torch.rearrange import *  # noqa: F401,F403
from fulmen.torch.reductions import *  # noqa: F401,F403
from fulmen.torch.registry import symbols_by_id, torchsymbol  # noqa: F401
from fulmen.torch.shape import *  # noqa: F401,F403
from fulmen.torch.shape import follow_input_layout as _follow_input_layout
from fulmen.torch.statistics import *  # noqa: F401,F403

# eager lays an op's results out by the op's own rule (an elementwise op's as its inputs are, layer_norm's
# contiguous): later views and reshapes of them depend on that
for _sym in symbols_by_id.values():
    if _sym.post_hook is None and _sym.torch_fns and (_OpTags.ELEMENTWISE in _sym.tags or _sym.torch_executable):
        _sym.post_hook = _follow_input_layout
del _sym
