"""The flex backend's ``BlockMask``: how a call's masks reach torch's FlexAttention, as a
``BlockMask`` whose block tables skip what causal, window and a caller's block mask leave out
(combined, regridded to the kernels' blocks and cached), with ``key_mask`` and a bool ``attn_mask`` indexed in its ``mask_mod``; or,
inside ``torch.compile``, where no table is built while tracing, as a ``mask_mod`` the
``score_mod`` applies as ``-inf`` scores. The flex backend's half for masks
([`attnkit.backends.torch_flex`][attnkit.backends.torch_flex])."""

from __future__ import annotations

import collections
import copy
import threading

import torch
from torch import Tensor
from torch.nn.attention import flex_attention as torch_flex
from torch.nn.attention.flex_attention import BlockMask, noop_mask

from attnkit import block_mask as block_tables
from attnkit._tracing import traced
from attnkit.call import Call
from attnkit.mods import MaskMod

BLOCK = 128
"""The block size of the block masks it builds: torch's default, a multiple of every block its
kernels take. A caller's block mask whose blocks divide it is regridded to it."""

CACHE_SIZE = 16
"""The block masks kept, the least recently used dropped first."""

_CACHE: collections.OrderedDict = collections.OrderedDict()  # key -> (owner, BlockMask)
_LOCK = threading.Lock()


def grid(user: BlockMask) -> tuple[int, int] | None:
    """The blocks to combine ``user``'s tables at: its own where torch's kernels take them (a
    multiple of [`BLOCK`][attnkit.backends.torch_flex_masks.BLOCK]), else ``BLOCK`` where they divide it;
    None where neither."""
    sizes = []
    for n in user.BLOCK_SIZE:
        if n % BLOCK and BLOCK % n:
            return None
        sizes.append(n if n % BLOCK == 0 else BLOCK)
    return sizes[0], sizes[1]


def full_view(mask: Tensor, shape: tuple[int, int, int, int]) -> Tensor:
    """A mask broadcastable to ``shape`` as a 4-D view of that shape (no copy)."""
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(shape)


def offset_tensor(offset: int, device: torch.device) -> Tensor:
    """``offset`` as a 0-d tensor for a mod: an int of lengths that vary is symbolic inside
    torch.compile, which some torch versions cannot lower into the kernel (2.11)."""
    return torch.full((), offset, dtype=torch.int32, device=device)


def _positional(window: tuple[int, int], offset: Tensor) -> MaskMod:
    """The window (causal folded in) as a ``mask_mod``: ``p(i) - left <= j <= p(i) + right``,
    with ``p(i) = i + offset``."""
    left, right = window

    def positional(b, h, q_idx, kv_idx):
        distance = q_idx + offset - kv_idx  # p(i) - j
        if left < 0:
            return distance >= -right
        if right < 0:
            return distance <= left
        return (distance <= left) & (distance >= -right)

    return positional


def _listed(user: BlockMask) -> MaskMod:
    """What ``user`` allows, as a ``mask_mod`` on any grid: every score of its full blocks, and in
    its partial blocks those its own ``mask_mod`` allows."""
    partial, full = block_tables.tables(user)
    kind = full.to(torch.int8) * 2 + partial.to(torch.int8)  # 2 full, 1 partial, 0 left out
    nb, nh = kind.shape[:2]
    bq, bk = user.BLOCK_SIZE
    mask_mod = user.mask_mod

    def listed(b, h, q_idx, kv_idx):
        here = kind[b if nb > 1 else 0, h if nh > 1 else 0, q_idx // bq, kv_idx // bk]
        return (here == 2) | ((here == 1) & mask_mod(b, h, q_idx, kv_idx))

    return listed


def _regrid(user: BlockMask, grid: tuple[int, int], t: int, s: int) -> tuple[Tensor, Tensor]:
    """``(listed, full)`` of ``user``'s tables on ``grid``, whose blocks hold whole blocks of its:
    a block is listed where one of its blocks is, full where all are."""
    partial, full = block_tables.tables(user)
    fq, fk = grid[0] // user.BLOCK_SIZE[0], grid[1] // user.BLOCK_SIZE[1]
    nq, nk = -(-t // grid[0]), -(-s // grid[1])

    def group(table: Tensor, every: bool) -> Tensor:
        pad = (0, nk * fk - table.shape[-1], 0, nq * fq - table.shape[-2])
        table = torch.nn.functional.pad(table.to(torch.uint8), pad)
        table = table.view(*table.shape[:2], nq, fq, nk, fk)
        reduced = table.amin(dim=5).amin(dim=3) if every else table.amax(dim=5).amax(dim=3)
        return reduced.bool()

    return group(partial | full, every=False), group(full, every=True)


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """``(num_blocks, indices)`` of a bool table, the listed blocks first, as torch orders them."""
    dense = blocks.to(torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(dim=-1, dtype=torch.int32), indices.to(torch.int32)


def _build(call: Call, grid: tuple[int, int], all_partial: bool) -> BlockMask:
    """The block mask of the call's window and block mask, on ``grid``."""
    q, window, user = call.q, call.masks.window, call.block_mask
    t, s = q.shape[2], call.k.shape[2]
    nq, nk = -(-t // grid[0]), -(-s // grid[1])
    listed = torch.ones(1, 1, nq, nk, dtype=torch.bool, device=q.device)
    full, parts = listed, []
    if window is not None:
        positional = _positional(window, offset_tensor(s - t + call.masks.shift, q.device))
        some, every = block_tables.block_counts(positional, 1, 1, t, s, *grid, q.device)
        listed, full = listed & (some | every), full & every
        parts.append(positional)
    if user is not None:
        user_listed, user_full = _regrid(user, grid, t, s)
        listed, full = listed & user_listed, full & user_full
        parts.append(_listed(user))
    mask_mod = (
        torch_flex.and_masks(*parts) if len(parts) > 1 else (parts[0] if parts else noop_mask)
    )
    return BlockMask.from_kv_blocks(
        *_ordered(listed if all_partial else listed & ~full),
        *((None, None) if all_partial else _ordered(full)),
        BLOCK_SIZE=grid,
        mask_mod=mask_mod,
        seq_lengths=(t, s),
    )


def structure(call: Call, all_partial: bool) -> BlockMask | None:
    """The block mask of the call's window and block mask (every listed block partial where
    ``all_partial``), from the cache where it was built before; None where nothing masks."""
    window, user = call.masks.window, call.block_mask
    if window is None and user is None and not all_partial:
        return None
    blocks = (BLOCK, BLOCK) if user is None else grid(user)
    if window is None and not all_partial and blocks == tuple(user.BLOCK_SIZE):
        return user  # as it is: torch's kernels take it
    t, s = call.q.shape[2], call.k.shape[2]
    key = (t, s, window, call.masks.shift, blocks, call.q.device, all_partial, id(user))
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None and hit[0] is user:  # the entry holds user: its id is not reused
            _CACHE.move_to_end(key)
            return hit[1]
    built = _build(call, blocks, all_partial)
    with _LOCK:
        _CACHE[key] = (user, built)
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    return built


def _with_tensors(base: MaskMod, key_mask: Tensor | None, allowed: Tensor | None) -> MaskMod:
    """``base`` and the call's tensor masks: ``key_mask`` ``(b, s)`` and a bool mask
    ``(b, h, t, s)`` (a broadcast view), indexed per score."""

    def mask_mod(b, h, q_idx, kv_idx):
        shown = base(b, h, q_idx, kv_idx)
        if key_mask is not None:
            shown = shown & key_mask[b, kv_idx]
        if allowed is not None:
            shown = shown & allowed[b, h, q_idx, kv_idx]
        return shown

    return mask_mod


def masks_of(call: Call) -> tuple[BlockMask | None, MaskMod | None]:
    """The block mask to give FlexAttention, and what the ``score_mod`` must hide besides (while
    traced: the window and the tensor masks, as ``-inf`` scores)."""
    b, h, t, _ = call.q.shape
    masks = call.masks
    allowed = masks.attn_mask if masks.bias() is None else None
    if allowed is not None:
        allowed = full_view(allowed, (b, h, t, call.k.shape[2]))
    tensors = masks.key_mask is not None or allowed is not None
    if traced():
        hidden = None
        if masks.window is not None or tensors:
            base = noop_mask
            if masks.window is not None:
                offset = offset_tensor(call.k.shape[2] - t + masks.shift, call.q.device)
                base = _positional(masks.window, offset)
            hidden = _with_tensors(base, masks.key_mask, allowed)
        return call.block_mask, hidden
    built = structure(call, all_partial=tensors)
    if not tensors:
        return built, None
    with_tensors = copy.copy(built)
    with_tensors.mask_mod = _with_tensors(built.mask_mod, masks.key_mask, allowed)
    return with_tensors, None
