"""attnkit.linear.reference: the book's token loop, held against two steps written out by hand
(forget, predict, correct, write, read), in each of its three forms, and differentiable by
autograd through the loop (gradcheck and gradgradcheck in float64)."""

from __future__ import annotations

import pytest
import torch

from attnkit.linear.reference import delta_rule_loop


def two_tokens():
    q, k = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)
    v = torch.randn(2, 3, 5, dtype=torch.float64)
    g = -torch.rand(2, 3, dtype=torch.float64)
    beta = torch.rand(2, 3, dtype=torch.float64)
    state = torch.randn(3, 4, 5, dtype=torch.float64)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("form", ["gated delta rule", "delta rule", "gated linear attention"])
def test_two_steps_are_the_books_equations_written_out(form):
    q, k, v, g, beta, state = two_tokens()
    g = None if form == "delta rule" else g
    beta = None if form == "gated linear attention" else beta
    out, final = delta_rule_loop(q, k, v, g, beta, state)
    s = state.clone()
    for i in range(2):
        for head in range(3):
            m = s[head] * (1.0 if g is None else g[i, head].exp())  # forget
            predicted = m.T @ k[i, head]
            write = v[i, head] if beta is None else (v[i, head] - predicted) * beta[i, head]
            s[head] = m + torch.outer(k[i, head], write)
            torch.testing.assert_close(out[i, head], s[head].T @ q[i, head])
    torch.testing.assert_close(final, s)


def test_a_key_written_with_beta_1_is_recalled_exactly():
    """The delta rule's point: with beta = 1 and a unit key, reading that key returns the value
    just written, whatever the memory held (plain linear attention would add to it)."""
    k = torch.nn.functional.normalize(torch.randn(1, 1, 4, dtype=torch.float64), dim=-1)
    v = torch.randn(1, 1, 3, dtype=torch.float64)
    state = torch.randn(1, 4, 3, dtype=torch.float64)
    out, _ = delta_rule_loop(k, k, v, None, torch.ones(1, 1, dtype=torch.float64), state)
    torch.testing.assert_close(out[0, 0], v[0, 0])
    plain, _ = delta_rule_loop(k, k, v, None, None, state)
    assert not torch.allclose(plain[0, 0], v[0, 0])


def test_gradcheck_and_gradgradcheck_through_every_input():
    inputs = [x.requires_grad_() for x in two_tokens()]
    torch.autograd.gradcheck(lambda *x: delta_rule_loop(*x), inputs)
    torch.autograd.gradgradcheck(lambda *x: delta_rule_loop(*x), inputs)
