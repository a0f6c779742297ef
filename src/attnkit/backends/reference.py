"""The reference backend: attention written out as the equations, every intermediate materialised.

It is the single source of truth inside attnkit (like flash-attn's ``attention_ref``): it supports
every option, returns weights and the log-sum-exp, and runs in float64. It is also the slowest path
and needs ``O(t * s)`` memory per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.backends.base import AttentionOutput, Request
from attnkit.masks import alibi_bias


def masked_softmax(scores: Tensor, allowed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Softmax over the last dim that gives zeros, not NaN, for a row with no allowed entry.

    Args:
        scores: ``(..., s)``; ``-inf`` entries count as masked.
        allowed: bool, broadcastable to ``scores``, True = may attend; None allows all.

    Returns:
        ``(weights, lse)``: weights like ``scores``, and the log-sum-exp ``(...)`` of the allowed
        scores, ``-inf`` for an empty row. Gradients are zero (finite) for an empty row.
    """
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    # Subtracting the row max keeps exp() in range; it does not change the result, so it is detached.
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = row_max.masked_fill(row_max == float("-inf"), 0.0)  # empty row: exp(-inf) = 0 below
    exp_scores = torch.exp(scores - row_max)
    row_sum = exp_scores.sum(dim=-1, keepdim=True)
    empty = row_sum == 0
    safe_sum = row_sum.masked_fill(empty, 1.0)
    weights = exp_scores / safe_sum
    lse = (row_max + safe_sum.log()).masked_fill(empty, float("-inf")).squeeze(-1)
    return weights, lse


def reference(q: Tensor, k: Tensor, v: Tensor, request: Request) -> AttentionOutput:
    """Materialised attention; shapes ``q (b, h, t, d)``, ``k (b, h_kv, s, d)``, ``v (b, h_kv, s, d_v)``.

    Scores and softmax statistics are computed in float32 for half-precision inputs (float64 for
    float64); the weights are cast back to the input dtype before they multiply ``v``.
    """
    t, s = q.shape[-2], k.shape[-2]
    groups = (
        q.shape[1] // k.shape[1]
    )  # query heads per key/value head (GQA); head i uses kv i // groups
    keys = k.repeat_interleave(groups, dim=1)  # (b, h_kv, s, d) -> (b, h, s, d)
    values = v.repeat_interleave(groups, dim=1)  # (b, h_kv, s, d_v) -> (b, h, s, d_v)
    stats_dtype = torch.promote_types(q.dtype, torch.float32)

    attn_scores = (q @ keys.transpose(-2, -1)).to(stats_dtype)  # (b, h, t, d) x (b, h, d, s)
    attn_scores = attn_scores * request.scale  # -> (b, h, t, s)
    if request.softcap is not None:
        attn_scores = request.softcap * torch.tanh(attn_scores / request.softcap)
    if request.alibi_slopes is not None:
        attn_scores = attn_scores + alibi_bias(request.alibi_slopes.to(stats_dtype), t, s)
    bias = request.masks.bias()
    if bias is not None:
        attn_scores = attn_scores + bias.to(stats_dtype)

    attn_weights, lse = masked_softmax(attn_scores, request.masks.allowed(t, s, q.device))
    dropped = F.dropout(attn_weights, request.dropout_p) if request.dropout_p else attn_weights
    context = dropped.to(v.dtype) @ values  # (b, h, t, s) x (b, h, s, d_v) -> (b, h, t, d_v)
    return AttentionOutput(
        out=context,
        lse=lse if request.return_lse else None,
        weights=attn_weights.to(q.dtype) if request.return_weights else None,
    )
