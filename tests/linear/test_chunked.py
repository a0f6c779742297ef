"""attnkit.linear.chunked: the chunked form against the book's token loop in float64, outputs,
final states and every gradient, across chunk boundaries (a sequence of one token, shorter than a
chunk, one chunk exactly, one token over, many chunks), each form of the family, value heads
sharing query and key heads, and strong decays (no overflow: every exponent is a difference)."""

from __future__ import annotations

import pytest
import torch

from attnkit.linear.chunked import chunked
from attnkit.linear.reference import delta_rule_loop


def inputs(t, h_k=2, r=2, d_k=8, d_v=6, decay=0.3, dtype=torch.float32):
    h = h_k * r
    q = torch.nn.functional.normalize(torch.randn(t, h_k, d_k), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(t, h_k, d_k), dim=-1)
    v = torch.randn(t, h, d_v)
    g = -torch.rand(t, h) * decay
    beta = torch.rand(t, h)
    state = torch.randn(h, d_k, d_v)
    return [x.to(dtype) for x in (q, k, v, g, beta, state)]


def loop(q, k, v, g, beta, state):
    r = v.shape[1] // q.shape[1]
    return delta_rule_loop(q.repeat_interleave(r, 1), k.repeat_interleave(r, 1), v, g, beta, state)


FORMS = {
    "gated delta rule": (True, True),
    "delta rule (g=None)": (False, True),
    "gated linear attention (beta=None)": (True, False),
    "linear attention": (False, False),
}


@pytest.mark.parametrize("t", [1, 5, 8, 9, 29], ids=lambda t: f"t={t}")
@pytest.mark.parametrize("form", FORMS)
def test_outputs_and_final_state_match_the_token_loop(t, form):
    with_g, with_beta = FORMS[form]
    q, k, v, g, beta, state = inputs(t)
    g, beta = (g if with_g else None), (beta if with_beta else None)
    out, final = chunked(q, k, v, g, beta, state, chunk=8)
    f64 = [None if x is None else x.double() for x in (q, k, v, g, beta, state)]
    want, want_final = loop(*f64)
    torch.testing.assert_close(out, want.float())
    torch.testing.assert_close(final, want_final.float())


@pytest.mark.parametrize(
    "r", [1, 3], ids=["one value head a key head", "three value heads a key head"]
)
def test_every_gradient_matches_the_token_loops(r):
    leaves = [x.requires_grad_() for x in inputs(13, r=r)]
    out, final = chunked(*leaves, chunk=4)
    dout, dfinal = torch.randn_like(out), torch.randn_like(final)
    got = torch.autograd.grad((out, final), leaves, (dout, dfinal))
    f64 = [x.detach().double().requires_grad_() for x in leaves]
    want_out, want_final = loop(*f64)
    want = torch.autograd.grad((want_out, want_final), f64, (dout.double(), dfinal.double()))
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), got, want):
        torch.testing.assert_close(a, b.float(), msg=lambda m, name=name: f"d{name}: {m}")


def test_a_strong_decay_stays_finite_and_exact():
    q, k, v, g, beta, state = inputs(40, decay=60.0)  # exp(cum) of a chunk reaches 1e-300
    out, final = chunked(q, k, v, g, beta, state, chunk=16)
    want, want_final = loop(*(x.double() for x in (q, k, v, g, beta, state)))
    assert bool(out.isfinite().all()) and bool(final.isfinite().all())
    torch.testing.assert_close(out, want.float())
    torch.testing.assert_close(final, want_final.float())
