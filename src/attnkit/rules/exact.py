"""Attention written out as the equations, every intermediate materialised, in float64: the
maths of the reference backend ([`attnkit.backends.reference`][attnkit.backends.reference]) and the
oracle the other backends are held to.

Like flash-attn's ``attention_ref``, it supports every option, returns weights and the
log-sum-exp, and computes in float64 whatever the input dtype (the results are cast back). Every
operation is an ordinary differentiable torch operation, so gradients of any order, forward-mode
AD, ``torch.func`` transforms and ``torch.jit.trace`` work through it; the fused backends' double
backward recomputes the call here ([`differentiable_grads`][attnkit.rules.exact.differentiable_grads]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit import block_mask, mods
from attnkit.call import AttentionOutput, Call
from attnkit.masks import alibi_bias, selection_mask
from attnkit.rules.nonfinite import NAN, nan_unless_finite


def masked_softmax(
    scores: Tensor, allowed: Tensor | None = None, sink: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Softmax over the allowed entries of the last dim: zeros, not NaN, for a row with no allowed
    entry; masked entries get weight 0 even in a row that a NaN score makes NaN.

    Args:
        scores: ``(..., s)``; ``-inf`` entries count as masked.
        allowed: bool, broadcastable to ``scores``, True = may attend; None allows all.
        sink: a logit broadcastable to ``(..., 1)`` that joins every row's denominator (an
            entry of its own, always allowed, whose weight is left out of the result).

    Returns:
        ``(weights, lse)``: weights like ``scores``, and the log-sum-exp ``(...)`` of the allowed
        scores, ``-inf`` for an empty row. Gradients are zero (finite) for an empty row.
    """
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if sink is not None:
        scores = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
        if allowed is not None:
            allowed = torch.cat([allowed.expand((*scores.shape[:-1], -1)), _ones(scores)], -1)
    # Subtracting the row max keeps exp() in range; it does not change the result, so it is detached.
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = row_max.masked_fill(row_max == float("-inf"), 0.0)  # empty row: exp(-inf) = 0 below
    exp_scores = torch.exp(scores - row_max)
    row_sum = exp_scores.sum(dim=-1, keepdim=True)
    empty = row_sum == 0
    safe_sum = row_sum.masked_fill(empty, 1.0)
    weights = exp_scores / safe_sum
    if allowed is not None:  # a NaN row: exp(-inf - nan) is NaN at the masked entries too
        weights = weights.masked_fill(~allowed, 0.0)
    lse = (row_max + safe_sum.log()).masked_fill(empty, float("-inf")).squeeze(-1)
    return (weights if sink is None else weights[..., :-1]), lse


def _ones(scores: Tensor) -> Tensor:
    return torch.ones(*scores.shape[:-1], 1, dtype=torch.bool, device=scores.device)


def weighted_values(weights: Tensor, values: Tensor, allowed: Tensor | None) -> Tensor:
    """``weights @ values`` ``(..., t, s) x (..., s, d_v)``, where a value only reaches the rows
    that see its key: a masked key's weight is 0, but 0 times a NaN or infinite value would still be
    NaN. A non-finite value reaches the columns it is in, of every row that sees its key."""
    if allowed is None:
        return weights @ values
    finite = torch.isfinite(values)
    context = weights @ values.where(finite, 0.0)
    touched = allowed.to(values.dtype) @ (~finite).to(values.dtype)  # (..., t, d_v): > 0 if seen
    return context.masked_fill(touched > 0, NAN)


def reference(call: Call) -> AttentionOutput:
    """Materialised attention; shapes ``q (b, h, t, d)``, ``k (b, h_kv, s, d)``, ``v (b, h_kv, s, d_v)``.

    Computed in float64; the output and weights come back in the input dtype, the lse in float32
    (float64 for float64 inputs), as on every backend. The padded keys and values come zeroed
    (the registry zeroes them before any backend that reads them runs).
    """
    q, k, v = call.q, call.k, call.v
    t, s = q.shape[-2], k.shape[-2]
    f64 = torch.float64
    stats_dtype = torch.promote_types(q.dtype, torch.float32)  # of the lse, and a mod's scores
    groups = q.shape[1] // k.shape[1]  # query heads per key/value head: head i uses i // groups
    queries = q.to(f64)
    keys, values = k.to(f64), v.to(f64)
    keys = keys.repeat_interleave(groups, dim=1)  # (b, h_kv, s, d) -> (b, h, s, d)
    values = values.repeat_interleave(groups, dim=1)  # (b, h_kv, s, d_v) -> (b, h, s, d_v)

    attn_scores = queries @ keys.transpose(-2, -1)  # (b, h, t, d) x (b, h, d, s) -> (b, h, t, s)
    attn_scores = attn_scores * call.scale
    if call.softcap is not None:  # tanh(inf) = 1 would hide an infinite input
        attn_scores = nan_unless_finite(attn_scores)
        attn_scores = call.softcap * torch.tanh(attn_scores / call.softcap)
    if call.alibi_slopes is not None:
        slopes = call.alibi_slopes.to(f64)
        attn_scores = attn_scores + alibi_bias(slopes, t, s, shift=call.masks.shift)
    allowed = call.masks.allowed(t, s, q.device)
    if call.score_mod is not None:  # a -inf it returns masks the key
        attn_scores = nan_unless_finite(attn_scores)
        b, h = q.shape[:2]
        at = mods.Block.of(range(b), range(h), range(t), range(s), q.device)
        attn_scores = mods.score(call.score_mod, attn_scores, at, also=stats_dtype)
        allowed = _both(allowed, attn_scores != float("-inf"))
    if call.block_mask is not None:
        b, h = q.shape[:2]
        allowed = _both(allowed, block_mask.allowed(call.block_mask, b, h))
    if call.indices is not None:  # top-k sparse attention: the keys each query selects
        allowed = _both(allowed, selection_mask(call.indices, q.shape[1], s))
    bias = call.masks.bias()
    if bias is not None:
        attn_scores = attn_scores + bias.to(f64)
    attn_scores = nan_unless_finite(attn_scores)  # a -inf bias still masks: allowed() says so

    sink = None if call.sinks is None else call.sinks.to(f64).view(1, -1, 1, 1)
    attn_weights, lse = masked_softmax(attn_scores, allowed, sink)
    dropped = F.dropout(attn_weights, call.dropout_p) if call.dropout_p else attn_weights
    context = weighted_values(dropped, values, allowed)  # (b, h, t, s) x (b, h, s, d_v)
    return AttentionOutput(
        out=context.to(v.dtype),
        lse=lse.to(stats_dtype) if call.return_lse else None,
        weights=(dropped if call.return_weights == "dropped" else attn_weights).to(q.dtype)
        if call.return_weights
        else None,
    )


def _both(a: Tensor | None, b: Tensor) -> Tensor:
    return b if a is None else a & b


def differentiable_grads(
    call: Call, dout: Tensor | None, dlse: Tensor | None, wanted: tuple[bool, ...]
) -> list[Tensor | None]:
    """The gradients of q, k, v, the ALiBi slopes, a float mask, the tensors a ``score_mod``
    reads and the sinks (those ``wanted``, in that order; a ``wanted`` that stops short wants
    none of the rest) given the output's and the lse's (None: unused), as functions of the
    inputs: for the backward of a fused kernel run with ``create_graph=True``. This backend
    recomputes the call and autograd differentiates that, so the second derivatives are exact, at
    this backend's ``O(t s)`` memory."""
    out, lse, _ = reference(call._replace(return_lse=dlse is not None))
    outputs, cotangents = [], []
    for output, grad in ((out, dout), (lse, dlse)):
        if grad is not None:
            outputs.append(output)
            cotangents.append(grad.to(output.dtype))
    every = (*call.tensors()[:5], *call.mod_tensors, call.sinks)  # q, k, v, the slopes, ...
    inputs = [x for x, w in zip(every, wanted) if w]
    grads = torch.autograd.grad(outputs, inputs, cotangents, create_graph=True, allow_unused=True)
    found = iter(grads)
    return [next(found) if w else None for w in wanted]
