"""Fused regions whose input sizes grow from call to call (a key/value cache during decoding) compile a bounded
number of Inductor kernels: one kernel with the varying sizes symbolic serves every later length
(``fulmen.executors.inductor_dynamic``), and each result is eager's."""

import pytest
import torch

import fulmen
from fulmen.executors import inductor_compile
from fulmen.executors.inductor_decomps import decomposition_table
from fulmen.executors.inductor_dynamic import varying_dims
from fulmen.executors.inductor_graph import aten_graph, symbolic_aten_graph


def _attention_step(q, k, v):
    s = (q @ k.transpose(-1, -2)) * 0.25
    return torch.softmax(s, -1) @ v + q


def _regions(jf):
    return [b.sym.impl for b in fulmen.last_traces(jf)[-1].bound_symbols if b.sym.is_fusion]


def test_a_growing_cache_compiles_a_bounded_number_of_kernels():
    torch.manual_seed(0)
    jf = fulmen.jit(_attention_step, executors=["inductor"], compile="sync")
    q = torch.randn(1, 2, 1, 16)
    before = len(inductor_compile._kernels)
    lengths = range(5, 17)
    for n in lengths:
        k, v = torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
        torch.testing.assert_close(jf(q, k, v), _attention_step(q, k, v))
    compiled = len(inductor_compile._kernels) - before
    # the first length, the second (a program traced with the length symbolic), then one symbolic kernel
    assert compiled <= 3, f"{compiled} kernels for {len(lengths)} cache lengths"
    (region,) = _regions(jf)
    assert region.dynamic is not None and region.dynamic.fn is not None, "no kernel with symbolic sizes"
    assert sorted(d for _, d in region.dynamic.dims) == [2, 2], "the keys' and values' length, nothing else"
    last = (torch.Size([1, 2, 1, 16]), torch.Size([1, 2, 16, 16]))
    ran = [fn for key, fn in region.variants.items() if {s for s, _ in key} >= set(last)]
    assert ran == [region.dynamic.fn], "the last length should run on the symbolic kernel"


def _attention_then_projection(q, k, v, w):
    """A decoder layer's attention of one new token over its cache, then the output projection, as the graph
    Dynamo hands the backend for a Hugging Face Llama writes it."""
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.25, enable_gqa=True)
    out = out.reshape(q.shape[0], -1, 1, q.shape[-1]).transpose(1, 2).contiguous()
    return torch.nn.functional.linear(out.reshape(q.shape[0], 1, -1), w)


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic-cache-length"])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_decode_steps_output_projection_is_one_mm_in_the_region_graph(batch, symbolic):
    """Eager folds ``[B, 1, 64] @ W.t()`` into one ``mm``, and so does torch.compile's graph. The region's graph did
    only if matmul's C++ fold check passed on fake tensors, whose view of attention's output has another stride in
    its size-1 dim than the real one: it became a ``bmm`` over an expanded weight, which Inductor lowers into a
    C++ reduction loop."""
    torch.manual_seed(0)
    query = torch.randn(batch, 1, 4, 16).transpose(1, 2)  # heads split off a projection, as a decoder makes it
    example = [query, torch.randn(batch, 2, 9, 16), torch.randn(batch, 2, 9, 16), torch.randn(64, 64)]
    if symbolic:
        gm, _, _ = symbolic_aten_graph(
            _attention_then_projection, example, decomposition_table(), frozenset({(1, 2), (2, 2)})
        )
    else:
        gm = aten_graph(_attention_then_projection, example, decomposition_table())
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.mm.default in ops and torch.ops.aten.bmm.default not in ops, ops
    torch.testing.assert_close(gm(*example), _attention_then_projection(*example))


def test_the_symbolic_kernel_runs_only_layouts_it_was_compiled_for():
    """A cache of length 1 (sizes 0 and 1 are specialized) and a transposed cache (other strides) do not fit the
    symbolic kernel: they run otherwise, and still give eager's results."""
    torch.manual_seed(0)
    jf = fulmen.jit(_attention_step, executors=["inductor"], compile="sync")
    q = torch.randn(1, 2, 1, 16)
    for n in (5, 6, 7):
        k, v = torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
        torch.testing.assert_close(jf(q, k, v), _attention_step(q, k, v))
    (region,) = _regions(jf)
    check = region.dynamic.check
    args = {"k": torch.randn(1, 2, 9, 16), "q": q, "v": torch.randn(1, 2, 9, 16)}
    order = _input_names(jf)
    assert check.fits([args[name] for name in order])
    strided = {**args, "k": torch.randn(1, 2, 16, 9).transpose(-1, -2)}
    assert not check.fits([strided[name] for name in order]), "a transposed cache has other strides"
    short = {**args, "k": torch.randn(1, 2, 1, 16), "v": torch.randn(1, 2, 1, 16)}
    assert not check.fits([short[name] for name in order]), "length 1 is not a symbol's value"
    for case in (strided, short):
        torch.testing.assert_close(
            jf(case["q"], case["k"], case["v"]), _attention_step(case["q"], case["k"], case["v"])
        )


def _input_names(jf) -> list[str]:
    """The region's inputs (the jitted function's parameters) in the order the region takes them."""
    (bsym,) = [b for b in fulmen.last_traces(jf)[-1].bound_symbols if b.sym.is_fusion]
    return [a.name for a in bsym.args]


@pytest.mark.parametrize(
    ("old", "new", "dims"),
    [
        (((torch.Size([1, 5]), (5, 1)),), ((torch.Size([1, 6]), (6, 1)),), {(0, 1)}),
        (((torch.Size([1, 5]), (5, 1)),), ((torch.Size([1, 5, 1]), (5, 1, 1)),), None),
        (((torch.Size([2, 5]), (5, 1)),), ((torch.Size([2, 5]), (1, 2)),), set()),
    ],
)
def test_varying_dims(old, new, dims):
    got = varying_dims(old, new)
    assert (got if got is None else set(got)) == dims


@pytest.mark.slow
@pytest.mark.usefixtures("quiet_transformers")
def test_llama_generate_compiles_a_bounded_number_of_region_kernels():
    """A tiny Llama's greedy ``generate()`` under ``fulmen.jit(compile="sync")``: eager's tokens, and the regions
    that read the growing cache run every later length on their symbolic kernel (not one kernel per length)."""
    from fulmen.bench.hf import hf_model

    model = hf_model("hf:llama", max_position_embeddings=48).eval()
    model.config.use_cache = model.generation_config.use_cache = True
    ids = torch.randint(2, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    jm = fulmen.jit(model, compile="sync")
    before = len(inductor_compile._kernels)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=24, min_new_tokens=24, **kwargs)
        got = jm.generate(ids, max_new_tokens=24, min_new_tokens=24, **kwargs)
    assert torch.equal(got, expected)
    kernels = list(inductor_compile._kernels.values())[before:]
    assert any(k.dims and k.fn is not None for k in kernels), "no region compiled a kernel with symbolic sizes"
    assert len(kernels) <= 12, f"{len(kernels)} region kernels for 24 new tokens"


def _masked_step(q, k, v, m):
    s = (q @ k.transpose(-1, -2)) * 0.25 + m
    return torch.softmax(s, -1) @ v + q


def _growing(n: int) -> dict:
    return {
        "q": torch.randn(1, 2, 1, 16),
        "k": torch.randn(1, 2, n, 16),
        "v": torch.randn(1, 2, n, 16),
        "m": torch.zeros(1, 1, 1, n),
    }


@pytest.fixture(scope="module")
def masked_region():
    """A jitted attention step with a mask whose region has compiled its kernel with the length symbolic."""
    torch.manual_seed(0)
    jf = fulmen.jit(_masked_step, executors=["inductor"], compile="sync")
    with torch.no_grad():
        for n in (5, 6, 7):
            jf(**_growing(n))
    (region,) = _regions(jf)
    assert region.dynamic is not None and region.dynamic.fn is not None
    return jf, region, _input_names(jf)


def _old_fits(check, args) -> bool:
    """The symbolic kernel's check as it was written over tensors, before it read the layout key: the decision
    the key-based check must reproduce exactly."""
    if any(args[i].shape[d] != size for i, d, size in check.static):
        return False
    if any(args[i].shape[d] != args[j].shape[e] for i, d, j, e in check.same):
        return False
    values = [args[i].shape[d] for i, d in check.order]
    if any(v < 2 for v in values):
        return False
    for a, want in zip(args, check._strides(*values)):
        if any(w != h and a.shape[k] != 1 for k, (w, h) in enumerate(zip(want, a.stride()))):
            return False
    return bool(check._guards(*values))


def _layouts() -> dict[str, dict]:
    base = _growing(9)
    return {
        "longer cache": base,
        "much longer cache": _growing(40),
        "length 1": _growing(1),
        "transposed keys": {**base, "k": torch.randn(1, 2, 16, 9).transpose(-1, -2)},
        "keys longer than values": {**base, "k": torch.randn(1, 2, 10, 16)},
        "mask of another length": {**base, "m": torch.zeros(1, 1, 1, 10)},
        "another head size": {
            **base,
            "q": torch.randn(1, 2, 1, 8),
            "k": torch.randn(1, 2, 9, 8),
            "v": torch.randn(1, 2, 9, 8),
        },
        "another batch": _growing(9) | {"q": torch.randn(2, 2, 1, 16)},
        "a size-1 dim with another stride": {
            **base,
            "k": torch.randn(1, 2, 9, 16).as_strided((1, 2, 9, 16), (7, 144, 16, 1)),
        },
        "an expanded mask": {**base, "m": torch.zeros(1, 1, 1, 1).expand(1, 1, 1, 9)},
        "keys sliced from a longer cache": {**base, "k": torch.randn(1, 2, 12, 16)[:, :, :9]},
    }


@pytest.mark.parametrize("case", list(_layouts()))
def test_the_layout_key_check_selects_exactly_the_layouts_the_tensor_check_selected(masked_region, case):
    """The symbolic kernel's check reads the region's layout key (built by C accessors) instead of the tensors:
    every layout difference that sent a call elsewhere still does, and every layout it ran still runs on it."""
    from fulmen.executors.inductor_dynamic import layout_key

    jf, region, order = masked_region
    args = [_layouts()[case][name] for name in order]
    key = layout_key(args)
    assert key == tuple((a.shape, a.stride()) for a in args), "the key is the (shape, stride) of each input"
    check = region.dynamic.check
    assert check.fits_layout(key) == _old_fits(check, args)


def test_the_layout_key_check_accepts_the_lengths_it_did_and_refuses_the_rest(masked_region):
    _, region, order = masked_region
    fits = {case: region.dynamic.check.fits([layout[name] for name in order]) for case, layout in _layouts().items()}
    accepted = {"longer cache", "much longer cache", "a size-1 dim with another stride"}
    assert {case for case, ok in fits.items() if ok} == accepted


def _python_calls(call) -> list[str]:
    import sys

    calls = []

    def count(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_name)

    sys.setprofile(count)
    try:
        call()
    finally:
        sys.setprofile(None)
    return calls


def test_a_new_cache_length_costs_the_region_calls_independent_of_its_inputs(masked_region):
    """A region whose input sizes change every call (a decode step) misses its steady C++ check on each call. On a
    length it has not seen it builds the layout key and runs the symbolic kernel's check; on one it has (the next
    ``generate()``), it finds the kernel in its layout table. Either way in a fixed number of Python function calls
    however many inputs it has (none per input). Counted, not timed."""
    _, region, order = masked_region
    kernel = region.dynamic.fn
    for allowed, lengths in ((8, (50, 51, 52)), (2, (50, 51, 52))):  # new lengths, then the same ones again
        for n in lengths:
            layout = _growing(n)
            args = [layout[name] for name in order]
            got = []
            in_region = _python_calls(lambda: got.append(region(*args)))  # noqa: B023  (called at once)
            extra = len(in_region) - len(_python_calls(lambda: kernel(list(args))))  # noqa: B023
            assert region.variants[tuple((a.shape, a.stride()) for a in args)] is kernel
            assert extra <= allowed, f"{extra} Python calls around the kernel: {in_region}"
            out = got[0][0] if isinstance(got[0], (tuple, list)) else got[0]
            torch.testing.assert_close(out, _masked_step(**layout))


def _step_with_weight(q, k, w):
    s = (q @ k.transpose(-1, -2)) * 0.25
    return torch.softmax(s, -1).sum(-1, keepdim=True) * (q @ w)


@pytest.mark.slow
def test_regions_of_one_code_with_other_strides_of_a_constant_input_each_get_a_kernel_that_fits():
    """Two regions with the same code, one reading a weight as it is and one its transpose (a constant size beside
    a growing cache): the kernel with the length symbolic was shared by code, dtypes and sizes, so the second region
    ran the first's kernel, compiled for the other strides, on none of its calls, and compiled one kernel per length
    instead, up to MAX_VARIANTS, then ran unfused."""
    torch.manual_seed(0)
    q, w = torch.randn(1, 2, 1, 16), torch.randn(16, 16)
    before = len(inductor_compile._kernels)
    for weight in (w, w.t(), torch.randn(16, 32)[:, ::2]):
        jf = fulmen.jit(_step_with_weight, executors=["inductor"], compile="sync")
        for n in range(5, 15):
            k = torch.randn(1, 2, n, 16)
            torch.testing.assert_close(jf(q, k, weight), _step_with_weight(q, k, weight))
        (region,) = _regions(jf)
        assert len(region.kernels) == 1, f"{len(region.kernels)} kernels for one layout each"
        assert region.dynamic is not None and region.dynamic.fn is not None
    # per weight layout: the exact program's region, the symbolic program's at its first length, then its kernel with
    # the length symbolic
    assert len(inductor_compile._kernels) - before <= 9


def test_the_symbolic_kernels_key_tells_strides_of_constant_inputs_apart_and_not_lengths():
    from fulmen.executors.inductor_dynamic import layout_key, symbolic_layout

    def key(n, w):
        args = [torch.randn(1, 2, n, 16), w]
        return symbolic_layout(layout_key([torch.randn(1, 2, 5, 16), w]), layout_key(args), frozenset({(0, 2)}), args)

    w = torch.randn(16, 16)
    assert key(6, w) == key(9, w)
    assert key(6, w) != key(6, w.t()) != key(6, torch.randn(16, 32)[:, ::2])
    cache = torch.randn(1, 2, 40, 16)  # a cache sliced from a longer buffer: its strides do not change with it
    growing = symbolic_layout(
        layout_key([cache[:, :, :5]]), layout_key([cache[:, :, :9]]), frozenset({(0, 2)}), [cache[:, :, :9]]
    )
    assert growing[0][1] == (1280, 640, 16, 1)
