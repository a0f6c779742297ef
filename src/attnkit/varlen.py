"""The document mask of packed sequences: several sequences of different lengths in one batch row,
none seeing another's tokens. [`document_mask`][attnkit.varlen.document_mask] makes the block mask
of such a row, from document ids or flash-attn's ``cu_seqlens``;
[`varlen_attention`][attnkit.varlen.varlen_attention] takes flash-attn's packed layout. Only the
blocks on the sequences' diagonal are computed.

Shapes: ``total`` the packed tokens, ``h`` heads, ``d`` head dim, ``n`` sequences.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from attnkit.block_mask import create_block_mask
from attnkit.functional import attention
from attnkit.mods import ScoreMod


def sequence_lengths(cu_seqlens: Tensor, name: str, total: int | None = None) -> Tensor:
    """The sequence lengths of ``cu_seqlens`` (``0, l0, l0 + l1, ...``), checked."""
    if (
        not isinstance(cu_seqlens, Tensor)
        or cu_seqlens.dim() != 1
        or cu_seqlens.is_floating_point()
    ):
        raise TypeError(f"{name} must be a 1-D integer tensor, got {cu_seqlens!r}")
    if len(cu_seqlens) < 2 or int(cu_seqlens[0]) != 0:
        raise ValueError(
            f"{name} must start at 0 and hold at least one sequence, got {cu_seqlens.tolist()}"
        )
    lengths = cu_seqlens.diff()
    if bool((lengths < 0).any()):
        raise ValueError(f"{name} must not decrease, got {cu_seqlens.tolist()}")
    if total is not None and int(cu_seqlens[-1]) != total:
        raise ValueError(f"{name} must end at the total length {total}, got {int(cu_seqlens[-1])}")
    return lengths


def _cu_seqlens_of(documents: Tensor, name: str) -> Tensor:
    """``cu_seqlens`` of a 1-D tensor of document ids, each id in one contiguous run."""
    if not isinstance(documents, Tensor) or documents.dim() != 1 or documents.is_floating_point():
        raise TypeError(f"{name} must be a 1-D integer tensor of document ids, got {documents!r}")
    ids, counts = torch.unique_consecutive(documents, return_counts=True)
    if len(torch.unique(ids)) != len(ids):
        raise ValueError(
            f"{name}: each document's tokens must be contiguous, got {documents.tolist()}"
        )
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def document_mask(
    documents: Tensor | None = None,
    *,
    cu_seqlens: Tensor | None = None,
    kv_documents: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
    device: torch.device | str | None = None,
) -> BlockMask:
    """A block mask for packed sequences: each token sees only the tokens of its own document.

    Documents are given by ids (``documents``, one per token, each document contiguous) or by
    ``cu_seqlens`` as flash-attn takes them (``0, l0, l0 + l1, ...``); the keys' documents default
    to the queries'. Within a document, ``causal`` and ``window`` align bottom-right as flash-attn
    does when a document has fewer queries than keys: query ``i`` of ``lq`` sits at position
    ``i + lk - lq`` among the document's ``lk`` keys.

    Args:
        documents: ``(t,)`` document ids of the queries.
        cu_seqlens: ``(n + 1,)`` the queries' sequence boundaries, instead of ``documents``.
        kv_documents: ``(s,)`` document ids of the keys (default: the queries').
        cu_seqlens_k: ``(n + 1,)`` the keys' boundaries (default: the queries').
        causal: within each document, a query sees the keys up to its position.
        window: ``(left, right)`` keys around that position, -1 unbounded (causal: ``right = 0``).
        BLOCK_SIZE: the block size of the mask.
        device: where the tables live (default: the ids' device).

    Example:
        >>> import torch
        >>> mask = document_mask(torch.tensor([0, 0, 0, 1, 1, 2]), causal=True, BLOCK_SIZE=2)
        >>> mask.kv_num_blocks.tolist()   # per 2 queries, the blocks of 2 keys they need
        [[[1, 2, 2]]]
    """
    if (documents is None) == (cu_seqlens is None):
        raise ValueError("give the queries' documents as documents or as cu_seqlens (one of them)")
    if kv_documents is not None and cu_seqlens_k is not None:
        raise ValueError("give the keys' documents as kv_documents or as cu_seqlens_k, not both")
    cu_q = _cu_seqlens_of(documents, "documents") if cu_seqlens is None else cu_seqlens
    cu_k = cu_q
    if kv_documents is not None:
        cu_k = _cu_seqlens_of(kv_documents, "kv_documents")
    elif cu_seqlens_k is not None:
        cu_k = cu_seqlens_k
    lengths_q, lengths_k = (
        sequence_lengths(cu_q, "cu_seqlens"),
        sequence_lengths(cu_k, "cu_seqlens_k"),
    )
    if len(lengths_q) != len(lengths_k):
        raise ValueError(
            f"the queries have {len(lengths_q)} documents and the keys {len(lengths_k)}"
        )
    device = cu_q.device if device is None else device
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    mask_mod = _DocumentMask(cu_q.to(device), cu_k.to(device), lengths_q, lengths_k, left, right)
    t, s = int(cu_q[-1]), int(cu_k[-1])
    return create_block_mask(mask_mod, None, None, t, s, device, BLOCK_SIZE)


class _DocumentMask:
    """``mask_mod`` of packed documents: same document, and within it the window around the
    query's bottom-right-aligned position. Tensors per token, so it evaluates on index tensors."""

    def __init__(
        self,
        cu_q: Tensor,
        cu_k: Tensor,
        lengths_q: Tensor,
        lengths_k: Tensor,
        left: int,
        right: int,
    ):
        device = cu_q.device
        documents = torch.arange(len(lengths_q), device=device)
        self.doc_q = documents.repeat_interleave(lengths_q.to(device))
        self.doc_k = documents.repeat_interleave(lengths_k.to(device))
        # a query's position among its document's keys: its offset + (lk - lq)
        shift = (lengths_k - lengths_q).to(device)
        self.position_q = (
            torch.arange(int(cu_q[-1]), device=device)
            - cu_q[:-1].repeat_interleave(lengths_q.to(device))
            + shift.repeat_interleave(lengths_q.to(device))
        )
        self.position_k = torch.arange(int(cu_k[-1]), device=device) - cu_k[:-1].repeat_interleave(
            lengths_k.to(device)
        )
        self.left, self.right = left, right
        self.__qualname__ = "document_mask"

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        allowed = self.doc_q[q_idx] == self.doc_k[kv_idx]
        p, j = self.position_q[q_idx], self.position_k[kv_idx]
        if self.left >= 0:
            allowed = allowed & (j >= p - self.left)
        if self.right >= 0:
            allowed = allowed & (j <= p + self.right)
        return allowed


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
    sinks: Tensor | None = None,
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
    [`document_mask`][attnkit.varlen.document_mask], so only the blocks on the sequences'
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
        sinks: ``(h,)`` learned sink logits, as in [`attention`][attnkit.functional.attention]:
            every query of a head, in every sequence, has its head's sink in its denominator.
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
        sinks=sinks,
        return_lse=return_lse,
    )
    out, lse = result if return_lse else (result, None)
    out = out.squeeze(0).transpose(0, 1)
    return (out, lse.squeeze(0)) if return_lse else out
