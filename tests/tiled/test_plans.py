"""The tiled loop's plan of a block mask (attnkit.tiled.plans): partial blocks call
mask_mod, full blocks skip it, empty blocks are never computed; the kernel's blocks group
several of the mask's."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import functional as F
from attnkit.block_mask import create_block_mask, window_of
from attnkit.tiled import loop as tiled_loop
from helpers.zoo import CASES, SHAPES, ZOO, H, inputs, oracle, torch_block_mask


def test_partial_blocks_call_mask_mod_full_blocks_skip_it_empty_blocks_are_never_computed(
    monkeypatch,
):
    t = s = 32  # blocks of 8: 4 x 4, of which the causal mask leaves 4 partial and 6 full
    calls = []

    def counted(b, h, q, kv):  # causal, with a hole: not a window (which would run as one)
        calls.append((int(q.min()), int(kv.min())))
        return (q >= kv) & ((q != 5) | (kv != 3))

    block_mask = create_block_mask(counted, None, None, t, s, "cpu", 8)
    assert window_of(block_mask, 1, H) is None  # looked at once, in its partial blocks
    calls.clear()
    computed = []
    original = tiled_loop.Plan.scores

    def scores(self, *args, **kwargs):
        computed.append(args[2:6])  # i0, i1, j0, j1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(tiled_loop.Plan, "scores", scores)
    F.attention(*inputs(1, H, t, s), block_mask=block_mask, backend="tiled")
    assert sorted(computed) == sorted(
        (i, i + 8, j, j + 8) for i in range(0, 32, 8) for j in range(0, i + 1, 8)
    )
    assert sorted(calls) == [(i, i) for i in range(0, 32, 8)]  # the diagonal's blocks only


@pytest.mark.parametrize(("mod", "shape"), CASES)
def test_the_kernel_walks_groups_of_mask_blocks_as_one(mod, shape, monkeypatch, tiled_blocks):
    """The tiled loop's blocks span 4 x 4 of the mask's (as 256 x 512 span 2 x 4 of 128 x 128),
    with some of them full, some partial, some empty; a head- and batch-dependent mask too."""
    tiled_blocks(16, 32)
    score_mod, mask_mod = ZOO[mod]
    b, h_kv, t, s = SHAPES[shape]
    q, k, v = (x.requires_grad_() for x in inputs(b, h_kv, t, s))
    block_mask = torch_block_mask(mask_mod, t, s, (4, 8))
    out = F.attention(q, k, v, score_mod=score_mod, block_mask=block_mask, backend="tiled")
    out64, _ = oracle(q, k, v, score_mod, mask_mod)
    torch.testing.assert_close(out, out64.float())
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(
        F.attention(q, k, v, score_mod=score_mod, block_mask=block_mask, backend="reference").sum(),
        (q, k, v),
    )
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w)


def test_a_mask_that_depends_on_batch_and_head_in_grouped_blocks(monkeypatch, tiled_blocks):
    tiled_blocks(16, 32)

    def per_row(b, h, q_idx, kv_idx):
        return ((q_idx >= kv_idx) & (h % 2 == 0)) | ((kv_idx < 9 + 4 * b) & (h % 2 == 1))

    q, k, v = inputs(2, H, 29, 29)
    block_mask = attnkit.create_block_mask(per_row, 2, H, 29, 29, "cpu", (4, 8))
    out = F.attention(q, k, v, block_mask=block_mask, backend="tiled")
    torch.testing.assert_close(out, oracle(q, k, v, None, per_row)[0].float())
