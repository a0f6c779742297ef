"""The chapter's first steps: attention as a dot product, a softmax and a weighted sum.

These functions keep every intermediate so a learner can print it; the modules in
[`attnkit.modules`][attnkit.modules] compute the same thing through [`attnkit.functional.attention`][attnkit.functional.attention].

Shapes: ``b`` batch, ``t`` tokens (queries), ``s`` keys, ``e`` embedding width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from attnkit import _checks
from attnkit.masks import causal_mask
from attnkit.rules.exact import masked_softmax

Normalize = Literal["softmax", "sum"]

JOURNEY_TOKENS: tuple[str, ...] = ("Your", "journey", "starts", "with", "one", "step")
"""The tokens of the chapter's running example, "Your journey starts with one step"."""

JOURNEY_EMBEDDINGS: tuple[tuple[float, float, float], ...] = (
    (0.43, 0.15, 0.89),  # Your
    (0.55, 0.87, 0.66),  # journey
    (0.57, 0.85, 0.64),  # starts
    (0.22, 0.58, 0.33),  # with
    (0.77, 0.25, 0.10),  # one
    (0.05, 0.80, 0.55),  # step
)
"""The chapter's 3-dimensional embedding of each of [`JOURNEY_TOKENS`][attnkit.textbook.JOURNEY_TOKENS]."""


@dataclass(frozen=True)
class AttentionResult:
    """Every step of one attention computation, for inspection.

    Attributes:
        scores: the raw dot products ``queries @ keys^T``, before scaling and masking, ``(..., t, s)``
            (``(..., s)`` for a single query).
        weights: the normalised attention weights, same shape as ``scores``; masked keys get 0.
        context: the weighted sums of the value rows, ``(..., t, e)`` (``(..., e)`` for one query).
        queries, keys, values: the projected inputs, where there are projections; else None.
    """

    scores: Tensor
    weights: Tensor
    context: Tensor
    queries: Tensor | None = None
    keys: Tensor | None = None
    values: Tensor | None = None

    def _repr_html_(self) -> str:
        """Jupyter shows the weights as a shaded table (the first matrix of a batch)."""
        from attnkit.views import heatmap_table

        weights = self.weights.detach()
        weights = (
            weights.reshape(-1, *weights.shape[-2:])[0] if weights.dim() > 1 else weights[None]
        )
        t, s = weights.shape
        caption = f"attention weights {tuple(self.weights.shape)}: query rows, key columns"
        return heatmap_table(
            weights, [str(i) for i in range(t)], [str(j) for j in range(s)], caption
        )


def attend(
    scores: Tensor,
    values: Tensor,
    *,
    mask: Tensor | None = None,
    normalize: Normalize = "softmax",
) -> AttentionResult:
    """Turn alignment scores into weights, then into a context vector (a weighted sum of rows).

    Args:
        scores: ``(..., s)`` scores of one or more queries over ``s`` keys; a single row ``(s,)`` is
            fine (e.g. one decoder step's scores over the encoder hidden states).
        values: ``(..., s, e)``, its leading dims broadcast against those of ``scores``: a ``(t, s)``
            score matrix with ``(s, e)`` values uses the same values for every query.
        mask: bool, broadcastable to ``scores``, True = may attend. A row with nothing to attend
            gets zero weights and a zero context.
        normalize: ``"softmax"``, or ``"sum"`` (scores divided by their row sum, the naive
            normalisation the chapter shows first; it assumes non-negative scores).

    Returns:
        An [`AttentionResult`][attnkit.textbook.AttentionResult] with ``scores``, ``weights`` (like ``scores``) and ``context``
        ``(..., e)``.

    Example:
        >>> hidden = torch.tensor([[0.21, 0.51, 1.25], [4.13, -41.3, 0.31], [3.2, 0.02, 9.44]])
        >>> attend(torch.tensor([13.0, 9.0, 9.0]), hidden).context
        tensor([ 0.3321, -0.2374,  1.3781])
    """
    _checks.check_tensor(scores, "scores")
    _checks.check_tensor(values, "values")
    _checks.check_floating(scores, "scores")
    _checks.check_rank(values, "values", tuple(range(2, 9)), "(..., keys, features)")
    _checks.check_same_dtype_device({"scores": scores, "values": values})
    if scores.dim() == 0 or scores.shape[-1] != values.shape[-2]:
        raise ValueError(
            f"scores (shape {tuple(scores.shape)}) must end in the number of value rows "
            f"({values.shape[-2]}, values shape {tuple(values.shape)})"
        )
    if mask is not None:
        _checks.check_tensor(mask, "mask")
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = may attend), got {mask.dtype}")
        if torch.broadcast_shapes(mask.shape, scores.shape) != scores.shape:
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape "
                f"{tuple(scores.shape)}"
            )

    if normalize == "softmax":
        weights, _ = masked_softmax(scores, mask)
    elif normalize == "sum":
        kept = scores if mask is None else scores.masked_fill(~mask, 0.0)
        total = kept.sum(dim=-1, keepdim=True)
        weights = kept / total.masked_fill(total == 0, 1.0)
    else:
        raise ValueError(f"normalize must be 'softmax' or 'sum', got {normalize!r}")

    # A weighted sum of the value ROWS: (..., 1, s) @ (..., s, e) -> (..., 1, e) -> (..., e).
    context = (weights.unsqueeze(-2) @ values).squeeze(-2)
    return AttentionResult(scores=scores, weights=weights, context=context)


def simple_self_attention(
    inputs: Tensor, *, normalize: Normalize = "softmax", causal: bool = False
) -> AttentionResult:
    """Self-attention without trainable weights: every token is its own query, key and value.

    ``scores = inputs @ inputs^T`` (no scaling), ``weights = softmax(scores)`` over the keys,
    ``context = weights @ inputs``.

    Args:
        inputs: ``(t, e)`` or ``(b, t, e)`` token embeddings.
        normalize: ``"softmax"``, or ``"sum"`` for the naive row-sum normalisation.
        causal: if True, token ``i`` attends only to tokens ``0..i``.

    Returns:
        [`AttentionResult`][attnkit.textbook.AttentionResult] with ``scores`` and ``weights`` ``(..., t, t)`` and ``context``
        ``(..., t, e)``.

    Example:
        >>> x = torch.tensor(JOURNEY_EMBEDDINGS)
        >>> simple_self_attention(x).context[1]  # the query "journey"
        tensor([0.4419, 0.6515, 0.5683])
    """
    _checks.check_tensor(inputs, "inputs")
    _checks.check_rank(inputs, "inputs", (2, 3), "(tokens, features) or (batch, tokens, features)")
    _checks.check_floating(inputs, "inputs")
    t = inputs.shape[-2]
    attn_scores = inputs @ inputs.transpose(-2, -1)  # (..., t, e) x (..., e, t) -> (..., t, t)
    mask = causal_mask(t, t, device=inputs.device) if causal else None
    # unsqueeze(-3): the same t value rows serve every query row.
    result = attend(attn_scores, inputs.unsqueeze(-3), mask=mask, normalize=normalize)
    return result
