"""attnkit.sparse.gather: top-k sparse attention's PyTorch form (forced on the CPU, as it runs on a
GPU and under torch.compile) against the float64 oracle; which slots `visible` keeps; float64
gradients by gradcheck; a block of queries at a time; on CUDA where there is one."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from attnkit import attention, force
from attnkit.masks import Masks
from attnkit.sparse import gather
from helpers.devices import CUDA
from helpers.sparse_calls import check_sparse


def inputs(b=2, h=4, h_kv=2, t=13, s=21, d=40, n=6, dtype=torch.float32, device="cpu"):
    make = lambda *shape: torch.randn(*shape, dtype=dtype, device=device)  # noqa: E731
    indices = torch.randint(-1, s, (b, t, n), device=device)
    return make(b, h, t, d), make(b, h_kv, s, d), make(b, h_kv, s, d + 3), indices


@pytest.mark.parametrize(
    ("shape", "options"),
    [
        ({}, {"causal": True}),
        ({"t": 1, "s": 1, "n": 1}, {}),
        ({"t": 30, "s": 9}, {"causal": True}),
        ({"h": 4, "h_kv": 1, "n": 40}, {"window": (3, 2)}),
        ({"d": 59}, {"key_mask": torch.rand(2, 21) > 0.3}),
    ],
)
def test_the_pytorch_form_against_the_oracle(shape, options):
    with force.forced("sparse:gather"):
        check_sparse(*inputs(**shape), "gather", **options)


def test_blocks_of_queries_give_what_one_block_gives(monkeypatch):
    q, k, v, indices = inputs(t=29)
    with force.forced("sparse:gather"):
        whole = attention(q, k, v, indices=indices, causal=True)
        monkeypatch.setattr(gather, "GATHERED", 2 * 6 * 2 * (40 + 43) * 5)  # 5 queries a block
        torch.testing.assert_close(attention(q, k, v, indices=indices, causal=True), whole)


def test_visible_keeps_each_key_once_inside_the_masks():
    indices = torch.tensor([[[[4, -1, 4, 2, 9, 0]]]])  # one query at position 5 of s = 10
    key_mask = torch.ones(1, 10, dtype=torch.bool)
    key_mask[0, 0] = False
    masks = Masks(window=(-1, 0), key_mask=key_mask)
    kept = gather.visible(indices, masks, (0, 1), t=1, s=10)
    # 4 once, -1 none, 2 yes, 9 beyond the causal limit (position 9 > 9? no: t=1, s=10 sits at 9)
    assert kept.tolist() == [[[[True, False, False, True, True, False]]]]
    causal_at_5 = Masks(window=(-1, 0), shift=-4)  # the query at position 5
    kept = gather.visible(indices, causal_at_5, (0, 1), t=1, s=10)
    assert kept.tolist() == [[[[True, False, False, True, False, True]]]]


def test_float64_gradients_by_gradcheck():
    q, k, v, indices = inputs(b=1, h=2, h_kv=1, t=5, s=7, d=3, n=4, dtype=torch.float64)
    leaves = [x.requires_grad_() for x in (q, k, v)]

    def f(q, k, v):
        out, lse = attention(q, k, v, indices=indices, causal=True, return_lse=True)
        return out, lse.masked_fill(lse == float("-inf"), 0.0)  # a row with no key: no slope

    assert torch.autograd.gradcheck(f, leaves)
    assert torch.autograd.gradgradcheck(f, leaves)


@pytest.mark.parametrize("device", [CUDA])
def test_on_cuda_against_the_oracle(device):
    q, k, v, indices = inputs(device=device)
    out = attention(q, k, v, indices=indices, causal=True)
    want = attention(*(x.cpu() for x in (q, k, v)), indices=indices.cpu(), causal=True)
    torch.testing.assert_close(out.cpu(), want)


def test_no_slot_at_all_gives_zeros_and_an_lse_of_minus_infinity():
    q, k, v, _ = inputs()
    empty = torch.zeros(2, 13, 0, dtype=torch.long)
    for path in ("sparse:gather", None):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with force.forced(path) if path else nullcontext():
            out, lse = attention(*leaves, indices=empty, return_lse=True)
        assert (out == 0).all() and (lse == float("-inf")).all()
        out.sum().backward()
        assert all((x.grad == 0).all() for x in leaves)


def test_a_nan_key_reaches_only_the_queries_that_select_it():
    q, k, v, indices = inputs(b=1, h=2, h_kv=1)
    k[0, 0, 5] = float("nan")
    indices[indices == 5] = -1
    indices[0, 3, 0] = 5
    with force.forced("sparse:gather"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = attention(*leaves, indices=indices)
        out.sum().backward()
    assert out[0, :, 3].isnan().all()
    assert not out[0, :, torch.arange(13) != 3].isnan().any()
    assert not leaves[0].grad[0, :, torch.arange(13) != 3].isnan().any()


def test_an_index_outside_the_keys_selects_nothing_where_it_is_not_read():
    q, k, v, indices = inputs()
    outside = indices.clone()
    outside[0, 2, 1] = 21  # past the 21 keys
    outside[1, 5, 0] = -7
    unused = outside.masked_fill((outside < 0) | (outside >= 21), -1)
    compiled = torch.compile(
        lambda q, k, v, i: attention(q, k, v, indices=i, causal=True),
        backend="eager",
        fullgraph=True,
    )
    out = compiled(q, k, v, outside)  # traced: the values are not read
    torch.testing.assert_close(out, attention(q, k, v, indices=unused, causal=True))
