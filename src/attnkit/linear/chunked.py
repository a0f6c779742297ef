"""The gated delta rule in chunks, in PyTorch operations: the form that trains on any device.

Within a chunk of ``C`` tokens the recurrence is solved at once: the corrections the tokens write
(``delta``) satisfy a unit lower-triangular system (the WY / UT transform of DeltaNet's paper,
Yang et al. 2024), so products and one triangular solve replace ``C`` sequential steps; across
chunks only the state travels. With the state ``S`` at the chunk's start, ``cum`` the running
sum of ``g`` inside it, ``D_ij = exp(cum_i - cum_j)`` for ``j <= i`` (0 above), and
``A = strictly_lower(diag(beta) K K^T * D)``::

    (I + A) delta = beta * V - (beta * exp(cum) * K) S      # the corrections
    O = exp(cum) * Q S + (Q K^T * D) delta                  # each token's read
    S' = exp(cum_C) S + (exp(cum_C - cum) * K)^T delta      # the state after the chunk

Every exponent is a difference ``cum_i - cum_j <= 0`` (``g <= 0``): no overflow, whatever the
chunk's decay. Without ``beta`` (no correction) ``delta = V``; without ``g``, ``D`` is the lower
triangle of ones.

Shapes: ``t`` tokens, ``h_k`` query/key heads, ``r = h / h_k`` value heads per key head (a query
and key head is read by each of its ``r`` value heads by broadcasting, never copied), ``d_k``,
``d_v`` head dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 64
"""Tokens solved at once: the triangular solve grows as ``C^2`` per token, the sequential part
as ``t / C``."""


def chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor | None,
    state: Tensor,
    chunk: int = CHUNK,
) -> tuple[Tensor, Tensor]:
    """One sequence in chunks, in the dtype of ``state`` (float32, or float64).

    Args:
        q: ``(t, h_k, d_k)``, normalised and scaled as the call asks.
        k: ``(t, h_k, d_k)``, normalised as the call asks.
        v: ``(t, h, d_v)``, ``h`` a multiple of ``h_k``.
        g: ``(t, h)`` log decays, or None.
        beta: ``(t, h)`` write strengths, or None.
        state: ``(h, d_k, d_v)``.

    Returns:
        ``(o, state)``: ``(t, h, d_v)`` in the state's dtype, and the state after the last token.
    """
    t, h_k = q.shape[:2]
    r = v.shape[1] // h_k
    dtype = state.dtype
    pad = -t % chunk  # padded tokens neither decay (g = 0) nor write (k = 0, beta = 0)
    n = (t + pad) // chunk

    def heads_first(x: Tensor) -> Tensor:
        """``(t, h_k, r or 1, ...)`` -> ``(h_k, r or 1, n, C, ...)``, zero-padded to whole chunks."""
        x = F.pad(x.to(dtype), (0, 0) * (x.dim() - 1) + (0, pad))
        x = x.reshape(n, chunk, *x.shape[1:])
        return x.permute(2, 3, 0, 1, *range(4, x.dim()))

    qc = heads_first(q[:, :, None])  # (h_k, 1, n, C, d_k)
    kc = heads_first(k[:, :, None])
    vc = heads_first(v.unflatten(1, (h_k, r)))  # (h_k, r, n, C, d_v)
    if g is None:
        cum = torch.zeros(h_k, r, n, chunk, dtype=dtype, device=v.device)
    else:
        cum = heads_first(g.unflatten(1, (h_k, r))).cumsum(dim=-1)  # (h_k, r, n, C)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    scores = (qc @ kc.transpose(-1, -2)) * decay  # (h_k, r, n, C, C), causal in the chunk
    if beta is None:
        delta_v, delta_k = vc, None
    else:
        b = heads_first(beta.unflatten(1, (h_k, r)))[..., None]  # (h_k, r, n, C, 1)
        system = ((b * kc) @ kc.transpose(-1, -2)) * decay  # A, with its diagonal
        system = system.tril(-1) + torch.eye(chunk, dtype=dtype, device=v.device)
        solve = torch.linalg.solve_triangular
        delta_v = solve(system, b * vc, upper=False, unitriangular=True)
        delta_k = solve(system, b * cum.exp()[..., None] * kc, upper=False, unitriangular=True)
    q_read = qc * cum.exp()[..., None]  # (h_k, r, n, C, d_k)
    k_write = kc * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # (h_k, r, n, 1, 1)
    s = state.unflatten(0, (h_k, r))  # (h_k, r, d_k, d_v)
    outputs = []
    for i in range(n):  # the state across chunks: the one sequential part
        delta = delta_v[:, :, i] if delta_k is None else delta_v[:, :, i] - delta_k[:, :, i] @ s
        outputs.append(q_read[:, :, i] @ s + scores[:, :, i] @ delta)
        s = s * chunk_decay[:, :, i] + k_write[:, :, i].transpose(-1, -2) @ delta
    o = torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :t]  # (h_k, r, t, d_v)
    return o.permute(2, 0, 1, 3).flatten(1, 2), s.flatten(0, 1)
