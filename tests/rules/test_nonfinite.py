"""One rule for NaN and infinity on every backend, defined by the selection oracle (tests/helpers/oracle.py):
a row takes only the keys it sees; a score made non-finite by the inputs is NaN, never a mask; a NaN
or +inf in a float mask or an ALiBi slope is a NaN score; a row with no key gives 0 whatever its
query; padding (key_mask False) never reaches a result, on any backend; keys hidden by causal or
window masks never reach a result in attnkit's own kernels (reference, tiled, decode)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnkit import attention, mods
from attnkit.backends import BACKENDS
from attnkit.functional import which_backend
from attnkit.kernels import finite
from helpers.devices import CUDA, expected_products, forced_path
from helpers.oracle import selected_attention

NAN, INF = float("nan"), float("inf")
# Every path a call can take: the tiled backend's C++ kernel and its PyTorch loop separately.
PATHS = ["reference", "sdpa", "sdpa:blind", "tiled", "tiled:loop", "decode"]
GENERAL = [
    "reference",
    "tiled",
    "tiled:loop",
    "sdpa",
    "sdpa:blind",
]  # every path with masks, modifiers
OWN_GENERAL = ["reference", "tiled", "tiled:loop"]  # attnkit's own kernels among them
HALF_PATHS = [
    "tiled:half",
    "tiled:portable",
]  # bf16 block products (see helpers.devices.forced_path)
# On CUDA: no decode kernel, and the tiled backend always runs its loop ("tiled" is "tiled:loop").
CUDA_GENERAL = ["reference", "tiled", "sdpa"]
CUDA_OWN = ["reference", "tiled"]


def on_devices(values, cuda):
    """``(value, device)`` parameters: every value on the CPU, those in ``cuda`` on CUDA too."""
    return [
        *(pytest.param(v, torch.device("cpu"), id=f"{v}-cpu") for v in values),
        *(pytest.param(v, torch.device("cuda"), id=f"{v}-cuda", marks=CUDA.marks) for v in cuda),
    ]


# The look at values that decides whether rows need the exact check: the C++ check where a build is
# at hand, or torch's passes as without one (CUDA tensors never reach the C++ check of CPU values).
VALUES_CHECKS = on_devices(["native", "torch"], ["torch"])


def run(path, q, k, v, monkeypatch, **options):
    """``attention`` on one path, with lse and weights where the backend returns them."""
    name = path.partition(":")[0]
    full = {"return_lse", "return_weights"} <= BACKENDS[name].supports
    with forced_path(path), torch.no_grad():
        result = attention(q, k, v, backend=name, return_lse=full, return_weights=full, **options)
    return result if full else (result, None, None)


def assert_same(got, expected):
    """The same finite/non-finite pattern, and the same values where finite (float32 tolerances)."""
    expected = expected.to(got.dtype)
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(got), finite), (got, expected)
    torch.testing.assert_close(got[finite], expected[finite])


def qkv(b=1, h=2, h_kv=1, t=4, s=6, d=8, device="cpu"):
    return (
        torch.randn(b, h, t, d, device=device),
        torch.randn(b, h_kv, s, d, device=device),
        torch.randn(b, h_kv, s, d, device=device),
    )


def check(path, q, k, v, monkeypatch, **options):
    out, lse, weights = run(path, q, k, v, monkeypatch, **options)
    out64, lse64, weights64 = selected_attention(q, k, v, **options)
    assert_same(out, out64)
    if lse is not None:
        assert_same(lse, lse64)
        assert_same(weights, weights64)
    return out


@pytest.mark.parametrize(("path", "device"), on_devices(PATHS, CUDA_GENERAL))
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_a_non_finite_query_makes_its_row_nan_not_zero(path, device, value, monkeypatch):
    q, k, v = qkv(t=1, device=device)
    q[0, 1, 0, 3] = value
    out = check(path, q, k, v, monkeypatch)
    assert torch.isnan(out[0, 1]).all() and torch.isfinite(out[0, 0]).all()


@pytest.mark.parametrize(("path", "device"), on_devices(PATHS, CUDA_GENERAL))
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_a_non_finite_key_reaches_every_row_that_sees_it(path, device, value, monkeypatch):
    q, k, v = qkv(t=1, device=device)
    k[0, 0, 2, 5] = value  # -inf too: a computed -inf score is NaN, never a mask
    out = check(path, q, k, v, monkeypatch)
    assert torch.isnan(out).all()


@pytest.mark.parametrize(("path", "device"), on_devices(PATHS, CUDA_GENERAL))
def test_a_non_finite_value_reaches_its_column_of_every_row_that_sees_it(path, device, monkeypatch):
    q, k, v = qkv(t=1, device=device)
    v[0, 0, 4, 2] = INF
    out = check(path, q, k, v, monkeypatch)
    assert (~torch.isfinite(out[..., 2])).all() and torch.isfinite(out[..., [0, 1, 3]]).all()


@pytest.mark.parametrize(("path", "device"), on_devices(PATHS, CUDA_GENERAL))
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_padding_is_inert_on_every_backend(path, device, value, monkeypatch):
    """Padding may hold anything (torch.empty): it never reaches a result, nor a gradient."""
    q, k, v = qkv(
        b=2, t=1, s=70, device=device
    )  # more than one of the decode kernel's 64-key blocks
    key_mask = torch.ones(2, 70, dtype=torch.bool, device=device)
    key_mask[0, [3, 65]] = False
    key_mask[1, :] = False  # a row of nothing but padding: zeros
    for x in (k, v):
        x[0, 0, [3, 65]] = value
        x[1] = value
    out = check(path, q, k, v, monkeypatch, key_mask=key_mask)
    assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros_like(out[1]))
    if path in ("decode", "tiled:loop"):
        return
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    with forced_path(path) as name:
        out = attention(*inputs, key_mask=key_mask, backend=name)
        grads = torch.autograd.grad(out.sum(), inputs)
    assert all(torch.isfinite(g).all() for g in grads)
    padding_grads = grads[1][0, 0, [3, 65]]
    assert torch.equal(padding_grads, torch.zeros(2, 8, device=device))  # padding gets none


@pytest.mark.parametrize(("path", "device"), on_devices(OWN_GENERAL, CUDA_OWN))
@pytest.mark.parametrize("value", [NAN, INF])
def test_keys_hidden_by_causal_or_window_masks_are_inert_in_attnkits_kernels(
    path, device, value, monkeypatch
):
    q, k, v = qkv(t=12, s=12, device=device)
    k[0, 0, 9], v[0, 0, 9] = value, value  # seen by queries 9.. (causal), 9..11 (window)
    for options in ({"causal": True}, {"window": (2, 0)}, {"window": (1, 1)}):
        out = check(path, q, k, v, monkeypatch, **options)
        assert torch.isfinite(out[..., :8, :]).all()


@pytest.mark.parametrize(("path", "device"), on_devices(GENERAL, CUDA_GENERAL))
def test_a_row_with_no_key_gives_zeros_whatever_its_query(path, device, monkeypatch):
    q, k, v = qkv(t=3, s=5, device=device)
    q[..., 0, :] = NAN
    mask = torch.ones(3, 5, dtype=torch.bool, device=device)
    mask[0] = False
    out = check(path, q, k, v, monkeypatch, attn_mask=mask)
    assert torch.equal(out[..., 0, :], torch.zeros(1, 2, 8, device=device))


@pytest.mark.parametrize(("path", "device"), on_devices(GENERAL, CUDA_GENERAL))
@pytest.mark.parametrize("value", [NAN, INF])
def test_nan_or_inf_in_a_float_mask_is_a_nan_score(path, device, value, monkeypatch):
    q, k, v = qkv(t=3, s=5, device=device)
    bias = torch.zeros(3, 5, device=device)
    bias[1, 2] = value
    bias[2, :] = -INF  # -inf still masks: row 2 sees nothing
    bias[2, 4] = value  # ...but NaN or +inf is a score, and a NaN one
    out = check(path, q, k, v, monkeypatch, attn_mask=bias)
    assert torch.isfinite(out[..., 0, :]).all()
    assert torch.isnan(out[..., 1:, :]).all()


@pytest.mark.parametrize(("path", "device"), on_devices(GENERAL, CUDA_GENERAL))
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_a_non_finite_alibi_slope_makes_its_head_nan(path, device, value, monkeypatch):
    q, k, v = qkv(h=2, t=3, s=5, device=device)
    slopes = torch.tensor([0.5, value], device=device)
    out = check(path, q, k, v, monkeypatch, alibi_slopes=slopes, causal=True)
    assert torch.isfinite(out[0, 0]).all() and torch.isnan(out[0, 1]).all()


@pytest.mark.parametrize(("path", "device"), on_devices(OWN_GENERAL, CUDA_OWN))
def test_softcap_does_not_hide_an_infinite_score(path, device, monkeypatch):
    """tanh(inf) = 1: without the rule an infinite query would pass as a capped score."""
    q, k, v = qkv(t=2, device=device)
    q[0, 0, 1, 0] = INF
    out = check(path, q, k, v, monkeypatch, softcap=5.0)
    assert torch.isnan(out[0, 0, 1]).all() and torch.isfinite(out[0, 0, 0]).all()


def test_reference_computes_in_float64_where_fp16_would_overflow(device):
    half = {"dtype": torch.float16, "device": device}
    q = torch.full((1, 1, 2, 4), 200.0, **half)
    k = torch.full((1, 1, 3, 4), 200.0, **half)  # q . k = 160000 > 65504
    v = torch.randn(1, 1, 3, 4, **half)
    out, lse = attention(q, k, v, scale=1.0, return_lse=True, backend="reference")
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out, v.mean(dim=2, keepdim=True).expand(1, 1, 2, 4))
    want = torch.full((1, 1, 2), 160000 + torch.log(torch.tensor(3.0)), device=device)
    torch.testing.assert_close(lse, want)


KINDS = ["q", "k", "v", "key_mask padding", "float mask", "slope"]


@given(
    b=st.integers(1, 2),
    h_kv=st.integers(1, 2),
    groups=st.integers(1, 2),
    t=st.integers(1, 9),
    s=st.integers(1, 15),
    causal=st.booleans(),
    window=st.none() | st.tuples(st.integers(-1, 4), st.integers(-1, 4)),
    softcap=st.none() | st.just(3.0),
    mask_kind=st.sampled_from(["none", "key_mask", "bool", "float"]),
    alibi=st.booleans(),
    places=st.lists(
        st.tuples(st.sampled_from(KINDS), st.sampled_from([NAN, INF, -INF]), st.integers(0, 10**6)),
        min_size=1,
        max_size=3,
    ),
)
@settings(  # device is a function-scoped fixture, but one value that no example changes
    suppress_health_check=[
        *settings.default.suppress_health_check,
        HealthCheck.function_scoped_fixture,
    ]
)
def test_property_every_backend_follows_the_one_rule(
    device, b, h_kv, groups, t, s, causal, window, softcap, mask_kind, alibi, places
):
    """Random options, non-finite values at random places: every path that can run the call gives
    the oracle's finite/non-finite pattern and, where finite, its values. SDPA is held to the rule
    everywhere but one place the rule leaves to attnkit's own kernels: a non-finite key or value
    that a causal, window or attn_mask hides from some query. (Paths a device has not, the decode
    kernel on CUDA, are refused by which_backend and left out.)"""
    h = h_kv * groups
    q, k, v = qkv(b, h, h_kv, t, s, 8, device=device)
    options = {"causal": causal, "window": window, "softcap": softcap}
    if mask_kind == "key_mask":
        options["key_mask"] = torch.rand(b, s, device=device) > 0.3
    elif mask_kind == "bool":
        options["attn_mask"] = torch.rand(b, 1, t, s, device=device) > 0.3
    elif mask_kind == "float":
        bias = torch.randn(1, h, t, s, device=device)
        bias[torch.rand(1, h, t, s, device=device) < 0.3] = -INF
        options["attn_mask"] = bias
    if alibi:
        options["alibi_slopes"] = torch.rand(h, device=device)
    hidden_key_or_value = False
    for kind, value, seed in places:
        if kind in ("q", "k", "v"):
            x = {"q": q, "k": k, "v": v}[kind]
            x.view(-1)[seed % x.numel()] = value
            hidden_key_or_value |= kind in ("k", "v")
        elif kind == "key_mask padding" and "key_mask" in options:
            row, key = seed % b, seed // b % s
            options["key_mask"][row, key] = False
            k[row, :, key], v[row, :, key] = value, value
        elif kind == "float mask" and mask_kind == "float" and value != -INF:
            options["attn_mask"].view(-1)[seed % options["attn_mask"].numel()] = value
        elif kind == "slope" and alibi:
            options["alibi_slopes"][seed % h] = value
    expected = selected_attention(q, k, v, **options)
    hides = causal or window is not None or mask_kind in ("bool", "float")
    monkeypatch = pytest.MonkeyPatch()  # hypothesis runs many examples per function-scoped fixture
    try:
        for path in PATHS:
            name = "tiled" if path == "tiled:loop" else path
            try:
                with torch.no_grad():
                    which_backend(q, k, v, backend=name, **options)
            except ValueError:  # an option this backend does not have, or tensors it cannot run
                continue
            if name == "sdpa" and hidden_key_or_value and hides:
                continue
            out, lse, weights = run(path, q, k, v, monkeypatch, **options)
            assert_same(out, expected[0])
            if lse is not None:
                assert_same(lse, expected[1])
                assert_same(weights, expected[2])
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize(
    ("path", "device"),
    on_devices(["tiled", "tiled:loop", "tiled:half", "tiled:portable"], ["tiled"]),
)
def test_a_nan_row_leaves_the_gradients_of_other_rows_finite(
    path, device, monkeypatch, forcing, tiled_blocks
):
    """The backward takes P and dS as exactly 0 at a masked key, even in a row that a NaN made
    NaN: neither a stale soft-cap value (C++) nor exp(-inf - NaN) reaches the other rows, nor
    a thread's buffers from one batch row to the next."""
    forcing(path)
    tiled_blocks(4, 4)
    dtype = torch.bfloat16 if path in HALF_PATHS else torch.float32
    q, k, v = (torch.randn(2, 1, 10, 8, dtype=dtype, device=device) for _ in range(3))
    q[0, 0, 6] = NAN  # batch row 0, one query late in the sequence
    leaves = [x.requires_grad_() for x in (q, k, v)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # both batch rows on one thread, sharing its buffers
    try:
        out = attention(*leaves, causal=True, softcap=2.0, backend="tiled")
        dq, dk, dv = torch.autograd.grad(out[1].float().sum() + out[0, 0, :6].float().sum(), leaves)
    finally:
        torch.set_num_threads(threads)
    assert torch.isfinite(out[1]).all()
    assert all(torch.isfinite(g[1]).all() for g in (dq, dk, dv))  # the other batch row
    assert torch.isfinite(dq[0, 0, :6]).all()  # the rows before the NaN one
    assert torch.isfinite(dv[0, 0, 7:]).all()  # keys the NaN query never saw


@pytest.mark.parametrize(("values_check", "device"), VALUES_CHECKS, indirect=["values_check"])
@pytest.mark.usefixtures("values_check")
def test_rows_of_huge_finite_values_are_finite(device):
    """A row sum that overflows is not a non-finite value: the exact check decides."""
    from attnkit.rules.nonfinite import nan_rows, nonfinite_rows

    x = torch.full((2, 3, 64), 3e37, device=device)  # every row sums past float32's largest value
    x[1, 2, 5] = NAN
    expected = torch.tensor([[False, False, False], [False, False, True]], device=device)
    assert torch.equal(nonfinite_rows(x), expected)
    assert torch.isnan(nan_rows(x)[1, 2]).all() and torch.equal(nan_rows(x)[0], x[0])
    q = torch.full((1, 1, 1, 64), 3e37, device=device)
    k = torch.full((1, 1, 2, 64), 1e-38, device=device)  # q . k is finite, q's row sum is not
    v = torch.randn(1, 1, 2, 64, device=device)
    for backend in ("reference", "sdpa", "tiled"):
        assert torch.isfinite(attention(q, k, v, scale=1.0, backend=backend)).all(), backend


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [NAN, math.inf, -math.inf, None])
@pytest.mark.parametrize(("values_check", "device"), VALUES_CHECKS, indirect=["values_check"])
@pytest.mark.usefixtures("values_check")
def test_nonfinite_rows_finds_each_kind_in_each_dtype(dtype, bad, device):
    from attnkit.rules.nonfinite import nonfinite_rows

    biggest = torch.finfo(dtype).max / 2  # finite, but rows of them sum past the largest value
    x = torch.full((2, 3, 8), biggest, dtype=dtype, device=device)
    expected = torch.zeros(2, 3, dtype=torch.bool, device=device)
    if bad is not None:
        x[1, 0, 5] = bad
        expected[1, 0] = True
    assert torch.equal(nonfinite_rows(x), expected)
    assert nonfinite_rows(x[:, :0]).shape == (2, 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "layout",
    [
        "contiguous",
        "heads second in memory",
        "a cache's first tokens",
        "two heads of three",
        "three tokens of five",
    ],
)
def test_the_gpus_product_with_zeros_finds_exactly_the_rows_that_are_not_finite(
    dtype, layout, device
):
    """On a GPU the rows of q and k are checked by their product with zeros (0 or NaN, never an
    overflow), on any layout whose rows form one strided batch; else by their largest values."""
    from attnkit.rules.nonfinite import _products_with_zeros

    x = torch.randn(2, 5, 3, 8, device=device).to(dtype)  # (b, t, h, d) in memory
    x = {
        "contiguous": x.transpose(1, 2).contiguous(),
        "heads second in memory": x.transpose(1, 2),
        "a cache's first tokens": x.transpose(1, 2).contiguous()[:, :, :4],
        "two heads of three": x[:, :, :2].transpose(1, 2),
        "three tokens of five": x[:, :3].transpose(1, 2),  # not one batch: the fallback
    }[layout]
    x[..., 0, :] = torch.finfo(dtype).max  # huge but finite: a sum would overflow
    x[0, 1, 2, 3], x[1, 0, 1, 0], x[1, 1, 2, 7] = NAN, math.inf, -math.inf
    expected = ~torch.isfinite(x.float()).all(dim=-1)
    found = _products_with_zeros(x)
    assert (found is None) == (layout == "three tokens of five")
    if found is not None:  # 0 or NaN, nothing else
        assert torch.equal(found.isnan(), expected) and not found[~expected].any()


@pytest.mark.parametrize(("path", "device"), on_devices(OWN_GENERAL, CUDA_OWN))
def test_a_nan_in_the_lse_gradient_stays_in_its_row(path, device, forcing):
    name = forcing(path)
    leaves = [x.requires_grad_() for x in qkv(h=1, t=6, s=6, device=device)]
    _, lse = attention(*leaves, causal=True, return_lse=True, backend=name)
    dlse = torch.zeros_like(lse)
    dlse[0, 0, 1] = NAN  # row 1 sees keys 0 and 1 only
    _, dk = torch.autograd.grad(lse, leaves[:2], dlse)  # the lse does not depend on v
    assert (~torch.isfinite(dk[0, 0, :2])).all() and torch.isfinite(dk[0, 0, 2:]).all()


def bf16_scenarios():
    """(name, q, k, v, options, the rows of out that must be finite) in bf16, one non-finite
    value each, where a pair product could carry it to a neighbour: next to a masked key, in a
    key block that starts at an odd key (a window), in the last key of an odd length."""

    def make(t=12, s=13):
        return [x.bfloat16() for x in qkv(t=t, s=s)]

    q, k, v = make()
    q[0, 1, 5, 3] = NAN
    yield "query", q, k, v, {}, None
    q, k, v = make()
    k[0, 0, 12, 0] = INF
    yield "last key, causal", q, k, v, {"causal": True}, slice(0, 11)
    q, k, v = make()
    v[0, 0, 9, 2] = NAN
    yield "value, window", q, k, v, {"window": (2, 0)}, slice(0, 8)
    q, k, v = make()
    k[0, 0, 4], v[0, 0, 4] = NAN, INF
    yield "key and value, window (1, 1)", q, k, v, {"window": (1, 1)}, slice(6, 12)
    q, k, v = make()
    key_mask = torch.ones(1, 13, dtype=torch.bool)
    key_mask[0, [3, 8]] = False
    k[0, 0, [3, 8]], v[0, 0, [3, 8]] = NAN, -INF
    yield "padding", q, k, v, {"key_mask": key_mask}, slice(0, 12)


@pytest.mark.parametrize("path", HALF_PATHS)
def test_the_half_precision_products_keep_the_rule(path, monkeypatch):
    for name, q, k, v, options, finite_rows in bf16_scenarios():
        with forced_path(path) as backend:
            choice = which_backend(q, k, v, backend=backend, **options)
            assert (choice.path, choice.products) == expected_products(path)
            inputs = [x.clone().requires_grad_() for x in (q, k, v)]
            out = attention(*inputs, backend=backend, **options)
            grads = torch.autograd.grad(out.float().sum(), inputs)
        out64, _, _ = selected_attention(q.float(), k.float(), v.float(), **options)
        finite = torch.isfinite(out64)
        assert torch.equal(torch.isfinite(out), finite), name
        torch.testing.assert_close(out[finite].float(), out64[finite].float(), atol=2e-2, rtol=2e-2)
        if finite_rows is not None:
            assert torch.isfinite(out[..., finite_rows, :]).all(), name
            assert torch.isfinite(grads[0][..., finite_rows, :]).all(), name
        if "key_mask" in options:
            assert torch.equal(grads[1][0, 0, [3, 8]], torch.zeros(2, 8, dtype=torch.bfloat16))


MOD_PATHS = ["reference", "tiled:loop"]  # the paths that take score_mod and block masks


@pytest.mark.parametrize(("path", "device"), on_devices(MOD_PATHS, ["tiled:loop"]))
@pytest.mark.parametrize(
    ("tensor", "row", "value"),
    [("k", 5, NAN), ("k", 5, INF), ("v", 5, NAN), ("v", 5, -INF), ("q", 0, NAN), ("k", 1, NAN)],
)
def test_score_and_mask_functions_keep_the_rule(path, device, tensor, row, value, monkeypatch):
    """Key 5 is hidden from every query but the last by mask_mod, key 1 is seen by all; a
    relative bias is added by score_mod. The oracle gets the same as a float attn_mask."""
    q, k, v = qkv(t=4, s=6, device=device)
    {"q": q, "k": k, "v": v}[tensor][0, 0, row, 0] = value
    table = torch.randn(2, 11, device=device)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 5]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < 5) | (q_idx == 3)

    out, lse, weights = run(path, q, k, v, monkeypatch, score_mod=score_mod, mask_mod=mask_mod)
    rows, keys = torch.arange(4, device=device)[:, None], torch.arange(6, device=device)
    heads = torch.arange(2, device=device)[:, None, None]
    bias = table[heads, rows - keys + 5][None]  # (1, h, t, s)
    as_mask = bias.masked_fill(~mask_mod(None, None, rows, keys), -INF)
    out64, lse64, weights64 = selected_attention(q, k, v, attn_mask=as_mask)
    assert_same(out, out64)
    assert_same(lse, lse64)
    assert_same(weights, weights64)


@pytest.mark.parametrize(("path", "device"), on_devices(["tiled:loop", "tiled"], ["tiled"]))
@pytest.mark.parametrize(
    ("tensor", "row", "value"),
    [("k", 2, NAN), ("k", 4, INF), ("v", 2, NAN), ("v", 4, -INF), ("q", 1, NAN), (None, 0, 0)],
)
def test_a_score_mod_that_adds_keeps_the_rule_in_the_kernel_and_the_loop(
    path, device, tensor, row, value, monkeypatch
):
    """``score + f`` with f = -inf at key 2 runs in the C++ kernel (``tiled``), tile by tile, and
    gives what the reference gives: f's -inf masks a finite score, but a NaN score (key 2's own,
    here) stays NaN, as torch's ``score + f`` would have it; a hidden NaN value stays out. (On
    CUDA, in the loop.)"""
    q, k, v = qkv(t=4, s=6, device=device)
    if tensor is not None:
        {"q": q, "k": k, "v": v}[tensor][0, 0, row, 0] = value
    table = torch.randn(2, 11, device=device)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + torch.where(kv_idx == 2, -INF, table[h, q_idx - kv_idx + 5])

    if device.type == "cpu":  # what sends it to the C++ kernel (probed on the CPU)
        assert mods.adds_to_score(score_mod)
    out, lse, weights = run(path, q, k, v, monkeypatch, score_mod=score_mod, causal=True)
    out64, lse64, weights64 = run(
        "reference",
        q.double(),
        k.double(),
        v.double(),
        monkeypatch,
        score_mod=score_mod,
        causal=True,
    )
    assert_same(out, out64)
    assert_same(lse, lse64)
    assert_same(weights, weights64)


@pytest.mark.parametrize(("path", "device"), on_devices(MOD_PATHS, MOD_PATHS))
def test_a_score_mod_masks_with_minus_infinity_and_spreads_nan(path, device, monkeypatch):
    q, k, v = qkv(t=4, s=6, device=device)

    def score_mod(score, b, h, q_idx, kv_idx):
        score = torch.where(kv_idx == 2, -INF, score)  # masks key 2 for every query
        return torch.where((q_idx == 1) & (kv_idx == 4), NAN, score)  # a NaN score in row 1

    out, lse, _ = run(path, q, k, v, monkeypatch, score_mod=score_mod)
    assert bool(out[:, :, 1].isnan().all()) and bool(lse[:, :, 1].isnan().all())
    keep = [0, 2, 3]
    without_key_2 = attention(q[:, :, keep], k[:, :, [0, 1, 3, 4, 5]], v[:, :, [0, 1, 3, 4, 5]])
    torch.testing.assert_close(out[:, :, keep], without_key_2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_gpu_row_check_by_extremes_is_exact(dtype):
    """The one-reduction check that zero_or_nan_rows runs on a GPU where the rows are not one
    batch, checked here on the CPU: NaN for a row holding NaN, +inf or -inf, and 0 for any other
    (a huge finite row included)."""
    from attnkit.rules.nonfinite import _largest_times_zero

    x = torch.randn(5, 7).to(dtype)
    x[1, 3], x[2, 0], x[3, 6] = float("nan"), float("inf"), float("-inf")
    x[4] = torch.finfo(dtype).max
    found = _largest_times_zero(x)
    assert found.isnan().tolist() == [False, True, True, True, False]
    assert found[[0, 4]].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("path", ["tiled", "tiled:loop"])
@pytest.mark.parametrize("grad", [False, True])
def test_weights_of_a_nan_row_are_nan_where_it_looks_and_0_where_masked(path, grad):
    """The weights recomputed after the pass, with or without a gradient to carry: a row a NaN
    query made NaN is NaN on the keys it sees and 0 on those its mask hides; the other rows
    are the oracle's."""
    q, k, v = qkv(h=2, t=6, s=6)
    q[0, 0, 3, 1] = NAN
    leaves = [x.clone().requires_grad_(grad) for x in (q, k, v)]
    with forced_path(path) as name:
        _, weights = attention(*leaves, causal=True, return_weights=True, backend=name)
    _, _, expected = selected_attention(q, k, v, causal=True)
    assert_same(weights.detach(), expected)
    assert torch.equal(weights[0, 0, 3, 4:].detach(), torch.zeros(2))


def _native_check():
    """The C++ check of values in the tiled kernel's build (skips where none can be had)."""

    kernel = finite.KERNEL.load()
    if kernel is None:
        pytest.skip(f"no build of the tiled kernel: {finite.KERNEL.available()[1]}")
    return kernel


@pytest.fixture
def values_check(request, monkeypatch):
    """Makes the look at values ``request.param``: ``native`` (skips where no build can be had)
    or ``torch`` (the helpers find no build; the backends still run their kernels)."""

    if request.param == "native":
        _native_check()
    else:
        monkeypatch.setattr(finite.KERNEL, "load_at_hand", lambda: None)
    return request.param
