"""attnkit.rules.exact, the equations the reference backend materialises: its masked softmax (an empty row is zeros, not NaN), the reach of a
non-finite value (the rows that see its key, the column it is in), the dtypes of its results, and
the differentiable gradients other backends borrow for a second derivative."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.functional import attention, checked_call
from attnkit.rules.exact import differentiable_grads, masked_softmax, weighted_values

INF, NAN = math.inf, math.nan


def test_masked_softmax_is_the_softmax_of_the_allowed_scores(device):
    scores = torch.randn(3, 4, 6, dtype=torch.float64, device=device)
    allowed = torch.rand(4, 6, device=device) > 0.4
    allowed[:, 0] = True
    weights, lse = masked_softmax(scores, allowed)
    kept = scores.masked_fill(~allowed, -INF)
    torch.testing.assert_close(weights, torch.softmax(kept, dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(kept, dim=-1))
    assert bool((weights[..., ~allowed] == 0).all())
    plain, plain_lse = masked_softmax(scores)  # no mask
    torch.testing.assert_close(plain, torch.softmax(scores, dim=-1))
    torch.testing.assert_close(plain_lse, torch.logsumexp(scores, dim=-1))


def test_an_empty_row_gives_zeros_and_a_minus_inf_lse_not_nan_and_zero_gradients(device):
    scores = torch.randn(2, 5, dtype=torch.float64, requires_grad=True, device=device)
    allowed = torch.tensor([[True, False, True, False, False], [False] * 5], device=device)
    weights, lse = masked_softmax(scores, allowed)
    assert torch.equal(weights[1], torch.zeros(5, dtype=torch.float64, device=device))
    assert lse[1].item() == -INF and math.isfinite(lse[0].item())
    (grad,) = torch.autograd.grad(weights.square().sum(), scores)
    assert torch.isfinite(grad).all() and bool((grad[1] == 0).all())
    # -inf scores count as masked
    minus_inf = torch.tensor([[-INF, -INF, -INF], [0.0, -INF, 1.0]], device=device)
    weights, lse = masked_softmax(minus_inf)
    assert torch.equal(weights[0], torch.zeros(3, device=device)) and lse[0].item() == -INF
    torch.testing.assert_close(weights[1], torch.softmax(minus_inf[1], dim=-1))


def test_a_nan_score_makes_its_row_nan_except_at_the_masked_keys(device):
    scores = torch.tensor([[0.0, NAN, 1.0, 2.0], [0.0, 1.0, 2.0, 3.0]], device=device)
    allowed = torch.tensor([True, True, True, False], device=device)
    weights, lse = masked_softmax(scores, allowed)
    assert torch.isnan(weights[0, :3]).all() and weights[0, 3].item() == 0.0
    assert math.isnan(lse[0].item())
    assert torch.isfinite(weights[1]).all() and weights[1, 3].item() == 0.0


def test_a_non_finite_value_reaches_the_rows_that_see_its_key_in_its_column_only(device):
    weights = torch.softmax(torch.randn(1, 4, 5, dtype=torch.float64, device=device), dim=-1)
    allowed = torch.ones(4, 5, dtype=torch.bool, device=device).tril()  # row i sees keys 0..i
    weights = weights.masked_fill(~allowed, 0.0)
    values = torch.randn(1, 5, 3, dtype=torch.float64, device=device)
    values[0, 2, 1] = NAN  # key 2: rows 2 and 3 see it
    values[0, 4, 0] = INF  # key 4: row 3 does not see it (row 3 sees keys 0..3)
    out = weighted_values(weights, values, allowed)
    reached = torch.zeros(1, 4, 3, dtype=torch.bool, device=device)
    reached[0, 2:, 1] = True
    assert torch.equal(torch.isnan(out), reached)
    clean = weights @ values.nan_to_num(0.0, 0.0)
    torch.testing.assert_close(out[~reached], clean[~reached])
    unmasked = weighted_values(weights, values, None)  # without a mask: the plain product
    assert torch.equal(unmasked.isnan(), (weights @ values).isnan())


def test_a_nan_value_at_a_padded_key_reaches_no_row(device):
    q, k, v = (torch.randn(1, 2, 4, 3, dtype=torch.float64, device=device) for _ in range(3))
    v[0, :, 1] = NAN
    key_mask = torch.tensor([[True, False, True, True]], device=device)
    out = attention(q, k, v, key_mask=key_mask, backend="reference")
    keep = [0, 2, 3]
    want = attention(q, k[:, :, keep], v[:, :, keep], backend="reference")
    torch.testing.assert_close(out, want)


def test_differentiable_grads_are_the_wanted_gradients_and_can_be_differentiated_again(device):
    q, k, v = (
        torch.randn(1, 2, 4, 3, dtype=torch.float64, requires_grad=True, device=device)
        for _ in range(3)
    )
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64, requires_grad=True, device=device)
    call = checked_call(q, k, v, causal=True, alibi_slopes=slopes)
    dout = torch.randn(1, 2, 4, 3, dtype=torch.float64, device=device)
    wanted = (True, False, True, True, False)
    got = differentiable_grads(call, dout, None, wanted)
    assert got[1] is None and got[4] is None
    out = attention(q, k, v, causal=True, alibi_slopes=slopes, backend="reference")
    want = torch.autograd.grad(out, (q, v, slopes), dout, create_graph=True)
    for g, w in zip((got[0], got[2], got[3]), want):
        torch.testing.assert_close(g, w)
    (second,) = torch.autograd.grad(got[0].square().sum(), k)  # through dq to k
    (second_want,) = torch.autograd.grad(want[0].square().sum(), k)
    torch.testing.assert_close(second, second_want)


def test_weights_after_dropout_are_those_the_values_were_multiplied_by(device):
    from attnkit import attention

    q, k, v = (torch.randn(2, h, t, 8, device=device) for h, t in ((4, 6), (2, 9), (2, 9)))
    q.requires_grad_()
    out, dropped = attention(q, k, v, causal=True, dropout_p=0.5, return_weights="dropped")
    expected = dropped.detach() @ v.repeat_interleave(2, dim=1)  # GQA: 2 query heads a kv head
    torch.testing.assert_close(out.detach(), expected)
    kept = dropped != 0
    assert 0 < kept.float().mean() < 0.5  # about half of the causal half
    torch.manual_seed(1)
    _, before = attention(q, k, v, causal=True, dropout_p=0.5, return_weights=True)
    torch.manual_seed(1)
    _, after = attention(q, k, v, causal=True, dropout_p=0.5, return_weights="dropped")
    torch.testing.assert_close(after, torch.where(after != 0, before * 2, 0.0))
    assert torch.autograd.grad(dropped.sum(), q)[0].abs().sum() > 0
    no_dropout = attention(q, k, v, return_weights="dropped")[1]
    torch.testing.assert_close(no_dropout, attention(q, k, v, return_weights=True)[1])
    with pytest.raises(TypeError, match="return_weights must be a bool or 'dropped', got str 'x'"):
        attention(q, k, v, return_weights="x")
