"""attnkit.tiled.autograd: the spec the autograd function keeps of a call (no tensors),
a partial result in the statistics' dtype (for ring attention), and the vmap rule that folds the
mapped dim into the batch (one call) except for per-example ALiBi slopes (one call each)."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.functional import attention, checked_call
from attnkit.tiled import autograd as tiled_function
from attnkit.tiled.autograd import TiledAttention, partial, plan_of


def qkv(dtype=torch.float32, b=2, h=4, h_kv=2, t=9, s=13):
    return (
        torch.randn(b, h, t, 8, dtype=dtype),
        torch.randn(b, h_kv, s, 8, dtype=dtype),
        torch.randn(b, h_kv, s, 6, dtype=dtype),
    )


def test_the_plan_keeps_the_call_without_its_tensors_and_binds_a_passs_tensors():
    q, k, v = qkv()
    table = torch.randn(4, requires_grad=True)

    def scaled(score, b, h, q_idx, kv_idx):
        return score * table[h]

    call = checked_call(
        q,
        k,
        v,
        causal=True,
        key_mask=torch.rand(2, 13) > 0.3,
        attn_mask=torch.randn(9, 13),
        alibi_slopes=torch.rand(4),
        softcap=5.0,
        score_mod=scaled,
    )
    assert call.mod_tensors == (table,)
    plan = plan_of(call)
    assert plan.call.tensors() == (None,) * 6 and plan.call.mod_tensors == ()
    assert (plan.route.block_q, plan.route.block_k) == (5, 7)  # the tests' blocks (conftest)
    kept = ("scale", "softcap", "score_mod", "options", "return_lse")
    assert all(getattr(plan.call, name) == getattr(call, name) for name in kept)
    assert plan.call.masks.window == call.masks.window
    bound = plan.bound(call)  # what a pass runs on: the call's tensors, the plan's sizes
    assert bound.call is call and (bound.b, bound.h_kv, bound.groups, bound.t, bound.s) == (
        2,
        2,
        2,
        9,
        13,
    )
    assert (bound.block_q, bound.route, bound.dropout) == (plan.block_q, plan.route, plan.dropout)


@pytest.mark.parametrize(
    ("dtype", "stats"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_a_partial_result_stays_in_the_statistics_dtype(dtype, stats):
    q, k, v = qkv(dtype)
    out, lse = partial(checked_call(q, k, v, causal=True, return_lse=True))
    assert (out.dtype, lse.dtype) == (stats, stats)
    assert out.shape == (2, 4, 9, 6) and lse.shape == (2, 4, 9)
    exact, exact_lse = attention(
        *(x.double() for x in (q, k, v)), causal=True, return_lse=True, backend="reference"
    )
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out, exact.to(stats), **tolerance)
    torch.testing.assert_close(lse, exact_lse.to(stats), **tolerance)
    rounded = attention(q, k, v, causal=True, backend="tiled")  # rounded once, at the end
    assert torch.equal(out.to(dtype), rounded)


def test_a_partial_result_zeroes_the_padding_it_is_handed():
    q, k, v = qkv()
    key_mask = torch.ones(2, 13, dtype=torch.bool)
    key_mask[:, 3] = False
    v[:, :, 3] = math.nan  # padding may hold anything
    out, lse = partial(checked_call(q, k, v, key_mask=key_mask, return_lse=True))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    keep = [j for j in range(13) if j != 3]
    torch.testing.assert_close(out, attention(q, k[:, :, keep], v[:, :, keep], backend="tiled"))


def counted_forward(monkeypatch):
    """The number of times the autograd function's forward runs, from now on."""
    calls = []
    forward = tiled_function.forward
    monkeypatch.setattr(
        tiled_function, "forward", lambda *a, **kw: calls.append(1) or forward(*a, **kw)
    )
    return calls


def apply(q, k, v, slopes=None, key_mask=None, **options):
    call = checked_call(q, k, v, alibi_slopes=slopes, key_mask=key_mask, **options)
    return TiledAttention.apply(q, k, v, slopes, None, key_mask, plan_of(call))


def test_under_vmap_the_mapped_dim_joins_the_batch_in_one_call(monkeypatch):
    examples = [qkv() for _ in range(3)]
    q, k, v = (torch.stack(x) for x in zip(*examples))  # (3, b, ...)
    key_mask = torch.rand(3, 2, 13) > 0.2
    key_mask[..., 0] = True
    calls = counted_forward(monkeypatch)
    out, lse = torch.vmap(lambda *x: apply(*x[:3], None, x[3], causal=True))(q, k, v, key_mask)
    assert len(calls) == 1
    for i in range(3):
        want, want_lse = apply(q[i], k[i], v[i], None, key_mask[i], causal=True)
        torch.testing.assert_close(out[i], want)
        torch.testing.assert_close(lse[i], want_lse)


def test_under_vmap_per_example_slopes_make_one_call_per_example(monkeypatch):
    q, k, v = qkv()
    slopes = torch.rand(3, 4)
    calls = counted_forward(monkeypatch)
    out, _ = torch.vmap(lambda s: apply(q, k, v, s), in_dims=0)(slopes)
    assert len(calls) == 3
    for i in range(3):
        torch.testing.assert_close(out[i], apply(q, k, v, slopes[i])[0])
    before = len(calls)
    shared = torch.vmap(lambda q: apply(q, k, v, slopes[0])[0])(torch.stack([q, 2 * q]))
    assert len(calls) == before + 1  # shared slopes: the batch folds again
    torch.testing.assert_close(shared[1], apply(2 * q, k, v, slopes[0])[0])


def test_its_gradients_are_those_of_the_float64_reference():
    q, k, v = (x.double().requires_grad_() for x in qkv())
    slopes = torch.rand(4, dtype=torch.float64, requires_grad=True)
    out, lse = apply(q, k, v, slopes, causal=True, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out, lse), (q, k, v, slopes), (dout, dlse))
    want_out, want_lse = attention(
        q, k, v, causal=True, alibi_slopes=slopes, return_lse=True, backend="reference"
    )
    want = torch.autograd.grad((want_out, want_lse), (q, k, v, slopes), (dout, dlse))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
