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

from attnkit.block_mask import create_block_mask, document_mask, sequence_lengths
from attnkit.functional import attention
from attnkit.mods import ScoreMod

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
        return_lse=want_lse,
    )
    if return_aux is not None:
        out, lse = result if want_lse else (result, None)
        return out, AuxOutput(lse=lse)
    return result


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    return_lse: bool = False,
    block_size: int | tuple[int, int] = 128,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over packed sequences of different lengths, shaped as flash-attn's
    ``flash_attn_varlen_func``, with a backward on every device.

    Sequence ``i`` holds queries ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` and keys
    ``cu_seqlens_k[i]:cu_seqlens_k[i + 1]``; no query sees another sequence's keys. Within a
    sequence, ``causal`` and ``window`` align bottom-right, as in flash-attn: with fewer queries
    than keys, the last query sees the last key. Computed by the tiled kernel with
    [`document_mask`][attnkit.block_mask.document_mask], so only the blocks on the sequences'
    diagonal are computed, in ``O(total)`` memory.

    Args:
        q: ``(total_q, h, d)``.
        k: ``(total_k, h_kv, d)``; ``h`` a multiple of ``h_kv``.
        v: ``(total_k, h_kv, d_v)``.
        cu_seqlens_q: ``(n + 1,)`` int, ``0, l0, l0 + l1, ..., total_q``.
        cu_seqlens_k: ``(n + 1,)`` int, likewise for the keys.
        max_seqlen_q: the longest query sequence, checked if given (flash-attn needs it).
        max_seqlen_k: the longest key sequence, checked if given.
        causal: each query sees the keys up to its position in its sequence.
        window: ``(left, right)`` keys around that position, -1 unbounded.
        scale: multiplies ``q . k``; ``1 / sqrt(d)`` by default.
        softcap: soft-capping of the scores, as in [`attention`][attnkit.functional.attention].
        score_mod: a score modifier, with ``q_idx``/``kv_idx`` indexing the packed tokens.
        return_lse: also return the log-sum-exp, ``(h, total_q)`` as flash-attn returns it.
        block_size: the block mask's block size.

    Returns:
        ``out`` ``(total_q, h, d_v)``, or ``(out, lse)``.

    Example:
        >>> import torch
        >>> cu = torch.tensor([0, 3, 8])                 # two sequences, of 3 and 5 tokens
        >>> q, k, v = (torch.randn(8, 4, 16) for _ in range(3))
        >>> out = varlen_attention(q, k, v, cu, cu, causal=True)
        >>> alone = varlen_attention(q[3:], k[3:], v[3:], cu[1:] - 3, cu[1:] - 3, causal=True)
        >>> torch.allclose(out[3:], alone)
        True
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() != 3:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name} must be (total, heads, head_dim), got {got}")
    for cu, total, longest, name in (
        (cu_seqlens_q, q.shape[0], max_seqlen_q, "cu_seqlens_q"),
        (cu_seqlens_k, k.shape[0], max_seqlen_k, "cu_seqlens_k"),
    ):
        lengths = sequence_lengths(cu, name, total)
        if longest is not None and int(lengths.max()) > longest:
            raise ValueError(
                f"{name} holds a sequence of {int(lengths.max())}, over max_seqlen {longest}"
            )
    mask = document_mask(
        cu_seqlens=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        causal=causal,
        window=window,
        BLOCK_SIZE=block_size,
        device=q.device,
    )
    packed = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)]  # (1, heads, total, d)
    result = attention(
        *packed,
        block_mask=mask,
        score_mod=score_mod,
        scale=scale,
        softcap=softcap,
        return_lse=return_lse,
    )
    out, lse = result if return_lse else (result, None)
    out = out.squeeze(0).transpose(0, 1)
    return (out, lse.squeeze(0)) if return_lse else out
