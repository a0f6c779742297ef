"""``scaled_dot_product_attention`` with torch's signature and torch 2.13's results, on attnkit.

Switch a model that calls torch's SDPA with one line::

    from attnkit.nn.functional import scaled_dot_product_attention  # was: from torch.nn.functional

It takes what torch's takes, in the same order, with the same defaults and the same behaviour on a
CPU: any number of leading batch dimensions (``(..., L, E)``, the heads at ``-3``), a bool
``attn_mask`` (True takes part) or a float one (added to the scores), broadcastable to
``(..., L, S)``; ``is_causal`` aligned top-left (query ``i`` sees keys ``0..i``), without an
``attn_mask`` (torch's documented rule: both at once raise); dropout whenever ``dropout_p > 0``;
any ``scale``; ``enable_gqa``. A query that may see no key gets 0, as in
torch's CPU kernels. Then it runs [`attnkit.functional.attention`][attnkit.functional.attention],
whose ``auto`` picks the backend (torch's own kernel where it is the fastest).

Beyond torch's arguments, use `attention` itself: ALiBi, windows, soft-capping, sinks, score and
mask functions.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit.functional import attention
from attnkit.nn.checks import MaskError

__all__ = ["scaled_dot_product_attention"]


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """torch's ``scaled_dot_product_attention``, computed by attnkit.

    Args:
        query: ``(..., Hq, L, E)``; also ``(L, E)``.
        key: ``(..., H, S, E)``: the same leading dimensions, and ``H == Hq`` unless ``enable_gqa``.
        value: ``(..., H, S, Ev)``.
        attn_mask: bool (True takes part) or float of the query's dtype (added to the scores),
            broadcastable to ``(..., Hq, L, S)``.
        dropout_p: dropout on the attention weights, applied whenever > 0.
        is_causal: query ``i`` sees keys ``0..i`` (top-left, as torch aligns it); not with an
            ``attn_mask``.
        scale: multiplies ``query . key``; ``1 / sqrt(E)`` by default.
        enable_gqa: ``Hq`` a multiple of ``H``: query head ``i`` uses key/value head ``i // (Hq / H)``.

    Returns:
        ``(..., Hq, L, Ev)``.

    Raises:
        TypeError, ValueError: what attnkit's checks name (torch raises ``RuntimeError``);
            [`MaskError`][attnkit.nn.checks.MaskError] (both) for ``attn_mask`` with ``is_causal``.

    Example:
        >>> import torch
        >>> q, k, v = (torch.randn(2, 4, 10, 16) for _ in range(3))
        >>> torch.allclose(
        ...     scaled_dot_product_attention(q, k, v, is_causal=True),
        ...     torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
        ...     atol=1e-6,
        ... )
        True
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dimensions (L, E), got {x.dim()}")
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError(
            "query, key and value must have as many dimensions, got "
            f"{query.dim()}, {key.dim()} and {value.dim()}"
        )
    try:  # the batch dimensions broadcast, as torch's do
        lead = torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
    except RuntimeError:
        raise ValueError(
            "query, key and value must have batch dimensions that broadcast together, got "
            f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}"
        ) from None
    heads, kv_heads = _heads(query), _heads(key)
    if heads != kv_heads and not enable_gqa:
        raise ValueError(
            f"query has {heads} heads and key {kv_heads}: pass enable_gqa=True for grouped-query "
            "attention"
        )
    q, k, v = (_four(x, lead) for x in (query, key, value))
    t, s = q.shape[-2], k.shape[-2]
    rows = (*lead, *query.shape[max(query.dim() - 3, 0) : -1])  # (..., Hq, L), or (L,)
    mask = None if attn_mask is None else _mask(attn_mask, (*rows, s))
    causal = False
    if is_causal:
        if attn_mask is not None:  # torch's fused CPU kernel takes both; its docs and others refuse
            raise MaskError("Explicit attn_mask should not be set when is_causal=True")
        mask, causal = top_left_causal(None, t, s, q.device)
    if scale is not None and scale <= 0:  # torch takes any scale; attention() a positive one
        q, scale = q * scale, 1.0
    drop_all = dropout_p == 1.0  # torch's dropout multiplies every weight by 0 then
    out = attention(
        q,
        k,
        v,
        attn_mask=mask,
        causal=causal,
        dropout_p=0.0 if drop_all else dropout_p,
        scale=scale,
    )
    if drop_all:
        out = out * 0.0
    return out.reshape((*rows, value.shape[-1]))


def top_left_causal(
    mask: Tensor | None, t: int, s: int, device: torch.device
) -> tuple[Tensor | None, bool]:
    """torch's ``is_causal`` (query ``i`` sees keys ``0..i``) joined with ``mask``, as
    `attention`'s ``(attn_mask, causal)``: ``causal=True`` where ``t == s``, where attnkit's
    bottom-right alignment is the same; else the triangle, in the mask."""
    if t == s:
        return mask, True
    allowed = torch.ones(t, s, dtype=torch.bool, device=device).tril()
    if mask is None:
        return allowed, False
    if mask.dtype == torch.bool:
        return mask & allowed, False
    return mask.masked_fill(~allowed, float("-inf")), False


def _heads(x: Tensor) -> int:
    return x.shape[-3] if x.dim() >= 3 else 1


def _four(x: Tensor, lead: torch.Size) -> Tensor:
    """``(..., H, L, E)`` as attnkit's ``(b, H, L, E)``: the leading dimensions, broadcast to
    ``lead``, become the batch (``b`` written out: -1 is ambiguous when a dimension is 0)."""
    x = x.expand(*lead, *x.shape[-3:]) if x.dim() >= 3 else x
    return x.reshape(math.prod(lead), _heads(x), *x.shape[-2:])


def _mask(mask: Tensor, shape: torch.Size) -> Tensor:
    """``mask`` broadcastable to ``shape`` = ``(..., Hq, L, S)`` as one broadcastable to attnkit's
    ``(b, Hq, L, S)``: a view of it where its leading dimensions allow."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dim() <= 4 and len(shape) == 4:
        return mask
    if mask.dim() > len(shape):
        raise ValueError(
            f"attn_mask of shape {tuple(mask.shape)} has more dimensions than the scores "
            f"{tuple(shape)}"
        )
    try:
        full = mask.expand(shape)
    except RuntimeError:
        raise ValueError(
            f"attn_mask of shape {tuple(mask.shape)} does not broadcast to the scores' "
            f"{tuple(shape)}"
        ) from None
    return full.reshape(-1, *shape[-3:]) if len(shape) >= 3 else full.reshape(1, 1, *shape)
