"""Learned attention sinks (GPT-OSS's ``s_aux``), joined to attention computed without them.

A sink is one logit ``z_h`` per query head that joins the softmax denominator of every query of
that head and brings no value. Attention over the keys alone gives ``out`` and its log-sum-exp
``lse``; with the sink the denominator grows from ``exp(lse)`` to ``exp(lse) + exp(z_h)``, so

    lse' = logaddexp(lse, z_h),    out' = out * exp(lse - lse'),    weights' = weights * exp(lse - lse')

exactly, as ring attention merges the pieces of a row: the sink is one more piece, with output 0.
Gradients follow through ``lse``, whose gradient a kernel's backward takes (``D_i - dlse_i``), so
a backend that returns a differentiable lse runs sinks with its own kernels at the cost of one pass
over the output. A query with no visible key has ``lse = -inf`` and keeps output 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.call import AttentionOutput


def share_of_keys(lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """``(keep, lse')``, each ``(b, h, t)``: the keys' share ``exp(lse - lse')`` of each row once
    the sinks ``(h,)`` join its denominator (0 for a row with no key, NaN for a sink of +inf), and
    the row's log-sum-exp with the sink."""
    sink = sinks.to(lse.dtype).view(1, -1, 1)
    # A sink of -inf (none) would make lse' -inf in a row with no key, and lse - lse' NaN: it
    # joins as the dtype's lowest number (`join` makes such a row's lse -inf again).
    finite_sink = sink.clamp_min(torch.finfo(lse.dtype).min)
    total = torch.logaddexp(lse, finite_sink)
    keep = torch.exp(lse - total)
    # A sink of +inf is an infinite score: its rows are NaN, as the reference makes them.
    return keep.masked_fill(sink == float("inf"), float("nan")), total


def join(output: AttentionOutput, sinks: Tensor, return_lse: bool) -> AttentionOutput:
    """``output`` (of attention over the keys alone, with its lse ``(b, h, t)``) with ``sinks``
    ``(h,)`` joined to every row's denominator; the lse kept only where ``return_lse``."""
    out, lse, weights = output
    keep, total = share_of_keys(lse, sinks)
    out = (out * keep.unsqueeze(-1)).to(out.dtype)
    if weights is not None:  # a hidden key keeps weight 0, in a NaN row too
        weights = (weights * keep.unsqueeze(-1)).masked_fill(weights == 0, 0.0).to(weights.dtype)
    if return_lse:  # a row with no key and no sink: -inf again
        no_sink = (sinks == float("-inf")).view(1, -1, 1)
        total = total.masked_fill((lse == float("-inf")) & no_sink, float("-inf"))
    return AttentionOutput(out, total if return_lse else None, weights)
