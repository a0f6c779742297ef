"""Scores of the standard roles a causal attention head takes, each a number in [0, 1].

For weights ``attn_weights`` ``(..., t, t)`` of a causal head (row ``i`` a query, summing to 1
over keys ``0..i``), over the queries ``i = 1 .. t-1`` (the first query can attend only to
itself, so it says nothing) and then over every leading dimension (probes, heads):

- ``previous_token``: the mean weight on the token before, ``attn_weights[i, i - 1]``;
- ``first_token``: the mean weight on position 0 (an attention *sink*), ``attn_weights[i, 0]``;
- ``self``: the mean weight on the token itself, ``attn_weights[i, i]``;
- ``induction``: on a sequence of ``n`` tokens written twice (``t = 2n``), the mean weight from each
  token of the second half on the token that followed its first occurrence,
  ``attn_weights[n + j, j + 1]`` for ``j = 0 .. n-1``.

An exact previous-token head scores 1 as a previous-token head; a uniform head (``1 / (i + 1)`` on
each key) scores the mean of ``1 / (i + 1)``, about ``ln(t) / t``.

Shapes: ``t`` tokens; any leading dimensions before the last two.
"""

from __future__ import annotations

import torch
from torch import Tensor

ROLES = ("previous_token", "first_token", "self", "induction")


def _check(attn_weights: Tensor) -> int:
    if attn_weights.dim() < 2 or attn_weights.shape[-1] != attn_weights.shape[-2]:
        raise ValueError(f"attn_weights must be (..., t, t), got shape {tuple(attn_weights.shape)}")
    t = attn_weights.shape[-1]
    if t < 2:
        raise ValueError(f"role scores need at least 2 tokens, got {t}")
    return t


def previous_token_score(attn_weights: Tensor) -> Tensor:
    """The mean weight of queries ``1..t-1`` on the token before: ``(..., t, t) -> (...)``."""
    _check(attn_weights)
    return attn_weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1)  # (..., t - 1) -> (...)


def first_token_score(attn_weights: Tensor) -> Tensor:
    """The mean weight of queries ``1..t-1`` on position 0: ``(..., t, t) -> (...)``."""
    _check(attn_weights)
    return attn_weights[..., 1:, 0].mean(-1)  # (..., t - 1) -> (...)


def self_score(attn_weights: Tensor) -> Tensor:
    """The mean weight of queries ``1..t-1`` on themselves: ``(..., t, t) -> (...)``."""
    _check(attn_weights)
    return attn_weights.diagonal(dim1=-2, dim2=-1)[..., 1:].mean(-1)  # (..., t - 1) -> (...)


def induction_score(attn_weights: Tensor) -> Tensor:
    """On a sequence written twice (``t = 2n``), the mean weight from query ``n + j`` on key
    ``j + 1``, the token after the first occurrence of its own token: ``(..., t, t) -> (...)``."""
    t = _check(attn_weights)
    if t % 2:
        raise ValueError(f"the induction score needs a sequence written twice (even t), got t={t}")
    n = t // 2
    # query n + j, key j + 1: the diagonal n - 1 below the main one, from row n on
    return attn_weights.diagonal(offset=-(n - 1), dim1=-2, dim2=-1)[..., 1:].mean(-1)


SCORES = {
    "previous_token": previous_token_score,
    "first_token": first_token_score,
    "self": self_score,
    "induction": induction_score,
}
"""Each role's score function, by name."""


def role_scores(attn_weights: Tensor, repeated_weights: Tensor) -> dict[str, Tensor]:
    """Every role's score per head.

    Args:
        attn_weights: ``(L, p, h, t, t)``, the weights on ``p`` held-out probes.
        repeated_weights: ``(L, p, h, 2n, 2n)``, the weights on probes written twice.

    Returns:
        ``{role: (L, h)}``, each score the mean over the probes.
    """
    return {
        "previous_token": previous_token_score(attn_weights).mean(1),
        "first_token": first_token_score(attn_weights).mean(1),
        "self": self_score(attn_weights).mean(1),
        "induction": induction_score(repeated_weights).mean(1),
    }


def uniform_causal(t: int) -> Tensor:
    """A uniform causal head's weights ``(t, t)``: query ``i`` gives ``1 / (i + 1)`` to keys
    ``0..i`` (the head that has learnt nothing)."""
    mask = torch.ones(t, t).tril()
    return mask / mask.sum(-1, keepdim=True)
