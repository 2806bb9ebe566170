"""Session-wide test settings: check every trace after every transform, and skip GPU tests without CUDA."""

import os

# Hundreds of test programs run once each: their fused regions run with the torch executor ("off") instead of
# each starting an Inductor compilation. The Inductor tests (test_inductor.py) compile with compile_mode "sync".
os.environ.setdefault("FULMEN_COMPILE", "off")

import pytest  # noqa: E402
import torch  # noqa: E402

import fulmen.frontend.compile as _compile  # noqa: E402

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
