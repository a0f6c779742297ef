"""Learned sinks (``attention(..., sinks=)``) on every backend and path that takes them, against the
float64 oracle (tests/helpers/oracle.py, where the sink is one more column of each row's softmax)."""

from __future__ import annotations

import pytest
import torch

from attnkit import attention, flex_attention, force, varlen_attention
from attnkit.backends import decode
from attnkit.functional import which_backend
from helpers.devices import CUDA, forced_path
from helpers.oracle import assert_within_the_naive_error, naive_attention

# (b, h, h_kv, t, s, d)
SHAPES = {
    "mha": (2, 4, 4, 5, 5, 16),
    "gqa t<s d=40": (1, 4, 2, 7, 11, 40),
    "mqa t>s d=59": (2, 3, 1, 11, 6, 59),
    "t=1": (1, 2, 2, 1, 9, 8),
    "odd lengths": (1, 2, 1, 37, 66, 32),
}
PATHS = ["reference", "tiled", "tiled:loop"]
CUDA_PATHS = ["reference", "tiled"]  # on CUDA the tiled backend always runs its loop


def on_devices(values, cuda):
    """``(value, device)`` parameters: every value on the CPU, those in ``cuda`` on CUDA too."""
    return [
        *(pytest.param(v, torch.device("cpu"), id=f"{v}-cpu") for v in values),
        *(pytest.param(v, torch.device("cuda"), id=f"{v}-cuda", marks=CUDA.marks) for v in cuda),
    ]


OPTIONS = {
    "causal": {"causal": True},
    "key_mask": {"key_mask": True},
    "window": {"window": (3, 1)},
    "softcap and alibi": {"softcap": 2.5, "alibi": True},
}


def inputs(shape, dtype=torch.float32, key_mask=False, device="cpu"):
    b, h, h_kv, t, s, d = shape
    q, k, v = (
        torch.randn(b, n, m, d, dtype=dtype, device=device)
        for n, m in ((h, t), (h_kv, s), (h_kv, s))
    )
    sinks = torch.randn(h, dtype=dtype, device=device) * 2
    masks = {}
    if key_mask:
        masks["key_mask"] = torch.rand(b, s, device=device) > 0.4
        masks["key_mask"][0, -1] = True
        if b > 1:
            masks["key_mask"][-1] = False  # a batch row of padding: every query sees nothing
    return [x.requires_grad_() for x in (q, k, v, sinks)], masks


def options_of(name, h, device="cpu"):
    options = dict(OPTIONS[name])
    options.pop("key_mask", None)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.linspace(0.1, 0.5, h, device=device)
    return options


def oracle64(leaves, masks, **options):
    leaves64 = [x.detach().double().requires_grad_() for x in leaves]
    q, k, v, sinks = leaves64
    options = {n: x.double() if isinstance(x, torch.Tensor) else x for n, x in options.items()}
    return leaves64, naive_attention(q, k, v, **masks, sinks=sinks, **options)


@pytest.mark.parametrize(("path", "device"), on_devices(PATHS, ["tiled"]))
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("name", OPTIONS)
def test_fp32_outputs_lse_weights_and_gradients_match_the_oracle(path, device, shape, name):
    leaves, masks = inputs(shape, key_mask=name == "key_mask", device=device)
    options = options_of(name, shape[1], device)
    q, k, v, sinks = leaves
    with forced_path(path) as backend:
        out, lse, weights = attention(
            q, k, v, sinks=sinks, **masks, **options, return_lse=True, return_weights=True,
            backend=backend,
        )  # fmt: skip
    leaves64, (out64, lse64, weights64) = oracle64(leaves, masks, **options)
    torch.testing.assert_close(out, out64.float())
    torch.testing.assert_close(lse, lse64.float())
    torch.testing.assert_close(weights, weights64.float())
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    want = torch.autograd.grad((out64, lse64), leaves64, (dout.double(), dlse.double()))
    for g, g64 in zip(got, want):
        torch.testing.assert_close(g, g64.float())


@pytest.mark.parametrize(("path", "device"), on_devices(PATHS, CUDA_PATHS))
def test_weights_leave_the_sink_out_and_a_row_with_no_key_gives_zeros(path, device):
    (q, k, v, sinks), _ = inputs((2, 2, 1, 4, 6, 8), device=device)
    key_mask = torch.ones(2, 6, dtype=torch.bool, device=device)
    key_mask[1] = False  # the second batch row: padding only
    with forced_path(path) as backend:
        out, lse, weights = attention(
            q, k, v, sinks=sinks, key_mask=key_mask, return_lse=True, return_weights=True,
            backend=backend,
        )  # fmt: skip
    grads = torch.autograd.grad(out.sum(), (q, k, v, sinks))
    sink_share = torch.exp(sinks.detach()[:, None] - lse.detach()[0])  # p_sink; lse has the sink
    torch.testing.assert_close(weights[0].sum(-1), 1 - sink_share)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(lse[1], sinks.detach()[:, None].expand(2, 4))  # the sink alone
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize(("path", "device"), on_devices(PATHS, CUDA_PATHS))
def test_a_nan_query_spreads_to_its_row_only(path, device):
    (q, k, v, sinks), _ = inputs((1, 2, 2, 4, 6, 8), device=device)
    q = q.detach().clone()
    q[0, 1, 2, 0] = float("nan")
    with forced_path(path) as backend:
        out = attention(q, k, v, sinks=sinks, backend=backend)
    assert out[0, 1, 2].isnan().all()
    assert not out[0, 1, [0, 1, 3]].isnan().any() and not out[0, 0].isnan().any()


def test_a_sink_of_minus_infinity_is_no_sink(device):
    (q, k, v, _), _ = inputs((1, 2, 2, 4, 6, 8), device=device)
    none = torch.full((2,), float("-inf"), requires_grad=True, device=device)
    # every row empty: lse -inf, and no NaN either way
    key_mask = torch.tensor([[False] * 6], device=device)
    for masks in ({}, {"key_mask": key_mask}):
        out = attention(q, k, v, sinks=none, backend="tiled", **masks)
        torch.testing.assert_close(out, attention(q, k, v, backend="tiled", **masks))
        grads = torch.autograd.grad(out.sum(), (q, none))
        assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_gradcheck_and_gradgradcheck_in_float64(backend, device):
    (q, k, v, sinks), _ = inputs((1, 2, 1, 5, 7, 4), dtype=torch.float64, device=device)
    key_mask = torch.tensor([[True, True, False, True, True, True, False]], device=device)

    def fn(q, k, v, sinks):
        return attention(
            q, k, v, sinks=sinks, key_mask=key_mask, causal=True, backend=backend, return_lse=True
        )

    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))
    assert torch.autograd.gradgradcheck(fn, (q, k, v, sinks))


@pytest.mark.parametrize(
    ("path", "device"),
    on_devices(["tiled", "tiled:loop", "tiled:half", "tiled:half-loop"], ["tiled"]),
)
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_within_twice_the_naive_error_and_gradients_three_times(path, device, causal):
    leaves, masks = inputs(
        (2, 4, 2, 33, 47, 40), dtype=torch.bfloat16, key_mask=True, device=device
    )
    with forced_path(path) as backend:
        out = attention(*leaves[:3], sinks=leaves[3], **masks, causal=causal, backend=backend)
    naive_leaves = [x.detach().clone().requires_grad_() for x in leaves]
    q, k, v, sinks = naive_leaves
    naive_out = naive_attention(q, k, v, sinks=sinks, **masks, causal=causal)[0]
    leaves64, (out64, _, _) = oracle64(leaves, masks, causal=causal)
    assert out.dtype == torch.bfloat16
    assert_within_the_naive_error((out, naive_out, out64), (leaves, naive_leaves, leaves64))


def test_a_score_mod_and_a_block_mask_take_sinks_too(device):
    from attnkit import create_block_mask

    (q, k, v, sinks), _ = inputs((1, 2, 2, 13, 13, 8), device=device)
    table = torch.randn(2, 25, device=device)

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 12]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask = create_block_mask(causal, None, None, 13, 13, device, 4)
    out = attention(q, k, v, sinks=sinks, score_mod=relative, block_mask=mask, backend="tiled")
    expected = attention(
        q, k, v, sinks=sinks, score_mod=relative, block_mask=mask, backend="reference"
    )
    torch.testing.assert_close(out, expected)
    got = torch.autograd.grad(out.sum(), (q, k, v, sinks))
    want = torch.autograd.grad(expected.sum(), (q, k, v, sinks))
    for g, g_ref in zip(got, want):
        torch.testing.assert_close(g, g_ref)


def test_auto_passes_over_sdpa_where_its_flash_kernel_cannot_take_sinks(device):
    (q, k, v, sinks), _ = inputs((1, 4, 2, 64, 64, 16), device=device)
    choice = which_backend(q, k, v, sinks=sinks, window=(8, 0))
    if device.type == "cpu":  # on CUDA a later backend with sinks may take the call
        assert choice.backend == "tiled"
    assert "sdpa cannot run sinks with a mask other than causal" in choice.reason
    with pytest.raises(ValueError, match="backend 'sdpa' cannot run sinks with a mask"):
        attention(q, k, v, sinks=sinks, window=(8, 0), backend="sdpa")


@pytest.mark.parametrize(
    "sinks, error, words",
    [
        (torch.zeros(3), ValueError, r"sinks must have shape \(heads,\) = \(4,\), got \(3,\)"),
        (torch.zeros(1, 4), ValueError, r"sinks must have shape"),
        (torch.zeros(4, dtype=torch.long), TypeError, "sinks"),
        ([0.0] * 4, TypeError, "sinks"),
    ],
)
def test_bad_sinks_are_refused_naming_them(sinks, error, words):
    (q, k, v, _), _ = inputs((1, 4, 2, 3, 5, 8))
    with pytest.raises(error, match=words):
        attention(q, k, v, sinks=sinks)


@pytest.mark.skipif(not decode.KERNEL.usable()[0], reason="decode kernel unavailable")
@pytest.mark.parametrize("split", [1024, 16], ids=["splits as in use", "many splits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_kernel_joins_the_sink_in_its_merge(split, dtype):
    b, h, h_kv, t, s, d = 2, 6, 2, 2, 150, 40
    q, k, v = (torch.randn(b, n, m, d).to(dtype) for n, m in ((h, t), (h_kv, s), (h_kv, s)))
    sinks = torch.randn(h) * 3
    key_mask = torch.rand(b, s) > 0.3
    key_mask[1] = False  # a batch row of padding only: zeros
    with torch.no_grad(), force.splits(split):
        assert which_backend(q, k, v, sinks=sinks, key_mask=key_mask).backend == "decode"
        out = attention(q, k, v, sinks=sinks, key_mask=key_mask, backend="decode")
    expected = naive_attention(
        *(x.double() for x in (q, k, v)), sinks=sinks.double(), key_mask=key_mask
    )[0]
    torch.testing.assert_close(out, expected.to(dtype))
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_flex_and_varlen_take_sinks(device):
    (q, k, v, sinks), _ = inputs((1, 4, 2, 9, 9, 8), device=device)
    out = flex_attention(q, k, v, enable_gqa=True, sinks=sinks)
    torch.testing.assert_close(out, attention(q, k, v, sinks=sinks, backend="reference"))
    cu = torch.tensor([0, 4, 9], device=device)
    packed = [x[0].transpose(0, 1) for x in (q, k, v)]  # (total, heads, d)
    out = varlen_attention(*packed, cu, cu, causal=True, sinks=sinks)
    for start, end in ((0, 4), (4, 9)):
        alone = attention(
            *(x[:, :, start:end] for x in (q, k, v)), sinks=sinks, causal=True, backend="reference"
        )
        torch.testing.assert_close(out[start:end], alone[0].transpose(0, 1))


@pytest.mark.parametrize(("path", "device"), on_devices([*PATHS, "decode"], CUDA_PATHS))
def test_an_infinite_sink_makes_its_heads_rows_nan_as_an_infinite_score_does(path, device):
    (q, k, v, _), _ = inputs((1, 2, 1, 3, 6, 8), device=device)
    sinks = torch.tensor([float("inf"), 0.5], device=device)
    with torch.no_grad(), forced_path(path) as backend:
        out = attention(q, k, v, sinks=sinks, backend=backend)
    assert out[0, 0].isnan().all() and not out[0, 1].isnan().any()


@pytest.mark.parametrize(("path", "device"), on_devices(PATHS, CUDA_PATHS))
def test_edge_rows_follow_the_reference(path, device):
    """A row with no key and a sink of -inf has lse -inf; in a NaN row, hidden keys keep
    weight 0."""
    (q, k, v, _), _ = inputs((1, 2, 1, 3, 6, 8), device=device)
    sinks = torch.tensor([float("-inf"), 0.5], device=device)
    nobody = torch.zeros(1, 6, dtype=torch.bool, device=device)
    with forced_path(path) as backend:
        _, lse = attention(q, k, v, sinks=sinks, key_mask=nobody, return_lse=True, backend=backend)
    assert lse[0, 0].eq(float("-inf")).all()
    assert torch.equal(lse[0, 1], torch.full((3,), 0.5, device=device))
    q = q.detach().clone()
    q[0, 0, 1, 0] = float("nan")
    some = torch.tensor([[True, True, False, True, False, True]], device=device)
    with forced_path(path) as backend:
        _, weights = attention(
            q, k, v, sinks=sinks.abs(), key_mask=some, return_weights=True, backend=backend
        )
    row = weights[0, 0, 1]
    assert row[some[0]].isnan().all() and torch.equal(row[~some[0]], torch.zeros(2, device=device))
