"""Session-wide test settings: check every trace after every transform, and skip GPU tests without CUDA."""

import pytest
import torch

import fulmen.frontend.compile as _compile

# Every step of the execution pipeline runs check_trace on the trace it produced (single assignment,
# use after definition, metas that agree with recorded outputs).
_compile.CHECK_TRACES = True


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
