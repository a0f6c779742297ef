"""attnkit.functional.attention on every backend against the float64 oracle (tests/helpers/oracle.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnkit import attention
from attnkit.backends import BACKENDS
from attnkit.functional import which_backend
from helpers.devices import CUDA, expected_products, forced_path
from helpers.oracle import naive_attention

# (b, h, h_kv, t, s, d)
SHAPES = {
    "mha": (2, 4, 4, 5, 5, 16),
    "gqa t<s d=40": (1, 4, 2, 7, 11, 40),
    "mqa t>s d=59": (2, 3, 1, 11, 6, 59),
    "t=1": (1, 2, 2, 1, 9, 8),
    "odd lengths": (1, 2, 1, 67, 130, 32),  # do not divide any block size
}
MASK_KINDS = ["none", "key_mask", "bool", "float"]
# The backends that take any shape, with gradients, on any device; the decode kernel (a few queries
# over a cache, no gradients, CPU only), the flex backend (torch's compiled FlexAttention, CUDA
# only) and the sparse backend (calls with indices only) have their own tests in
# tests/backends/test_decode.py, test_torch_flex.py, test_sparse.py and tests/sparse/.
GENERAL = ["reference", "sdpa", "tiled"]
OWN_TESTS = ["decode", "flex", "sparse"]
assert {*GENERAL, *OWN_TESTS} == set(BACKENDS), "a new backend: add it to GENERAL or give it tests"
# The tiled backend runs its C++ kernel where the block products are float32 on a CPU, and its
# PyTorch loop elsewhere; "tiled:loop" forces the loop on the same inputs, so both paths are checked.
PATHS = [*GENERAL, "tiled:loop"]
# On CUDA the tiled backend always runs its loop ("tiled" and "tiled:loop" are one path there); the
# many-case tests check SDPA and that loop there (the reference backend, plain float64 operations,
# runs on CUDA in the smaller tests below and in tests/test_gradients.py).
FUSED = ["sdpa", "tiled"]


def on_devices(values, cuda):
    """``(value, device)`` parameters: every value on the CPU, those in ``cuda`` on CUDA too."""
    return [
        *(pytest.param(v, torch.device("cpu"), id=f"{v}-cpu") for v in values),
        *(pytest.param(v, torch.device("cuda"), id=f"{v}-cuda", marks=CUDA.marks) for v in cuda),
    ]


def make_inputs(shape, dtype=torch.float32, mask_kind="none", requires_grad=True, device="cpu"):
    b, h, h_kv, t, s, d = shape
    q = torch.randn(b, h, t, d, dtype=dtype, device=device)
    k = torch.randn(b, h_kv, s, d, dtype=dtype, device=device)
    v = torch.randn(b, h_kv, s, d, dtype=dtype, device=device)
    for x in (q, k, v):
        x.requires_grad_(requires_grad)
    masks = {}
    if mask_kind == "key_mask":
        key_mask = torch.rand(b, s, device=device) > 0.3
        key_mask[0, -1] = True
        if b > 1:
            key_mask[-1] = False  # a whole batch row of padding: every query of it is empty
        masks["key_mask"] = key_mask
    elif mask_kind == "bool":
        attn_mask = torch.rand(b, 1, t, s, device=device) > 0.4
        attn_mask[..., 0, :] = False  # query 0 sees nothing
        masks["attn_mask"] = attn_mask
    elif mask_kind == "float":
        attn_mask = torch.randn(1, h, t, s, dtype=dtype, device=device)
        attn_mask[..., -1, :] = float("-inf")  # the last query sees nothing
        attn_mask[..., :, 0] = float("-inf")
        masks["attn_mask"] = attn_mask
    return q, k, v, masks


def oracle64(q, k, v, masks, **options):
    """The oracle in float64 on the same values, with gradients."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    masks64 = {n: m if m.dtype == torch.bool else m.double() for n, m in masks.items()}
    out, lse, weights = naive_attention(q64, k64, v64, **masks64, **options)
    return (q64, k64, v64), out, lse, weights


def grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


def max_error(x, ref):
    return (x.double() - ref).abs().max().item()


def on(device, options):
    """``options`` with their tensors on ``device``."""
    return {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in options.items()}


@pytest.mark.parametrize(("backend", "device"), on_devices(PATHS, FUSED), indirect=["backend"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
def test_fp32_outputs_and_gradients_match_float64_oracle(backend, device, shape, causal, mask_kind):
    q, k, v, masks = make_inputs(shape, mask_kind=mask_kind, device=device)
    full = "return_lse" in BACKENDS[backend].supports
    result = attention(
        q, k, v, **masks, causal=causal, backend=backend, return_lse=full, return_weights=full
    )
    out = result[0] if full else result
    inputs64, out64, lse64, weights64 = oracle64(q, k, v, masks, causal=causal)

    torch.testing.assert_close(out, out64.float())
    if full:
        torch.testing.assert_close(result[1], lse64.float())
        torch.testing.assert_close(result[2], weights64.float())
    dout = torch.randn_like(out)
    for g, g64 in zip(grads(out, (q, k, v), dout), grads(out64, inputs64, dout.double())):
        torch.testing.assert_close(g, g64.float())


MODIFIERS = {
    "window": {"window": (3, 2)},
    "left window": {"window": (4, -1)},
    "alibi": {"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])},
    "softcap": {"softcap": 2.5, "scale": 1.0},
    "everything": {"window": (5, 1), "softcap": 3.0, "alibi_slopes": torch.tensor([0.3] * 4)},
}


@pytest.mark.parametrize(("backend", "device"), on_devices(PATHS, FUSED), indirect=["backend"])
@pytest.mark.parametrize("name", MODIFIERS)
@pytest.mark.parametrize("causal", [False, True])
def test_score_modifiers_match_oracle(backend, device, name, causal):
    options = on(device, MODIFIERS[name])
    shape = (2, 4, 2, 9, 13, 16)
    q, k, v, masks = make_inputs(shape, mask_kind="key_mask", device=device)
    if not {k for k in options if k != "scale"} <= BACKENDS[backend].supports:
        with pytest.raises(ValueError, match=f"backend '{backend}' does not support softcap"):
            attention(q, k, v, **masks, causal=causal, backend=backend, **options)
        return
    out = attention(q, k, v, **masks, causal=causal, backend=backend, **options)
    inputs64, out64, _, _ = oracle64(q, k, v, masks, causal=causal, **options)
    torch.testing.assert_close(out, out64.float())
    dout = torch.randn_like(out)
    for g, g64 in zip(grads(out, (q, k, v), dout), grads(out64, inputs64, dout.double())):
        torch.testing.assert_close(g, g64.float())


HALF_PATHS = ["tiled:half", "tiled:half-loop", "tiled:portable"]


@pytest.mark.parametrize(
    ("backend", "device"), on_devices([*PATHS, *HALF_PATHS], GENERAL), indirect=["backend"]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_within_twice_the_naive_error(backend, device, dtype, causal):
    """On CUDA every path multiplies half precision in half precision, as the naive path does."""
    shape = (2, 4, 2, 33, 47, 40)
    q, k, v, masks = make_inputs(shape, dtype=dtype, mask_kind="key_mask", device=device)
    out = attention(q, k, v, **masks, causal=causal, backend=backend)
    inputs64, out64, _, _ = oracle64(q, k, v, masks, causal=causal)
    naive_inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    naive_out, _, _ = naive_attention(*naive_inputs, **masks, causal=causal)

    assert out.dtype == dtype
    assert max_error(out, out64) <= 2 * max_error(naive_out, out64) + 1e-6
    dout = torch.randn_like(out)
    exact = grads(out64, inputs64, dout.double())
    for g, g_naive, g64 in zip(
        grads(out, (q, k, v), dout), grads(naive_out, naive_inputs, dout), exact
    ):
        assert max_error(g, g64) <= 3 * max_error(g_naive, g64) + 1e-6


# The half-precision products (in the C++ kernel, bf16 blocks multiplied in pairs with float32
# sums: tiled:half with AVX512-BF16 where the build has it, tiled:portable on every CPU) on every
# shape, mask kind and modifier, forward and backward, within the rule for low precision.
HALF_CASES = {
    **{
        f"{name} {kind}": (shape, kind, {}) for name, shape in SHAPES.items() for kind in MASK_KINDS
    },
    **{name: (SHAPES["gqa t<s d=40"], "key_mask", opts) for name, opts in MODIFIERS.items()},
}


def check_half_products(path, q, k, v, masks, **options):
    """The output and the gradients (of q, k, v, and of the slopes if they are learnable) of the
    forced half-precision ``path``, within twice (three times) the naive bf16 path's error."""
    masks = {n: m if m.dtype == torch.bool else m.bfloat16() for n, m in masks.items()}
    choice = which_backend(q, k, v, **masks, backend="tiled", **options)
    assert (choice.path, choice.products) == expected_products(path)
    slopes = options.get("alibi_slopes")
    learnable = slopes is not None and slopes.requires_grad

    def run(fn, dtype, slopes_dtype, call_masks):
        leaves = [x.detach().to(dtype, copy=True).requires_grad_() for x in (q, k, v)]
        call_options = dict(options)
        if learnable:
            call_options["alibi_slopes"] = slopes.detach().to(slopes_dtype, copy=True)
            leaves.append(call_options["alibi_slopes"].requires_grad_())
        return fn(*leaves[:3], **call_masks, **call_options), leaves

    def naive(*args, **kwargs):
        return naive_attention(*args, **kwargs)[0]

    def tiled_call(*args, **kwargs):
        return attention(*args, backend="tiled", **kwargs)

    masks64 = {n: m if m.dtype == torch.bool else m.double() for n, m in masks.items()}
    out, leaves = run(tiled_call, torch.bfloat16, torch.float32, masks)
    naive_out, naive_leaves = run(naive, torch.bfloat16, torch.float32, masks)
    out64, leaves64 = run(naive, torch.float64, torch.float64, masks64)
    assert out.dtype == torch.bfloat16
    assert max_error(out, out64) <= 2 * max_error(naive_out, out64) + 1e-6
    dout = torch.randn_like(out)
    for g, g_naive, g64 in zip(
        grads(out, leaves, dout),
        grads(naive_out, naive_leaves, dout),
        grads(out64, leaves64, dout.double()),
    ):
        assert max_error(g, g64) <= 3 * max_error(g_naive, g64) + 1e-6
    return out


@pytest.mark.parametrize("path", ["tiled:half", "tiled:portable"])
@pytest.mark.parametrize("case", HALF_CASES.values(), ids=HALF_CASES.keys())
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_block_products_within_the_low_precision_rule(path, case, causal, forcing):
    shape, mask_kind, options = case
    forcing(path)
    q, k, v, masks = make_inputs(shape, dtype=torch.bfloat16, mask_kind=mask_kind)
    check_half_products(path, q, k, v, masks, causal=causal, **options)


@pytest.mark.parametrize("path", ["tiled:half", "tiled:portable"])
@pytest.mark.parametrize("blocks", [(19, 45), (256, 512)])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"causal": True},
        {"window": (37, 5)},  # key blocks that start at odd keys
        {"causal": True, "softcap": 3.0, "alibi_slopes": "learnable"},
    ],
    ids=["full", "causal", "window", "alibi+softcap"],
)
def test_bf16_block_products_at_the_kernels_own_block_sizes(
    path, blocks, options, monkeypatch, forcing, tiled_blocks
):
    """Blocks of 8+ rows and of several 32-column tiles, rows of 16+ keys: the microkernel's main
    tile and the 16-lane loops, which the tests' tiny tiles never reach."""
    forcing(path)
    tiled_blocks(blocks[0], blocks[1])
    q, k, v, masks = make_inputs(
        (1, 4, 2, 150, 333, 64), dtype=torch.bfloat16, mask_kind="key_mask"
    )
    if options.get("alibi_slopes") == "learnable":
        options = {**options, "alibi_slopes": torch.tensor([0.5, 0.25, 0.1, 0.05]).requires_grad_()}
    out = check_half_products(path, q, k, v, masks, **options)
    # padding that holds NaN and infinities gives the same results, bit for bit, as zeros there
    padding = ~masks["key_mask"]
    dirty = [x.detach().clone() for x in (k, v)]
    dirty[0][padding[:, None].expand_as(dirty[0][..., 0])] = float("nan")
    dirty[1][padding[:, None].expand_as(dirty[1][..., 0])] = float("inf")
    clean = [x.detach().masked_fill(padding[:, None, :, None], 0.0) for x in (k, v)]
    for kv in (dirty, clean):
        kv[0].requires_grad_()
    results = []
    for kk, vv in (dirty, clean):
        qq = q.detach().clone().requires_grad_()
        o = attention(qq, kk, vv, **masks, backend="tiled", **options)
        results.append((o, *torch.autograd.grad(o.float().sum(), (qq, kk))))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(("backend", "device"), on_devices(PATHS, GENERAL), indirect=["backend"])
def test_huge_scores_stay_finite_and_exact(backend, device):
    q = torch.randn(1, 2, 8, 16, device=device) * 100.0  # scores of magnitude ~1e4
    k = torch.randn(1, 2, 8, 16, device=device) * 100.0
    v = torch.randn(1, 2, 8, 16, device=device)
    out = attention(q, k, v, scale=1.0, backend=backend)
    _, out64, _, _ = oracle64(q, k, v, {}, scale=1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, out64.float(), atol=1e-4, rtol=0)


@pytest.mark.parametrize(("backend", "device"), on_devices(PATHS, GENERAL), indirect=["backend"])
def test_fully_masked_rows_give_zeros_and_zero_gradients(backend, device):
    q, k, v, _ = make_inputs((2, 2, 2, 4, 6, 8), device=device)
    key_mask = torch.zeros(2, 6, dtype=torch.bool, device=device)
    key_mask[0, :3] = True  # batch row 1 has no real token at all
    out = attention(q, k, v, key_mask=key_mask, causal=True, backend=backend)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    # causal with t < s: query 0 sits at position 2, so it sees keys 0..2 of row 0
    assert out[0].abs().sum() > 0
    gq, gk, gv = grads(out, (q, k, v), torch.ones_like(out))
    for g in (gq, gk, gv):
        assert torch.isfinite(g).all()
        assert torch.equal(g[1], torch.zeros_like(g[1]))


def test_causal_with_more_queries_than_keys_empties_the_first_rows(device):
    q, k, v, _ = make_inputs((1, 1, 1, 5, 3, 4), requires_grad=False, device=device)
    out, lse, weights = attention(q, k, v, causal=True, return_lse=True, return_weights=True)
    # p(i) = i + s - t = i - 2: queries 0 and 1 see no key
    assert torch.equal(out[..., :2, :], torch.zeros(1, 1, 2, 4, device=device))
    assert torch.isneginf(lse[..., :2]).all() and torch.isfinite(lse[..., 2:]).all()
    # Query 2 sees key 0 alone: weight 1 up to the last bit of its score. The weights are
    # recomputed from the lse by other matrix products than the kernel's, whose roundings differ
    # on some CPUs (the products' code paths are the CPU's), so that bit may differ.
    one = torch.tensor(1.0, device=device)
    torch.testing.assert_close(weights[0, 0, 2, 0], one, rtol=0, atol=2**-22)
    assert torch.equal(weights[0, 0, 2, 1:], torch.zeros(2, device=device))


@pytest.mark.parametrize("backend", GENERAL)
def test_gradcheck_in_float64(backend, device):
    q, k, v, _masks = make_inputs(
        (1, 2, 1, 3, 4, 3), dtype=torch.float64, mask_kind="key_mask", device=device
    )
    mask = torch.tensor([[True, False, True, True]], device=device)

    def f(q, k, v):
        return attention(q, k, v, key_mask=mask, causal=True, backend=backend)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_float64_is_computed_in_float64(device):
    q, k, v, _ = make_inputs(
        (1, 2, 2, 5, 5, 8), dtype=torch.float64, requires_grad=False, device=device
    )
    out, lse = attention(q, k, v, return_lse=True)
    _, out64, _lse64, _ = oracle64(q, k, v, {})
    assert out.dtype == lse.dtype == torch.float64
    torch.testing.assert_close(out, out64, rtol=1e-12, atol=1e-12)


DEVICE_IS_A_CONSTANT = settings(
    suppress_health_check=[
        *settings.default.suppress_health_check,
        HealthCheck.function_scoped_fixture,
    ]
)
"""For a property test that takes ``device``: a function-scoped fixture, but one value that no
example changes."""


def cases(max_len: int, dims: list[int], max_window: int) -> dict:
    """Hypothesis strategies for one call: shapes, GQA groups, every option and mask kind."""
    return {
        "b": st.integers(1, 2),
        "h_kv": st.integers(1, 2),
        "groups": st.integers(1, 3),
        "t": st.integers(1, max_len),
        "s": st.integers(1, max_len),
        "d": st.sampled_from(dims),
        "causal": st.booleans(),
        "window": st.none() | st.tuples(*[st.integers(-1, max_window)] * 2),
        "softcap": st.none() | st.floats(0.5, 5.0),
        "alibi": st.booleans(),
        "mask_kind": st.sampled_from(MASK_KINDS),
    }


@given(**cases(max_len=12, dims=[1, 3, 8], max_window=4))
@DEVICE_IS_A_CONSTANT
def test_property_every_capable_backend_matches_oracle_in_float64(
    device, b, h_kv, groups, t, s, d, causal, window, softcap, alibi, mask_kind
):
    h = h_kv * groups
    q, k, v, masks = make_inputs((b, h, h_kv, t, s, d), torch.float64, mask_kind, device=device)
    options = {"causal": causal, "window": window, "softcap": softcap}
    if alibi:
        options["alibi_slopes"] = torch.rand(h, dtype=torch.float64, device=device)
    inputs64, out64, lse64, weights64 = oracle64(q, k, v, masks, **options)
    dout = torch.randn_like(out64)
    expected = grads(out64, inputs64, dout)
    used = {name for name, value in options.items() if value is not None and value is not False}
    used |= set(masks)
    for name in GENERAL:
        backend = BACKENDS[name]
        if not used <= backend.supports:
            continue
        full = {"return_lse", "return_weights"} <= backend.supports
        result = attention(
            q, k, v, **masks, **options, backend=name, return_lse=full, return_weights=full
        )
        out = result[0] if full else result
        torch.testing.assert_close(out, out64)
        if full:
            torch.testing.assert_close(result[1], lse64)
            torch.testing.assert_close(result[2], weights64)
        for g, g64 in zip(grads(out, (q, k, v), dout), expected):
            torch.testing.assert_close(g, g64)


@given(**cases(max_len=20, dims=[1, 8, 40], max_window=9))
def test_property_both_tiled_paths_match_oracle_in_float32(
    b, h_kv, groups, t, s, d, causal, window, softcap, alibi, mask_kind
):
    """The C++ kernel and the PyTorch loop run on float32 products only: this is their property test
    (lengths up to 20 span several of the tests' 5 x 7 blocks)."""
    h = h_kv * groups
    q, k, v, masks = make_inputs((b, h, h_kv, t, s, d), torch.float32, mask_kind)
    options = {"causal": causal, "window": window, "softcap": softcap}
    if alibi:
        options["alibi_slopes"] = torch.rand(h)
    inputs64, out64, lse64, weights64 = oracle64(q, k, v, masks, **options)
    dout = torch.randn_like(out64)
    expected = grads(out64, inputs64, dout)
    for path in ("tiled", "tiled:loop"):
        with forced_path(path):
            ran = which_backend(q, k, v, **masks, **options, backend="tiled").path
            out, lse, weights = attention(
                q, k, v, **masks, **options, backend="tiled", return_lse=True, return_weights=True
            )
            computed = grads(out, (q, k, v), dout.float())
        assert ran == ("loop" if path == "tiled:loop" else "native")
        torch.testing.assert_close(out, out64.float())
        torch.testing.assert_close(lse, lse64.float())
        torch.testing.assert_close(weights, weights64.float())
        for g, g64 in zip(computed, expected):
            torch.testing.assert_close(g, g64.float())


@pytest.mark.parametrize(("backend", "device"), on_devices(PATHS, GENERAL), indirect=["backend"])
def test_non_contiguous_inputs_as_modules_produce_them(backend, device):
    """Modules hand over (b, t, h, d).transpose(1, 2): strided, not contiguous."""
    b, h, h_kv, t, s, d = 2, 4, 2, 9, 13, 8
    q = torch.randn(b, t, h, d, device=device).transpose(1, 2).requires_grad_()
    k = torch.randn(b, s, h_kv, d, device=device).transpose(1, 2).requires_grad_()
    v = torch.randn(b, s, h_kv, d, device=device).transpose(1, 2).requires_grad_()
    out = attention(q, k, v, causal=True, backend=backend)
    inputs64, out64, _, _ = oracle64(q, k, v, {}, causal=True)
    torch.testing.assert_close(out, out64.float())
    dout = torch.randn_like(out)
    for g, g64 in zip(grads(out, (q, k, v), dout), grads(out64, inputs64, dout.double())):
        torch.testing.assert_close(g, g64.float())


@pytest.mark.parametrize("t, s", [(3, 0), (0, 5), (0, 0)])
def test_no_key_or_no_query_follows_the_rule_no_key_gives_zero(t, s, device):
    """As torch's SDPA with no key on a CPU: output 0 (lse -inf), and gradients, all zeros, reach
    q, k, v (on every device)."""
    q = torch.randn(2, 4, t, 8, requires_grad=True, device=device)
    k, v = (torch.randn(2, 2, s, 8, requires_grad=True, device=device) for _ in "kv")
    out, lse, weights = attention(q, k, v, causal=True, return_lse=True, return_weights=True)
    assert out.shape == (2, 4, t, 8) and weights.shape == (2, 4, t, s)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
    out.sum().backward()
    for x in (q, k, v):
        assert x.grad is not None and torch.equal(x.grad, torch.zeros_like(x))
    if s == 0 and t > 0 and device.type == "cpu":  # what torch's CUDA kernels give is theirs
        torch_out = torch.nn.functional.scaled_dot_product_attention(
            q.detach(), k.detach().repeat_interleave(2, 1), v.detach().repeat_interleave(2, 1)
        )
        torch.testing.assert_close(out.detach(), torch_out)


def test_a_score_mod_that_returns_a_constant_gives_uniform_weights_on_every_backend(
    forcing, device
):
    q = torch.randn(1, 2, 40, 8, device=device)

    def constant(s, b, h, i, j):
        return torch.tensor(1.0, device=device)

    for path in ("tiled", "tiled:loop", "reference"):
        x = q.clone().requires_grad_()
        with forced_path(path) as backend:
            out = attention(x, x, x, score_mod=constant, backend=backend)
            out.sum().backward()
        torch.testing.assert_close(out, q.mean(2, keepdim=True).expand_as(q))
        assert torch.isfinite(x.grad).all()
