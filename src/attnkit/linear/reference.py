"""The gated delta rule as the book writes it: a loop over tokens that keeps one ``(d_k, d_v)``
state per head. It is the oracle of every other form, computed in float64, and kept readable
rather than fast.

For each value head, from the state ``S`` (zeros, or the initial state), token by token::

    S = S * exp(g_t)                      # forget: the gate decays the memory
    delta = (v_t - S^T k_t) * beta_t      # what the memory predicts for k_t, and the error
    S = S + k_t delta^T                   # write the correction (the delta rule)
    o_t = S^T q_t                         # read with the query

Without ``beta`` the memory is written without the correction (``S = S + k_t v_t^T``: gated
linear attention); without ``g`` it never decays (DeltaNet).

Shapes: ``t`` tokens, ``h`` value heads (each reads the query and key head ``i // (h / h_k)``),
``d_k`` query/key head dim, ``d_v`` value head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor


def delta_rule_loop(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor | None,
    state: Tensor,
) -> tuple[Tensor, Tensor]:
    """One sequence, token by token, in the inputs' dtype (the caller gives float64).

    Args:
        q: ``(t, h, d_k)``, already normalised and scaled as the call asks (the same head for
            every value head that reads it: ``h`` here is the value heads' count).
        k: ``(t, h, d_k)``, likewise normalised.
        v: ``(t, h, d_v)``.
        g: ``(t, h)`` log decays (``<= 0``), or None.
        beta: ``(t, h)`` write strengths, or None.
        state: ``(h, d_k, d_v)`` the state before the first token.

    Returns:
        ``(o, state)``: ``(t, h, d_v)`` outputs and the ``(h, d_k, d_v)`` state after the last
        token. Every step is out of place, so autograd differentiates through the loop.
    """
    outputs = []
    for i in range(q.shape[0]):
        q_t, k_t, v_t = q[i], k[i], v[i]  # (h, d_k), (h, d_k), (h, d_v)
        if g is not None:
            state = state * g[i].exp()[:, None, None]  # forget
        if beta is None:
            write = v_t  # plain (gated) linear attention: no correction
        else:
            predicted = torch.einsum("hkv,hk->hv", state, k_t)  # S^T k_t
            write = (v_t - predicted) * beta[i][:, None]  # the delta
        state = state + torch.einsum("hk,hv->hkv", k_t, write)  # S + k_t delta^T
        outputs.append(torch.einsum("hkv,hk->hv", state, q_t))  # S^T q_t
    return torch.stack(outputs), state
