"""attnkit.distributed.passes in one process: a ring of one rank whose exchange hands each tensor
back to itself (as a ring of one would), so that the forward merges the partial results of many
pieces of keys through their lse, and the backward brings the keys' gradients home, without a
process group. Against float64 attention of the whole sequence; real rings:
tests/distributed/test_ring.py."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit import force
from attnkit.distributed.passes import RingAttention, forward_pass
from attnkit.distributed.plan import RingPlan
from attnkit.distributed.transport import Ring
from attnkit.functional import attention, checked_call


class LoopbackRing(Ring):
    """A ring of one: what it sends to the next rank, it receives from the previous one."""

    def exchange(self, outgoing, incoming, what):
        assert len(outgoing) == len(incoming), what
        for sent, received in zip(outgoing, incoming):
            received.copy_(sent)
        return lambda: None


CASES = {
    "full": {},
    "causal": {"causal": True},
    "window, key padding": {"window": (3, 2), "key_mask": True},
    "causal, ALiBi, softcap, t < s": {"causal": True, "alibi": True, "softcap": 2.0, "s": 18},
    "rows that see no key": {"causal": True, "window": (1, 0), "key_mask": "sparse"},
}


def inputs(case):
    t, s = 12, case.get("s", 12)
    q = torch.randn(2, 4, t, 5, dtype=torch.float64)
    k, v = (torch.randn(2, 2, s, 5, dtype=torch.float64) for _ in range(2))
    options = {name: case[name] for name in ("causal", "window", "softcap") if name in case}
    if case.get("alibi"):
        options["alibi_slopes"] = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    if case.get("key_mask") is True:
        options["key_mask"] = torch.rand(2, s) > 0.3
    elif case.get("key_mask") == "sparse":  # batch row 1: keys 0, 5 and 9 only
        options["key_mask"] = torch.ones(2, s, dtype=torch.bool)
        options["key_mask"][1] = False
        options["key_mask"][1, [0, 5, 9]] = True
    return q, k, v, options


def plan_of(q, k, v, options):
    shard_call = checked_call(q, k, v, **options)
    t, s = q.shape[2], k.shape[2]
    window, causal = options.get("window"), options.get("causal", False)
    return RingPlan.of(
        LoopbackRing(None, 0, 1, 60.0), t, s, "contiguous", shard_call, causal, window, None
    )


@pytest.fixture(autouse=True)
def small_pieces():
    """Pieces of about 2 keys and 5 queries: six rounds of keys, unequal pieces of queries."""
    with force.pieces(2, 5):
        yield


@pytest.mark.parametrize("name", CASES)
def test_the_forward_merges_every_pieces_partial_result_into_the_whole_rows(name):
    q, k, v, options = inputs(CASES[name])
    plan = plan_of(q, k, v, options)
    assert len(plan.k_pieces[0]) == k.shape[2] // 2 and len(plan.q_pieces) == 3
    out, lse = forward_pass(q, k, v, options.get("alibi_slopes"), options.get("key_mask"), plan)
    want, want_lse = attention(q, k, v, return_lse=True, backend="reference", **options)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    if name == "rows that see no key":  # merged from nothing on both sides: 0 and -inf, not NaN
        empty = want_lse == -math.inf
        assert empty.any() and bool((out[empty] == 0).all())
        assert not out.isnan().any()


@pytest.mark.parametrize("name", CASES)
def test_the_backward_brings_each_pieces_key_gradients_home(name):
    q, k, v, options = inputs(CASES[name])
    slopes = options.get("alibi_slopes")
    leaves = [q, k, v] + ([slopes] if slopes is not None else [])
    leaves = [x.clone().requires_grad_() for x in leaves]
    if slopes is not None:
        options["alibi_slopes"] = leaves[3]
    plan = plan_of(*leaves[:3], options)
    out, lse = RingAttention.apply(
        *leaves[:3], options.get("alibi_slopes"), options.get("key_mask"), plan
    )
    dout, dlse = torch.randn_like(out), torch.randn_like(lse).masked_fill(lse.isinf(), 0)
    got = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    want_out, want_lse = attention(*leaves[:3], return_lse=True, backend="reference", **options)
    finite_lse = want_lse.masked_fill(want_lse.isinf(), 0)
    want = torch.autograd.grad((want_out, finite_lse), leaves, (dout, dlse))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_a_second_derivative_is_refused_not_wrong():
    q, k, v, options = inputs(CASES["causal"])
    q.requires_grad_()
    out, _ = RingAttention.apply(q, k, v, None, None, plan_of(q, k, v, options))
    with pytest.raises(RuntimeError, match="ring attention has no second derivative"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
