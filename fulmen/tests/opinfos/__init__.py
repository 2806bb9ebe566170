"""The OpInfo database: for each operation, sample inputs, error inputs, a torch reference and directives.

Tests generated from it check meta vs real outputs, each executor vs eager torch, gradients, error inputs
and the print -> exec round trip. Entries live in one file per kind of operation; ``all_opinfos`` lists
them. Example (seed 002)::

    from fulmen.tests.opinfos import add_opinfo
    sample = next(add_opinfo.sample_input_generator(add_opinfo, device="cpu", dtype=torch.float32,
                                                    requires_grad=False))
"""

from fulmen.tests.opinfos.base import (  # noqa: F401
    DecorateInfo,
    OpInfo,
    SampleInput,
    all_opinfos,  # noqa: F401,E402
    make_tensor,
)
from fulmen.tests.opinfos.elementwise import *  # noqa: F401,F403
from fulmen.tests.opinfos.linalg import *  # noqa: F401,F403
from fulmen.tests.opinfos.nn import *  # noqa: F401,F403
from fulmen.tests.opinfos.reductions import *  # noqa: F401,F403
from fulmen.tests.opinfos.shape import *  # noqa: F401,F403
