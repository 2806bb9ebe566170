"""The Hugging Face family matrix (issue 42): each family built from its config class with the shipped defaults
(``use_cache``, attention implementation), shrunk only in size, through ``fulmen.jit`` and through
``torch.compile(backend="fulmen")``. Every row compares the outputs (caches included), the loss and every
parameter's gradient with eager PyTorch on the same weights; a backend row also fails if any graph Dynamo
captured ran with eager PyTorch instead of fulmen. ``fulmen/bench/hf_matrix.py`` holds the check and its
tolerances; ``benchmarks/hf_matrix.py`` times the same rows.

A few cheap rows run by default; the whole matrix is marked slow. A row that fails for a known reason is a
strict xfail naming it, so that a fix flips it loudly. The families whose default config returns a key/value cache
also run through ``fulmen.jit`` with ``use_cache=False`` ("jit-nocache").
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from fulmen.bench.hf_families import FAMILIES  # noqa: E402
from fulmen.bench.hf_matrix import check_family  # noqa: E402

# Families whose default config returns a Cache object (DynamicCache, EncoderDecoderCache, MambaCache).
CACHED = {"gpt2", "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "gemma2", "gemma3", "phi3",
          "falcon", "gpt_neox", "opt", "bloom", "t5", "whisper", "mamba"}

# (family, path) -> (why it fails now, the error it fails with); every other row must pass. The error type is
# part of the expectation: a row that starts failing another way fails the run.
KNOWN_FAILURES: dict[tuple[str, str], tuple[str, type[Exception]]] = {}

# The default run: one encoder, one vision model, one decoder with its cache off and one returning its cache.
FAST = {("roberta", "jit"), ("vit", "jit"), ("opt", "jit-nocache"), ("llama", "jit")}


def _rows():
    for name in FAMILIES:
        paths = ["jit", "backend"] + (["jit-nocache"] if name in CACHED else [])
        for path in paths:
            marks = [] if (name, path) in FAST else [pytest.mark.slow]
            if (name, path) in KNOWN_FAILURES:
                reason, error = KNOWN_FAILURES[name, path]
                marks.append(pytest.mark.xfail(strict=True, raises=error, reason=reason))
            yield pytest.param(name, path, marks=marks, id=f"{name}-{path}")


pytestmark = pytest.mark.usefixtures("quiet_transformers")


@pytest.mark.parametrize("name,path", list(_rows()))
def test_family_matches_eager(name, path):
    if path == "jit-nocache":
        check_family(name, "jit", config={"use_cache": False})
    else:
        check_family(name, path)


def test_matrix_covers_the_issue_families():
    # the families issue 42 names; a family dropped from the table would silently leave the matrix
    assert set(FAMILIES) >= {"gpt2", "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "gemma2",
                             "gemma3", "phi3", "falcon", "gpt_neox", "opt", "bloom", "bert", "roberta",
                             "deberta_v2", "t5", "bart", "whisper", "vit", "clip", "convnext", "mamba"}
    assert CACHED <= set(FAMILIES)


# ---- ops the matrix found recorded as opaque torch calls ----
# transformers calls torch.diff (packed-sequence detection in every decoder's mask) and torch.histc (tokens per
# expert in the MoE layers); each was an opaque call, whose metadata costs a fake-tensor run and which no fusion
# can take. Custom ops and autograd.Functions stay opaque by design (the custom_op executor, PyTorch's autograd).
_OPAQUE_BY_DESIGN = {"grouped_mm_fallback.default", "GeLUFunction.apply"}


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_family_traces_have_no_opaque_torch_ops(name):
    import torch

    import fulmen
    from fulmen.core.symbol import OpTags

    family = FAMILIES[name]
    model = family.build(use_cache=False)
    jitted = fulmen.jit(model, executors=["torch"])
    with torch.no_grad():
        jitted(**family.inputs(model.config))
    opaque = {b.sym.name for b in fulmen.last_traces(jitted)[0].bound_symbols if OpTags.FALLBACK in b.sym.tags}
    assert opaque <= _OPAQUE_BY_DESIGN, f"{name}: run opaquely by PyTorch: {sorted(opaque - _OPAQUE_BY_DESIGN)}"


def _diff_cases():
    import torch

    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    yield from ((lambda t, n=n, d=d: torch.diff(t, n=n, dim=d), x) for n in (0, 2, 6) for d in (0, -1))
    yield lambda t: torch.diff(t, prepend=t[:, :2], append=t[:, :1]), x
    yield lambda t: torch.diff(t, dim=0, prepend=t[:1].double()), x  # cat promotes to float64
    yield lambda t: (t * 10).int().diff(), x
    yield lambda t: torch.diff(t > 0), x  # bool: logical_xor of neighbours


def _histc_cases():
    import torch

    gen = torch.Generator().manual_seed(0)
    edges = torch.tensor([0.0, 1, 2, 3, 3, 4, 5, -1, float("nan"), 2.9999999, 0.75, 1.5])
    yield lambda t: torch.histc(t, bins=4, min=0, max=3), edges  # max in the last bin; outside and NaN dropped
    yield lambda t: torch.histc(t, bins=4, min=0, max=3), edges.double()
    # elements on and next to every bin edge: the bin must be the one the kernel's division picks
    yield lambda t: torch.histc(t, bins=10, min=0.1, max=0.7), torch.linspace(0, 1, 10001)
    yield lambda t: t.histc(bins=7, min=-1.3, max=2.1), torch.randn(2, 500, generator=gen)
    yield lambda t: torch.histc(t, bins=5), torch.randn(100, generator=gen)  # range from the data: opaque call
    yield lambda t: torch.histc(t.float(), bins=4, min=0, max=3), torch.randint(0, 4, (6, 2), generator=gen)


@pytest.mark.parametrize("case", range(10))
def test_diff_matches_eager(case):
    import torch

    import fulmen
    from fulmen.testing import run_decomposed

    fn, x = list(_diff_cases())[case]
    expected = fn(x)
    for actual in (fulmen.jit(fn)(x), run_decomposed(fn, x)):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)  # differences of the same elements: exact
    if x.dtype.is_floating_point and expected.dtype.is_floating_point:
        leaf = x.clone().requires_grad_()
        grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=expected.dtype)
        (want,) = torch.autograd.grad(fn(leaf), leaf, grad)
        (got,) = torch.autograd.grad(fulmen.jit(fn)(leaf), leaf, grad)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", range(6))
def test_histc_matches_eager(case):
    import torch

    import fulmen
    from fulmen.testing import run_decomposed

    fn, x = list(_histc_cases())[case]
    expected = fn(x)
    for actual in (fulmen.jit(fn)(x), run_decomposed(fn, x)):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)  # counts are exact


def test_diff_and_histc_errors_match_eager():
    import torch

    import fulmen

    x = torch.randn(3, 5)
    for bad in (lambda t: torch.diff(t, n=-1), lambda t: torch.diff(t.sum()), lambda t: torch.diff(t, prepend=t[0]),
                lambda t: torch.diff(t, prepend=t[:2, :1])):
        with pytest.raises(RuntimeError) as eager:
            bad(x)
        with pytest.raises(RuntimeError, match=eager.value.args[0].replace("(", r"\(").replace(")", r"\)")):
            fulmen.jit(bad)(x)
