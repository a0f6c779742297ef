"""Top-k sparse attention in PyTorch operations: for a block of queries, the rows of K and V that
their indices name are gathered, ``(b, h_kv, rows, n, d)``, and each query's softmax runs over its
own ``n`` keys with the reference's rules ([`attnkit.rules.exact`][attnkit.rules.exact]: the
same masked softmax and the same NaN rule). Ordinary differentiable operations: every transform,
``torch.compile``, gradients of any order; autograd keeps each block's gathered rows, so a call
holds ``O(t * n * d)`` for its backward. The C++ kernel ([`attnkit.sparse.native`][attnkit.sparse.native])
keeps none.

Shapes: ``b`` batch, ``h`` query heads, ``h_kv`` key/value heads, ``g = h / h_kv``, ``t``
queries, ``s`` keys, ``n`` indices per query, ``d``/``d_v`` head dims.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit.call import Call
from attnkit.masks import Masks, selection_mask
from attnkit.rules.exact import masked_softmax, weighted_values
from attnkit.rules.nonfinite import nan_unless_finite

GATHERED = 2**24
"""The most elements of gathered keys and values one block of queries holds (64 MiB of float32)."""


def visible(indices: Tensor, masks: Masks, rows: tuple[int, int], t: int, s: int) -> Tensor:
    """``(b, 1 or h_kv, rows, n)`` bool: whether each slot of the indices of queries ``rows``
    names a key the query may see: in ``0..s-1`` (-1 and any index outside select nothing),
    inside the causal limit and the window, not padding, and not named by an earlier slot of the
    same query (a key counts once). ``O(rows * n)``: the positions are compared, no mask made."""
    i0, i1 = rows
    chosen = indices[:, :, i0:i1].long()
    valid = (chosen >= 0) & (chosen < s)
    where = chosen.clamp(0, max(s - 1, 0))
    if masks.window is not None:
        left, right = masks.window
        position = torch.arange(i0, i1, device=indices.device)[:, None] + (s - t + masks.shift)
        if left >= 0:
            valid &= where >= position - left
        if right >= 0:
            valid &= where <= position + right
    if masks.key_mask is not None:
        real = masks.key_mask[:, None, None, :].expand(-1, where.shape[1], i1 - i0, -1)
        valid &= real.gather(-1, where)
    ordered, order = chosen.sort(dim=-1, stable=True)
    again = torch.zeros_like(valid)
    again[..., 1:] = ordered[..., 1:] == ordered[..., :-1]
    return valid & ~again.scatter(-1, order, again)


def attend(call: Call) -> tuple[Tensor, Tensor]:
    """``(out (b, h, t, d_v), lse (b, h, t))`` of ``call`` (its ``indices`` set), block by block
    of queries, in the statistics' dtype (float32, float64 for float64); the output in v's."""
    q, k, v, indices = call.q, call.k, call.v, call.indices
    b, h, t, d = q.shape
    h_kv, s, dv = k.shape[1], k.shape[2], v.shape[-1]
    g, n = h // h_kv, indices.shape[-1]
    stats = torch.promote_types(q.dtype, torch.float32)
    if n == 0:  # no query selects a key: 0, lse -inf (sums over nothing: gradients reach q, k, v)
        nothing = q[..., :0].sum(-1, keepdim=True) + k[:, :1, :0].sum() + v[:, :1, :0].sum()
        return nothing.expand(b, h, t, dv).to(v.dtype), nothing.squeeze(-1).to(stats) - math.inf
    rows = max(1, GATHERED // max(1, b * h_kv * n * (d + dv)))
    outs, lses = [], []
    for i0 in range(0, t, rows):
        i1 = min(t, i0 + rows)
        valid = visible(indices, call.masks, (i0, i1), t, s)  # (b, 1 or h_kv, r, n)
        where = indices[:, :, i0:i1].long().clamp(0, s - 1).expand(b, h_kv, -1, -1)
        flat = where.reshape(b, h_kv, -1, 1)
        chosen = valid.expand(b, h_kv, -1, -1)[..., None]
        # a slot that names no visible key gathers zeros: its weight is 0, and 0 times a NaN
        # key of another query's would reach this query's gradient
        keys = torch.where(chosen, _rows(k, flat, i1 - i0, n), 0).to(stats)
        values = torch.where(chosen, _rows(v, flat, i1 - i0, n), 0).to(stats)
        block = q[:, :, i0:i1].reshape(b, h_kv, g, i1 - i0, 1, d).to(stats)
        scores = block @ keys.unsqueeze(2).transpose(-1, -2) * call.scale  # (b, h_kv, g, r, 1, n)
        allowed = valid.view(b, -1, 1, i1 - i0, 1, n)
        weights, lse = masked_softmax(nan_unless_finite(scores), allowed)
        out = weighted_values(weights, values.unsqueeze(2), allowed)  # (b, h_kv, g, r, 1, d_v)
        outs.append(out.view(b, h, i1 - i0, dv))
        lses.append(lse.view(b, h, i1 - i0))
    return torch.cat(outs, 2).to(v.dtype), torch.cat(lses, 2)


def _rows(x: Tensor, flat: Tensor, rows: int, n: int) -> Tensor:
    """The rows of ``x`` ``(b, h_kv, s, e)`` that ``flat`` ``(b, h_kv, rows * n, 1)`` names, as
    ``(b, h_kv, rows, n, e)``."""
    b, h_kv, _, e = x.shape
    return x.gather(2, flat.expand(-1, -1, -1, e)).view(b, h_kv, rows, n, e)


def weights(call: Call, lse: Tensor) -> Tensor:
    """The softmax weights ``(b, h, t, s)`` of ``call`` from its lse ``(b, h, t)``, zero off the
    selection and where the masks hide a key; differentiable (through the lse too), in q's dtype.
    ``(t, s)`` per head, as asked."""
    q, k = call.q, call.k
    b, h, t, d = q.shape
    h_kv, s = k.shape[1], k.shape[2]
    stats = lse.dtype
    scores = q.reshape(b, h_kv, h // h_kv, t, d).to(stats) @ k.to(stats).unsqueeze(2).mT
    scores = scores.view(b, h, t, s) * call.scale
    allowed = selection_mask(call.indices, h, s)
    others = call.masks.allowed(t, s, q.device)
    allowed = allowed if others is None else allowed & others
    finite_lse = lse.masked_fill(lse == float("-inf"), 0.0)[..., None]  # a row with no key: 0s
    probs = (scores - finite_lse).exp().masked_fill(~allowed, 0.0)
    return probs.to(q.dtype)
