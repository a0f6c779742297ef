"""attnkit.sparse.native: top-k sparse attention on the C++ kernel against the float64 oracle (the
selection written out as a dense mask, key by key): outputs, lse and every gradient, with odd head
dims, t = 1 and t != s, GQA and MQA, indices per key/value head, unused slots, duplicates, the
causal limit, windows and padding; empty rows give zeros; half precision within twice the naive
path's error; the NaN rule; a second derivative."""

from __future__ import annotations

import pytest
import torch

from attnkit import attention
from attnkit.sparse import native
from helpers.oracle import assert_within_the_naive_error, naive_attention, selection_of
from helpers.sparse_calls import check_sparse

pytestmark = pytest.mark.skipif(not native.KERNEL.usable()[0], reason="no C++ kernel here")


def inputs(
    b=2, h=4, h_kv=2, t=13, s=21, d=40, dv=None, n=6, heads_of_indices=None, dtype=torch.float32
):
    q = torch.randn(b, h, t, d, dtype=dtype)
    k = torch.randn(b, h_kv, s, d, dtype=dtype)
    v = torch.randn(b, h_kv, s, dv or d, dtype=dtype)
    shape = (b, t, n) if heads_of_indices is None else (b, heads_of_indices, t, n)
    indices = torch.randint(-1, s, shape)
    return q, k, v, indices


def check(q, k, v, indices, **options):
    check_sparse(q, k, v, indices, "native", **options)


@pytest.mark.parametrize("d", [40, 59, 64, 128])
def test_head_dims_against_the_oracle(d):
    check(*inputs(d=d), causal=True)


@pytest.mark.parametrize(
    ("shape", "options"),
    [
        ({"t": 1, "s": 1, "n": 1}, {}),
        ({"t": 1, "s": 30}, {"causal": True}),
        ({"t": 30, "s": 9}, {"causal": True}),  # the first queries see no key
        ({"t": 9, "s": 30, "h": 4, "h_kv": 1}, {"causal": True}),  # multi-query
        ({"h": 6, "h_kv": 3, "heads_of_indices": 3}, {}),  # a selection per key/value head
        ({"dv": 24}, {"causal": True}),  # values narrower than keys, as in MLA
        ({"n": 40}, {}),  # more slots than keys: duplicates
        ({}, {"window": (4, 1)}),
        ({}, {"scale": 0.3}),
    ],
)
def test_shapes_and_masks_against_the_oracle(shape, options):
    check(*inputs(**shape), **options)


def test_padding_is_never_attended():
    q, k, v, indices = inputs()
    key_mask = torch.rand(2, 21) > 0.3
    padding = ~key_mask[:, None, :, None].expand_as(k)
    check(q, k.masked_fill(padding, float("nan")), v, indices, oracle_keys=k, key_mask=key_mask)


def test_int32_indices_and_a_query_laid_out_as_projections_give_the_same():
    q, k, v, indices = inputs()
    projected = q.transpose(1, 2).contiguous().transpose(1, 2)  # (b, t, h, d) memory
    out = attention(projected, k, v, indices=indices.int())
    torch.testing.assert_close(out, attention(q, k, v, indices=indices, backend="reference"))


def test_rows_that_select_nothing_give_zeros_and_zero_gradients():
    q, k, v, indices = inputs()
    indices[:, :4] = -1
    leaves = [x.requires_grad_() for x in (q, k, v)]
    out, lse = attention(*leaves, indices=indices, return_lse=True)
    assert (out[:, :, :4] == 0).all() and (lse[:, :, :4] == float("-inf")).all()
    out.sum().backward()
    assert (q.grad[:, :, :4] == 0).all()
    assert all(torch.isfinite(x.grad).all() for x in leaves)


def test_a_nan_key_reaches_only_the_queries_that_select_it():
    q, k, v, indices = inputs(b=1, h=2, h_kv=1)
    k[0, 0, 5] = float("nan")
    indices[indices == 5] = -1
    indices[0, 3, 0] = 5
    out = attention(q, k, v, indices=indices)
    assert out[0, :, 3].isnan().all()
    assert not out[0, :, torch.arange(13) != 3].isnan().any()


def test_an_infinite_value_makes_nan_only_its_columns_of_the_queries_that_select_it():
    q, k, v, indices = inputs(b=1, h=2, h_kv=1)
    v[0, 0, 5, 2] = float("inf")
    indices[indices == 5] = -1
    indices[0, 3, 0] = 5
    out = attention(q, k, v, indices=indices)
    assert out[0, :, 3, 2].isnan().all() and not out[0, :, 3, :2].isnan().any()
    assert not out[0, :, torch.arange(13) != 3].isnan().any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_twice_the_naive_error(dtype):
    q, k, v, indices = inputs(d=64, t=33, s=50, n=12)
    mask = selection_of(indices, 4, 50)
    leaves = [[x.to(dtype).requires_grad_() for x in (q, k, v)] for _ in range(2)]
    exact = [x.to(dtype).double().requires_grad_() for x in (q, k, v)]
    outputs = (
        attention(*leaves[0], indices=indices, causal=True),
        naive_attention(*leaves[1], attn_mask=mask, causal=True)[0],
        naive_attention(*exact, attn_mask=mask, causal=True)[0],
    )
    assert_within_the_naive_error(outputs, (leaves[0], leaves[1], exact))


def test_the_weights_are_dense_and_zero_off_the_selection():
    q, k, v, indices = inputs()
    _, weights = attention(q, k, v, indices=indices, causal=True, return_weights=True)
    want = attention(
        q, k, v, indices=indices, causal=True, return_weights=True, backend="reference"
    )
    torch.testing.assert_close(weights, want[1])
    assert (weights[~selection_of(indices, 4, 21)] == 0).all()


def test_sinks_join_the_denominator_with_gradients():
    q, k, v, indices = inputs()
    sinks = torch.randn(4, requires_grad=True)
    out = attention(q, k, v, indices=indices, sinks=sinks, causal=True)
    want = attention(q, k, v, indices=indices, sinks=sinks, causal=True, backend="reference")
    torch.testing.assert_close(out, want)
    (grad,) = torch.autograd.grad(out.sum(), sinks)
    (want_grad,) = torch.autograd.grad(want.sum(), sinks)
    torch.testing.assert_close(grad, want_grad)


def test_a_second_derivative_matches_the_reference():
    q, k, v, indices = inputs(b=1, t=7, s=9, d=8, n=4)
    results = []
    for backend in ("sparse", "reference"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = attention(*leaves, indices=indices, causal=True, backend=backend)
        (dq,) = torch.autograd.grad(out.pow(2).sum(), leaves[0], create_graph=True)
        results.append(torch.autograd.grad(dq.pow(2).sum(), leaves))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)


def test_many_tiles_and_blocks_of_queries_against_the_oracle():
    """Keys over several of the kernel's tiles, queries over several of its blocks, a split of dK
    and dV per thread (one key/value head, more threads than heads)."""
    q, k, v, indices = inputs(b=1, h=2, h_kv=1, t=150, s=1300, d=64, n=48)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        check(q, k, v, indices, causal=True)
    finally:
        torch.set_num_threads(threads)


def test_the_lse_and_the_weights_carry_gradients():
    q, k, v, _ = inputs(t=9, s=11, d=16)
    indices = torch.randint(0, 11, (2, 9, 5))  # every query keeps a key: no row is empty
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    _, lse, weights = attention(*leaves, indices=indices, return_lse=True, return_weights=True)
    _, want_lse, want_weights = naive_attention(*exact, attn_mask=selection_of(indices, 4, 11))
    dlse, dweights = torch.randn_like(lse), torch.randn_like(weights)
    # neither depends on v: the gradients of q and k
    grads = torch.autograd.grad((lse * dlse).sum() + (weights * dweights).sum(), leaves[:2])
    wanted = torch.autograd.grad(
        (want_lse * dlse.double()).sum() + (want_weights * dweights.double()).sum(), exact[:2]
    )
    for got, want in zip(grads, wanted):
        torch.testing.assert_close(got, want.float())


def test_int32_indices_views_of_projections_and_a_strided_gradient_train_alike():
    q, k, v, indices = inputs()
    results = []
    for layout in ("contiguous", "views"):
        if layout == "views":  # k and v laid out (b, s, h_kv, d) as projections make them
            kv = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v)]
            chosen = indices.int()
        else:
            kv, chosen = [k, v], indices
        leaves = [x.clone().requires_grad_() for x in (q, *kv)]
        out = attention(*leaves, indices=chosen, causal=True)
        dout = torch.ones(2, 13, 4, 40).transpose(1, 2)  # a gradient that is a view, too
        results.append(torch.autograd.grad(out, leaves, dout))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)


def test_padding_with_the_causal_limit():
    q, k, v, indices = inputs()
    key_mask = torch.rand(2, 21) > 0.3
    check(q, k, v, indices, key_mask=key_mask, causal=True)


@pytest.mark.parametrize("d", [96, 192])
def test_bf16_pair_products_at_other_widths_within_twice_the_naive_error(d):
    q, k, v, indices = inputs(d=d, t=20, s=40, n=12, dtype=torch.bfloat16)
    v = v[..., :64]  # keys wider than values, as MLA's 192 and 128
    mask = selection_of(indices, 4, 40)
    leaves = [[x.clone().requires_grad_() for x in (q, k, v)] for _ in range(2)]
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    outputs = (
        attention(*leaves[0], indices=indices, causal=True),
        naive_attention(*leaves[1], attn_mask=mask, causal=True)[0],
        naive_attention(*exact, attn_mask=mask, causal=True)[0],
    )
    assert_within_the_naive_error(outputs, (leaves[0], leaves[1], exact))
