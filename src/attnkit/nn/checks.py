"""The input checks of torch's ``nn.MultiheadAttention``, for attnkit's drop-in: the same cases
refused, in the same words, with errors that are both attnkit's kind and torch's.

attnkit names bad input with ``ValueError``; torch's layer raises ``AssertionError`` for a shape
and ``RuntimeError`` for a mask that does not fit. Code written against torch catches torch's
class, code written against attnkit catches ``ValueError``: each error here is both.

Shapes (torch's names): ``L`` queries, ``S`` keys, ``N`` batch, ``E`` embedding, ``H`` heads.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["MaskError", "ShapeError", "check_inputs"]


class ShapeError(ValueError, AssertionError):
    """An input shape that torch's layer refuses (it raises ``AssertionError``)."""


class MaskError(ValueError, RuntimeError):
    """A mask that does not fit the call, or a causal hint without one (torch raises
    ``RuntimeError``)."""


def check_inputs(
    module: torch.nn.MultiheadAttention,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    is_causal: bool,
    need_weights: bool,
) -> bool:
    """Whether the call is batched (``query`` 3-D), after refusing what torch's layer refuses:
    dimensions that do not go together, an embedding of another size, keys and values that do
    not pair, masks of the wrong dimensions or shape, ``is_causal`` without ``attn_mask``. A mask
    that gives way to the causal one (``is_causal`` without weights or padding) is not measured,
    as torch does not measure it."""
    batched = _batched(query, key, value, key_padding_mask, attn_mask, module.num_heads)
    e = query.shape[-1]
    if e != module.embed_dim:
        raise ShapeError(f"was expecting embedding dimension of {module.embed_dim}, but got {e}")
    if module._qkv_same_embed_dim:
        if key.shape != value.shape:
            raise ShapeError(f"key shape {key.shape} does not match value shape {value.shape}")
    elif key.shape[:-1] != value.shape[:-1]:
        raise ShapeError(
            f"key's sequence and batch dims {key.shape[:-1]} do not match value's "
            f"{value.shape[:-1]}"
        )
    for name, x, width in (("key", key, module.kdim), ("value", value, module.vdim)):
        if x.shape[-1] != width:
            raise ShapeError(f"{name} must have {width} features (kdim/vdim), got {x.shape[-1]}")
    if is_causal and attn_mask is None:
        raise MaskError(
            "Need attn_mask if specifying the is_causal hint. You may use the "
            "Transformer module method `generate_square_subsequent_mask` to create this mask."
        )
    if key_padding_mask is not None:
        _check_key_padding_mask(key_padding_mask, key, module.batch_first, batched)
    dropped = is_causal and key_padding_mask is None and not need_weights
    if attn_mask is not None and not dropped:
        _check_attn_mask(attn_mask, query, key, module, batched)
    for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
        if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
            raise TypeError(f"only bool and floating types of {name} are supported")
    return batched


def _batched(query, key, value, key_padding_mask, attn_mask, num_heads) -> bool:
    """torch's rule for which inputs go together, batched (3-D) or not (2-D)."""
    if query.dim() == 3:
        kind, want, padding = "batched (3-D)", 3, 2
    elif query.dim() == 2:
        kind, want, padding = "unbatched (2-D)", 2, 1
    else:
        raise ShapeError(
            "query should be unbatched 2D or batched 3D tensor but received "
            f"{query.dim()}-D query tensor"
        )
    if key.dim() != want or value.dim() != want:
        raise ShapeError(
            f"For {kind} `query`, expected `key` and `value` to be {want}-D but found "
            f"{key.dim()}-D and {value.dim()}-D tensors respectively"
        )
    if key_padding_mask is not None and key_padding_mask.dim() != padding:
        raise ShapeError(
            f"For {kind} `query`, expected `key_padding_mask` to be `None` or {padding}-D but "
            f"found {key_padding_mask.dim()}-D tensor instead"
        )
    if attn_mask is not None and attn_mask.dim() not in (2, 3):
        raise ShapeError(
            f"For {kind} `query`, expected `attn_mask` to be `None`, 2-D or 3-D but found "
            f"{attn_mask.dim()}-D tensor instead"
        )
    if want == 2 and attn_mask is not None and attn_mask.dim() == 3:
        expected = (num_heads, query.shape[0], key.shape[0])
        if attn_mask.shape != expected:
            raise ShapeError(
                f"Expected `attn_mask` shape to be {expected} but got {attn_mask.shape}"
            )
    return want == 3


def _check_attn_mask(
    attn_mask: Tensor,
    query: Tensor,
    key: Tensor,
    module: torch.nn.MultiheadAttention,
    batched: bool,
) -> None:
    """``attn_mask`` is ``(L, S)``, or ``(N * H, L, S)``: a mask for each head of each sequence
    (``S`` the keys given, before ``add_bias_kv`` and ``add_zero_attn`` add theirs)."""
    if not batched:
        n, t, s = 1, query.shape[0], key.shape[0]
    elif module.batch_first:
        n, t, s = query.shape[0], query.shape[1], key.shape[1]
    else:
        n, t, s = query.shape[1], query.shape[0], key.shape[0]
    expected = (t, s) if attn_mask.dim() == 2 else (n * module.num_heads, t, s)
    if tuple(attn_mask.shape) != expected:
        raise MaskError(
            f"The shape of the {attn_mask.dim()}D attn_mask is {attn_mask.shape}, but should be "
            f"{expected}."
        )


def _check_key_padding_mask(
    key_padding_mask: Tensor, key: Tensor, batch_first: bool, batched: bool
) -> None:
    """``key_padding_mask`` is ``(N, S)``, or ``(S,)`` unbatched."""
    if not batched:
        expected = (key.shape[0],)
    else:
        expected = (key.shape[0], key.shape[1]) if batch_first else (key.shape[1], key.shape[0])
    for dim, (got, want) in enumerate(zip(key_padding_mask.shape, expected)):
        if got != want:
            raise ShapeError(f"Expected key_padded_mask.shape[{dim}] to be {want}, but got {got}")
