"""attnkit.tiled.loop: the plan's blocks (which key blocks a window lets each block of
queries visit, and which of them need the positional mask), one step of the online softmax and of
its backward, and the exponential that keeps subnormal numbers out."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit
from attnkit.functional import checked_call
from attnkit.tiled.loop import Plan, exp_, online_softmax_, softmax_backward_
from attnkit.tiled.plans import TiledRoute
from helpers.oracle import allowed_positions


def plan(t, s, block_q, block_k, **options):
    q, k = torch.randn(1, 2, t, 4), torch.randn(1, 2, s, 4)
    route = TiledRoute(torch.float32, None, None, block_q, block_k)
    return Plan.of(checked_call(q, k, k, **options), route)


WINDOWS = [  # (t, s, causal, window)
    (20, 20, False, None),
    (20, 20, True, None),
    (20, 20, False, (2, 1)),
    (20, 20, True, (4, 0)),
    (9, 23, True, None),  # the diagonal sits right of the square's
    (9, 23, False, (3, 3)),
    (23, 9, True, (5, 0)),  # queries before every key: rows with nothing to see
    (17, 17, False, (0, 0)),  # each query sees its own key only
]


@pytest.mark.parametrize(("t", "s", "causal", "window"), WINDOWS)
@pytest.mark.parametrize(("block_q", "block_k"), [(4, 3), (5, 7), (32, 32)])
def test_key_blocks_visit_only_the_keys_the_window_allows(t, s, causal, window, block_q, block_k):
    p = plan(t, s, block_q, block_k, causal=causal, window=window)
    allowed = allowed_positions(t, s, causal, window)
    assert list(p.query_blocks()) == [(i, min(i + block_q, t)) for i in range(0, t, block_q)]
    for i0, i1 in p.query_blocks():
        seen = allowed[i0:i1]
        visited = torch.zeros(s, dtype=torch.bool)
        for j0, j1, needs_mask in p.key_blocks(i0, i1):
            assert 0 <= j0 < j1 <= s and j1 - j0 <= block_k
            assert not visited[j0:j1].any(), "a key visited twice"
            visited[j0:j1] = True
            # the positional mask is skipped only where every query sees every key of the block
            assert needs_mask == (not bool(seen[:, j0:j1].all()))
        # every key a query of the block may see, and no block of keys that none may see
        assert torch.equal(visited, seen.any(dim=0)), (i0, i1)


def test_a_block_mask_groups_its_blocks_into_the_plans(device):
    def causal_documents(b, h, q, kv):  # no window: documents of 24 tokens
        return (q >= kv) & (q // 24 == kv // 24)

    mask = attnkit.create_block_mask(causal_documents, None, None, 64, 64, device, 8)
    q = torch.randn(1, 2, 64, 4, device=device)
    p = Plan.of(
        checked_call(q, q, q, block_mask=mask), TiledRoute(torch.float32, None, None, 16, 32)
    )
    assert p.blocks is not None and (p.block_q, p.block_k) == p.blocks.block_size
    assert p.block_q % 8 == 0 and p.block_k % 8 == 0 and p.block_q <= 16 and p.block_k <= 32
    for i0, i1 in p.query_blocks():  # causal: no block past the diagonal is visited
        assert all(j0 <= i1 - 1 for j0, _, _ in p.key_blocks(i0, i1))
    assert plan(64, 64, 16, 32).blocks is None


def test_long_calls_evaluate_their_mods_compiled(monkeypatch):
    assert not plan(8, 8, 4, 4).compile_mods
    monkeypatch.setattr(attnkit.mods, "COMPILE_FROM", 64)
    assert plan(8, 8, 4, 4).compile_mods and not plan(8, 7, 4, 4).compile_mods


def test_online_softmax_steps_over_key_blocks_give_the_softmax_of_the_whole_row(device):
    f64 = {"dtype": torch.float64, "device": device}
    scores = torch.randn(1, 2, 3, 4, 10, **f64)  # (b, h_kv, g, bq, s)
    scores[0, 0, 0, 1] = -math.inf  # a row with no key at all
    scores[0, 1, 2, 3, :6] = -math.inf  # a row whose first blocks are masked
    values = torch.randn(1, 2, 10, 5, **f64)
    row_max = torch.full((1, 2, 3, 4, 1), -math.inf, **f64)
    row_sum = torch.zeros(1, 2, 3, 4, 1, **f64)
    acc = torch.zeros(1, 2, 3, 4, 5, **f64)
    for j0, j1 in ((0, 3), (3, 7), (7, 10)):
        block = scores[..., j0:j1].clone()  # the step overwrites its scores
        row_max = online_softmax_(block, values[:, :, j0:j1], row_max, row_sum, acc)
    empty = row_sum == 0
    assert empty[0, 0, 0, 1, 0] and empty.sum() == 1
    assert row_max[0, 0, 0, 1, 0].item() == -math.inf
    out = acc / row_sum.masked_fill(empty, 1.0)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # the empty row: 0
    torch.testing.assert_close(out, weights @ values[:, :, None])
    lse = (row_max + row_sum.log()).squeeze(-1)
    want = torch.logsumexp(scores, dim=-1)
    torch.testing.assert_close(lse[~empty[..., 0]], want[~empty[..., 0]])


def test_the_backward_step_gives_the_weights_and_the_scores_gradient(device):
    scores = torch.randn(1, 1, 2, 3, 6, dtype=torch.float64, requires_grad=True, device=device)
    values = torch.randn(1, 1, 6, 4, dtype=torch.float64, device=device)
    weights = torch.softmax(scores, dim=-1)
    out = weights @ values[:, :, None]
    dout = torch.randn_like(out)
    (want,) = torch.autograd.grad(out, scores, dout)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True).detach()
    dprobs = dout @ values[:, :, None].transpose(-2, -1)  # dP = dO V^T
    delta = (dout * out).sum(dim=-1, keepdim=True).detach()  # D = dO . O
    probs, dscores = softmax_backward_(scores.detach(), lse, dprobs, delta, None)
    torch.testing.assert_close(probs, weights.detach())
    torch.testing.assert_close(dscores, want)
    masked = torch.zeros_like(probs, dtype=torch.bool)
    masked[..., 0] = True
    probs, dscores = softmax_backward_(scores.detach(), lse, dprobs, delta, masked)
    assert bool((probs[..., 0] == 0).all() and (dscores[..., 0] == 0).all())


def test_exp_flushes_what_would_be_subnormal_in_float32_only(device):
    x = torch.tensor([0.0, -1.0, -87.0, -87.5, -100.0, math.nan, -math.inf], device=device)
    got = exp_(x.clone())
    assert got[:3].tolist() == torch.exp(x[:3]).tolist()
    assert got[3:5].tolist() == [0.0, 0.0]  # exp(-87.5) is a subnormal float32: exactly 0 instead
    assert math.isnan(got[5].item()) and got[6].item() == 0.0
    x64 = x.double()
    assert exp_(x64.clone())[3:5].tolist() == torch.exp(x64[3:5]).tolist()  # normal in float64
    assert torch.exp(x64[4]).item() > 0
