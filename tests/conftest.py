"""Session-wide test settings: check every trace after every pipeline step, and skip GPU tests without CUDA."""

import os

# Hundreds of test programs run once each: their fused regions run with the torch executor ("off") instead of
# each starting an Inductor compilation. The Inductor tests (test_inductor.py) compile with compile_mode "sync".
os.environ.setdefault("FULMEN_COMPILE", "off")

# Every step of the pipeline runs check_trace on the trace it produced (single assignment, use after definition,
# metas that agree with recorded outputs): the check_traces option's documented override (fulmen.core.options).
os.environ.setdefault("FULMEN_CHECK_TRACES", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tests outside `make test`'s default run (`-m "not slow"`); `make test-all` and .ci/run run them too.
# - Each OpInfo compiled by Inductor: about half of the suite's time. The default run keeps one op of each kind
#   (elementwise, reduction, normalization, matrix product, attention, loss); test_ops covers every op's math.
# - Tests that start fresh processes (building C++ under a wall-clock limit, or several in a row): on a loaded
#   machine they take minutes, or fail by timing rather than by a fault in fulmen.
_SLOW_FILES = {"test_inductor_opinfos.py"}
_FAST_INDUCTOR_OPINFOS = {"add", "gelu", "sum", "layer_norm", "matmul", "scaled_dot_product_attention", "cross_entropy"}
_SLOW_TESTS = {
    "test_a_later_process_takes_whole_compilations_from_inductors_graph_cache",
    "test_prefetched_header_is_the_one_the_kernels_use",
    "test_cli_bench_repeat_takes_backends_in_turns",  # four fresh processes, each importing torch and fulmen
}


def _is_slow(item) -> bool:
    if item.originalname in _SLOW_TESTS:
        return True
    if item.path.name not in _SLOW_FILES:
        return False
    callspec = getattr(item, "callspec", None)
    op = callspec.params.get("op") if callspec is not None else None
    return getattr(op, "name", None) not in _FAST_INDUCTOR_OPINFOS


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def quiet_transformers():
    """Hugging Face models built from configs log advice at warning level; the tests that build them hide it."""
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)
