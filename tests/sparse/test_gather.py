"""attnkit.sparse.gather: top-k sparse attention's PyTorch form (forced on the CPU, as it runs on a
GPU and under torch.compile) against the float64 oracle; which slots `visible` keeps; float64
gradients by gradcheck; a block of queries at a time; on CUDA where there is one."""

from __future__ import annotations

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
