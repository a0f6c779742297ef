"""A drop-in for torch's FlexAttention that also trains on a CPU.

[`flex_attention`][attnkit.flex.flex_attention] takes the parameters of torch 2.13's
``torch.nn.attention.flex_attention.flex_attention``, in the same order, with the same defaults and
returns, and runs [`attnkit.functional.attention`][attnkit.functional.attention] with a
``score_mod`` and a ``block_mask``: forward and backward in ``O(N)`` memory on any device, with
gradients to q, k, v and to the tensors the ``score_mod`` reads. torch's own raises on a CPU as
soon as an input requires grad.

Example:
    >>> import torch
    >>> from attnkit import create_block_mask, flex_attention
    >>> def causal(b, h, q_idx, kv_idx):
    ...     return q_idx >= kv_idx
    >>> bias = torch.zeros(4, 2 * 64 - 1, requires_grad=True)   # a learned relative bias
    >>> def relative(score, b, h, q_idx, kv_idx):
    ...     return score + bias[h, q_idx - kv_idx + 63]
    >>> q, k, v = (torch.randn(2, 4, 64, 16, requires_grad=True) for _ in range(3))
    >>> mask = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    >>> out = flex_attention(q, k, v, score_mod=relative, block_mask=mask)
    >>> out.sum().backward()
    >>> bias.grad.shape
    torch.Size([4, 127])
"""

from __future__ import annotations

import warnings

from torch import Tensor
from torch.nn.attention.flex_attention import AuxOutput, AuxRequest, BlockMask

from attnkit.block_mask import create_block_mask
from attnkit.functional import attention
from attnkit.mods import ScoreMod
from attnkit.varlen import document_mask, varlen_attention

__all__ = [
    "AuxOutput",
    "AuxRequest",
    "BlockMask",
    "create_block_mask",
    "document_mask",
    "flex_attention",
    "varlen_attention",
]


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    score_mod: ScoreMod | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict | None = None,
    *,
    return_aux: AuxRequest | None = None,
    sinks: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor, AuxOutput]:
    """torch's ``flex_attention``, computed by attnkit, with a backward on every device.

    Args:
        query: ``(B, Hq, L, E)``.
        key: ``(B, Hkv, S, E)``; a batch of 1 is shared by every query batch.
        value: ``(B, Hkv, S, Ev)``.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``; ``-inf`` masks the key.
        block_mask: a ``BlockMask`` for ``(L, S)``, from torch's ``create_block_mask`` or
            [`attnkit.create_block_mask`][attnkit.block_mask.create_block_mask], any block size.
        scale: multiplies ``query . key``; ``1 / sqrt(E)`` by default.
        enable_gqa: allow ``Hq`` to be a multiple of ``Hkv`` (grouped-query attention).
        return_lse: deprecated in torch (a ``FutureWarning`` says so), as there: also return the
            log-sum-exp ``(B, Hq, L)``.
        kernel_options: accepted for compatibility and ignored: they tune torch's generated
            kernels, and attnkit's kernels choose their own blocks.
        return_aux: ``AuxRequest(lse=True)`` returns ``(out, AuxOutput(lse=..., max_scores=None))``.
        sinks: attnkit's own: ``(Hq,)`` learned sink logits that join every query's softmax
            denominator (see [`attention`][attnkit.functional.attention]); not given to a mod.

    Returns:
        ``out`` ``(B, Hq, L, Ev)``; with ``return_lse`` ``(out, lse)``; with ``return_aux``
        ``(out, AuxOutput)``. A query that no key is allowed for gets output 0 and lse ``-inf``.

    Raises:
        ValueError: heads that do not match (without ``enable_gqa``) or do not divide, a block mask
            for other lengths, both ``return_lse`` and ``return_aux``, or ``max_scores`` asked for.
    """
    if query.dim() == 4 and key.dim() == 4:
        hq, hkv = query.shape[1], key.shape[1]
        if not enable_gqa and hq != hkv:
            raise ValueError(
                f"query has {hq} heads and key {hkv}: pass enable_gqa=True for grouped-query "
                "attention"
            )
        if key.shape[0] == 1 and query.shape[0] > 1:  # one key/value batch for every query batch
            key, value = (x.expand(query.shape[0], *x.shape[1:]) for x in (key, value))
    if return_lse and return_aux is not None:
        raise ValueError("give return_lse or return_aux, not both (return_lse is deprecated)")
    if return_lse:
        warnings.warn(
            "return_lse is deprecated in torch's flex_attention; use "
            "return_aux=AuxRequest(lse=True)",
            FutureWarning,
            stacklevel=2,
        )
    if return_aux is not None and return_aux.max_scores:
        raise ValueError("attnkit's flex_attention returns the lse, not max_scores")
    want_lse = return_lse or (return_aux is not None and return_aux.lse)
    result = attention(
        query,
        key,
        value,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        sinks=sinks,
        return_lse=want_lse,
    )
    if return_aux is not None:
        out, lse = result if want_lse else (result, None)
        return out, AuxOutput(lse=lse)
    return result
