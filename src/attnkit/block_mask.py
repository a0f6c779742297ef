"""FlexAttention's block masks (``create_block_mask``): which blocks of the score matrix a
``mask_mod`` leaves, built without the dense mask.

A [`BlockMask`](https://pytorch.org/docs/stable/nn.attention.flex_attention.html) (torch's own
class) lists, for each block of ``Q_BLOCK_SIZE`` query rows, the key blocks of ``KV_BLOCK_SIZE``
that hold an allowed score: *partial* blocks, where ``mask_mod`` must be applied, and *full* blocks,
where every score is allowed and ``mask_mod`` is skipped. Blocks in neither list are never
computed.

torch's ``create_block_mask`` on a CPU evaluates ``mask_mod`` over the whole ``(B, H, Q_LEN,
KV_LEN)`` grid at once (2.5 GiB for a causal mask at 16384²). attnkit's
[`create_block_mask`][attnkit.block_mask.create_block_mask] takes the same arguments and returns
the same block tables, but evaluates the mask tile by tile, at most
[`WORK_ELEMENTS`][attnkit.block_mask.WORK_ELEMENTS] scores at a time, so its memory is the block
tables plus one tile.
"""

from __future__ import annotations

import math
import warnings
import weakref

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from attnkit import mods
from attnkit._tracing import traced

WORK_ELEMENTS = 1 << 22
"""The most mask elements evaluated at once (4 MiB of bools)."""


def _device(device) -> torch.device:
    if device is not None:
        return torch.device(device)
    accelerator = getattr(torch, "accelerator", None)
    current = accelerator.current_accelerator() if accelerator is not None else None
    return torch.device(current or "cpu")


def _block_sizes(BLOCK_SIZE: int | tuple[int, int]) -> tuple[int, int]:
    sizes = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    if len(sizes) != 2 or not all(isinstance(n, int) and n > 0 for n in sizes):
        raise ValueError(f"BLOCK_SIZE must be a positive int or a pair of them, got {BLOCK_SIZE!r}")
    return sizes


def create_block_mask(
    mask_mod: mods.MaskMod,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: torch.device | str | None = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
    _compile: bool = False,
    separate_full_blocks: bool = True,
    compute_dq_write_order: bool = False,
    dq_kv_order: bool = True,
) -> BlockMask:
    """The block tables of ``mask_mod``, as torch's ``create_block_mask`` makes them, without the
    dense mask.

    Same parameters, order and defaults as torch 2.13's
    ``torch.nn.attention.flex_attention.create_block_mask``, and a torch ``BlockMask`` back: equal
    ``kv_num_blocks`` and ``full_kv_num_blocks``, and the same blocks listed first in
    ``kv_indices``/``full_kv_indices``. A block past the end of a length not divisible by the
    block size counts its missing rows or keys as masked, so it is never full, as in torch.

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool``, True where the query may see the key.
        B: batch size the mask depends on; None for 1 (the same for every batch).
        H: query heads the mask depends on; None for 1.
        Q_LEN: query length.
        KV_LEN: key length.
        device: where the tables live (torch's rule: the current accelerator, else the CPU).
        BLOCK_SIZE: the block's query rows and keys, one int for both.
        _compile: deprecated in torch and ignored here (a warning says so).
        separate_full_blocks: False lists every non-empty block as partial.
        compute_dq_write_order: torch's metadata for a deterministic GPU backward; computed by
            torch when asked.
        dq_kv_order: the order of that metadata.

    Raises:
        TypeError: ``mask_mod`` returns something other than a bool tensor.
        ValueError: a length or block size that is not positive.
    """
    if _compile:
        warnings.warn(
            "create_block_mask(_compile=True) is deprecated in torch; attnkit ignores it",
            DeprecationWarning,
            stacklevel=2,
        )
    B, H = B or 1, H or 1
    for name, value in (("B", B), ("H", H), ("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    bq, bk = _block_sizes(BLOCK_SIZE)
    device = _device(device)
    partial, full = block_counts(mask_mod, B, H, Q_LEN, KV_LEN, bq, bk, device)
    if not separate_full_blocks:
        partial, full = partial | full, None
    block_mask = BlockMask.from_kv_blocks(
        *_ordered(partial),
        *(_ordered(full) if full is not None else (None, None)),
        BLOCK_SIZE=(bq, bk),
        mask_mod=mask_mod,
        seq_lengths=(Q_LEN, KV_LEN),
    )
    if compute_dq_write_order:
        from torch.nn.attention.flex_attention import _compute_dq_write_order_from_block_mask

        order, order_full = _compute_dq_write_order_from_block_mask(
            block_mask, dq_kv_order=dq_kv_order
        )
        block_mask.dq_write_order, block_mask.dq_write_order_full = order, order_full
        block_mask.dq_kv_order, block_mask.dq_kv_order_spt = None, dq_kv_order
    return block_mask


def block_counts(
    mask_mod: mods.MaskMod, B: int, H: int, t: int, s: int, bq: int, bk: int, device
) -> tuple[Tensor, Tensor]:
    """``(partial, full)``: bool ``(B, H, ceil(t / bq), ceil(s / bk))``, the blocks that hold some
    but not all allowed scores, and those that hold only allowed ones, from tiles of at most
    [`WORK_ELEMENTS`][attnkit.block_mask.WORK_ELEMENTS] evaluations of ``mask_mod``."""
    nq, nk = math.ceil(t / bq), math.ceil(s / bk)
    some = torch.zeros(B, H, nq, nk, dtype=torch.bool, device=device)
    every = torch.zeros(B, H, nq, nk, dtype=torch.bool, device=device)
    tile_k = max(1, min(nk, WORK_ELEMENTS // (B * H * bq * bk)))
    tile_q = max(1, min(nq, WORK_ELEMENTS // (B * H * bq * bk * tile_k)))
    for qb in range(0, nq, tile_q):
        rows = range(qb * bq, min((qb + tile_q) * bq, t))
        for kb in range(0, nk, tile_k):
            keys = range(kb * bk, min((kb + tile_k) * bk, s))
            at = mods.Block.of(range(B), range(H), rows, keys, device)
            allowed = mods.mask(mask_mod, at).expand(B, H, len(rows), len(keys))
            pad = (0, -len(keys) % bk, 0, -len(rows) % bq)  # missing rows and keys: masked
            if any(pad):
                allowed = torch.nn.functional.pad(allowed, pad)
            # as bytes: max and min over a block are several times faster than any and all
            blocks = allowed.view(torch.uint8).reshape(B, H, -1, bq, allowed.shape[-1] // bk, bk)
            where = (slice(None), slice(None), slice(qb, qb + blocks.shape[2]))
            where += (slice(kb, kb + blocks.shape[4]),)
            some[where] = blocks.amax(dim=5).amax(dim=3).bool()
            every[where] = blocks.amin(dim=5).amin(dim=3).bool()
    return some & ~every, every


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """``(num_blocks, indices)`` of a ``(..., nq, nk)`` bool table: the listed blocks first, in
    ascending order, as torch orders them."""
    dense = blocks.to(torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(dim=-1, dtype=torch.int32), indices.to(torch.int32)


def tables(block_mask: BlockMask) -> tuple[Tensor, Tensor]:
    """``(partial, full)``: bool ``(B, H, nq, nk)``, the blocks ``block_mask`` lists as partial
    (``mask_mod`` applies) and as full (every score allowed). Entries past each row's count in
    ``kv_indices`` are padding, and ignored."""

    def dense(num: Tensor | None, indices: Tensor | None, nk: int) -> Tensor:
        shape = (*block_mask.kv_num_blocks.shape, nk)
        if num is None or indices is None:
            return torch.zeros(shape, dtype=torch.bool, device=block_mask.kv_num_blocks.device)
        listed = torch.arange(indices.shape[-1], device=indices.device) < num[..., None]
        columns = indices.long().masked_fill(~listed, nk)  # padding goes to a spare column
        table = torch.zeros((*shape[:-1], nk + 1), dtype=torch.bool, device=indices.device)
        return table.scatter_(-1, columns, True)[..., :nk]

    nk = -(-block_mask.seq_lengths[1] // block_mask.BLOCK_SIZE[1])
    full = dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, nk)
    partial = dense(block_mask.kv_num_blocks, block_mask.kv_indices, nk) & ~full
    return partial, full


def allowed(block_mask: BlockMask, b: int, h: int) -> Tensor:
    """The dense bool mask, broadcastable to ``(b, h, t, s)``, that ``block_mask`` stands for in
    a call of ``b`` batches and ``h`` heads. ``O(t * s)``: for the reference backend, which
    materialises the scores anyway."""
    t, s = block_mask.seq_lengths
    partial, full = tables(block_mask)
    return scores_allowed(block_mask, partial, full, range(t), range(s), b, h)


def scores_allowed(
    block_mask: BlockMask,
    partial: Tensor,
    full: Tensor,
    rows: range,
    keys: range,
    b: int,
    h: int,
    compiled: bool = False,
) -> Tensor:
    """Which scores of ``rows`` x ``keys`` ``block_mask`` allows, broadcastable to
    ``(b, h, len(rows), len(keys))``: those in its full blocks, and in its partial blocks those
    its ``mask_mod`` allows, evaluated at the call's ``b`` batches and ``h`` heads as torch
    evaluates it (also for tables built with ``B`` or ``H`` None). ``partial`` and ``full`` are
    the tables of [`tables`][attnkit.block_mask.tables]."""
    bq, bk = block_mask.BLOCK_SIZE
    device = partial.device
    row_blocks = torch.arange(rows.start, rows.stop, device=device) // bq  # the mask's blocks
    key_blocks = torch.arange(keys.start, keys.stop, device=device) // bk
    q0, q1 = int(row_blocks[0]), int(row_blocks[-1]) + 1
    k0, k1 = int(key_blocks[0]), int(key_blocks[-1]) + 1
    partial, full = partial[:, :, q0:q1, k0:k1], full[:, :, q0:q1, k0:k1]

    def spread(table: Tensor) -> Tensor:  # the mask's blocks -> scores
        return table[:, :, row_blocks - q0][:, :, :, key_blocks - k0]

    if not bool(partial.any()):
        return spread(full)
    at = mods.Block.of(range(b), range(h), rows, keys, device)
    by_mod = mods.mask(block_mask.mask_mod, at, compiled=compiled)
    if bool(partial.all()):
        return by_mod
    return spread(full) | (spread(partial) & by_mod)


_WINDOWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each block mask seen: ``{(b, h): the window it is, or None}``."""


def window_of(block_mask: BlockMask, b: int, h: int) -> tuple[int, int] | None:
    """The positional window ``(left, right)`` (bottom-right aligned, -1 unbounded, as
    ``attention``'s ``window`` takes it) that ``block_mask`` allows score for score in a call of
    ``b`` batches and ``h`` heads, or None if it is no window: a causal mask (``q_idx >= kv_idx``
    with as many queries as keys), a sliding window, a block mask with every listed block full.
    Then a call can run as that window, on the kernels that skip blocks by position and apply no
    mask per score.

    Looked at only for block tables shared by every batch and head (built with ``B`` and ``H``
    None), on a CPU, outside tracing; the mask is evaluated in its partial blocks at every batch
    and head of the call, as the call would apply it, and must be the same for all. Kept per
    block mask and call size (a causal mask at 4096 evaluates 32 blocks of 128 x 128)."""
    partial, full = tables(block_mask)
    if partial.shape[:2] != (1, 1) or not partial.is_cpu or traced():
        return None
    kept = _WINDOWS.setdefault(block_mask, {})
    if (b, h) not in kept:
        kept[b, h] = _window(block_mask, partial[0, 0], full[0, 0], b, h)
    return kept[b, h]


def _rows_contiguous(listed: Tensor) -> bool:
    """Whether each row of a ``(n, m)`` bool table lists one run of columns (or none)."""
    count = listed.sum(dim=1)
    columns = torch.arange(listed.shape[1])
    first = torch.where(listed, columns, listed.shape[1]).amin(dim=1)
    last = torch.where(listed, columns, -1).amax(dim=1)
    return bool(((count == 0) | (count == last - first + 1)).all())


def _window(
    block_mask: BlockMask, partial: Tensor, full: Tensor, b: int, h: int
) -> tuple[int, int] | None:
    if not _rows_contiguous(partial | full):  # a gap between blocks: no window (a quick look)
        return None
    t, s = block_mask.seq_lengths
    bq, bk = block_mask.BLOCK_SIZE
    # each row's first and last allowed key and how many it may see
    first = torch.full((t,), s, dtype=torch.long)
    last = torch.full((t,), -1, dtype=torch.long)
    count = torch.zeros(t, dtype=torch.long)
    for qb, kb in full.nonzero().tolist():
        rows = slice(qb * bq, min((qb + 1) * bq, t))
        j0, j1 = kb * bk, min((kb + 1) * bk, s)
        first[rows] = first[rows].clamp(max=j0)
        last[rows] = last[rows].clamp(min=j1 - 1)
        count[rows] += j1 - j0
    for qb, kb in partial.nonzero().tolist():
        rows, keys = range(qb * bq, min((qb + 1) * bq, t)), range(kb * bk, min((kb + 1) * bk, s))
        at = mods.Block.of(range(b), range(h), rows, keys, partial.device)
        every = mods.mask(block_mask.mask_mod, at).expand(b, h, len(rows), len(keys))
        seen = every[0, 0]
        if not bool((every == seen).all()):  # the batches or heads differ: no one window
            return None
        where = torch.arange(keys.start, keys.stop)
        some = seen.any(dim=1)
        lo = torch.where(seen, where, s).amin(dim=1)
        hi = torch.where(seen, where, -1).amax(dim=1)
        span = slice(rows.start, rows.stop)
        first[span] = torch.minimum(first[span], lo)
        last[span] = torch.maximum(last[span], torch.where(some, hi, -1))
        count[span] += seen.sum(dim=1)
    seen = count > 0
    if not bool(seen.any()) or not bool((count[seen] == last[seen] - first[seen] + 1).all()):
        return None  # no key at all, or a row whose keys have a gap
    position = torch.arange(t) + (s - t)  # p(i), bottom-right aligned
    left = _bound(position - first, seen & (first > 0))
    right = _bound(last - position, seen & (last < s - 1))
    if left is None or right is None:
        return None
    low = position - left if left >= 0 else torch.zeros_like(position)
    high = position + right if right >= 0 else torch.full_like(position, s - 1)
    low, high = low.clamp(min=0), high.clamp(max=s - 1)
    empty = low > high
    same = (seen == ~empty) & (~seen | ((first == low) & (last == high)))
    return (left, right) if bool(same.all()) else None


def _bound(reach: Tensor, limited: Tensor) -> int | None:
    """The one reach of the rows whose keys stop short of an end (-1 if none does), or None if
    they differ or it is negative (a window that leaves out the query's own position)."""
    if not bool(limited.any()):
        return -1
    values = reach[limited]
    value = int(values[0])
    return value if value >= 0 and bool((values == value).all()) else None
