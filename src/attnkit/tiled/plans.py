"""The tiled loop's plan of a block mask: which of its key blocks each block of queries visits,
in blocks of several of the mask's own (see [`BlockPlan`][attnkit.tiled.plans.BlockPlan])."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from attnkit.block_mask import scores_allowed, tables


class BlockPlan:
    """A block mask as the tiled kernel walks it, in blocks of ``group`` of the mask's blocks (the
    kernel's blocks are larger than a mask's 128 x 128, so that Python's cost per block is paid
    less often): for each row of blocks, the blocks that some batch and head needs, and for each
    of those the mask to apply, None where all of it is full for every batch and head (then
    ``mask_mod`` is skipped)."""

    def __init__(
        self,
        block_mask: BlockMask,
        batches: int,
        heads: int,
        most: tuple[int, int] = (1, 1),
        *,
        compiled: bool = False,
    ):
        self.block_mask = block_mask
        self.batches, self.heads = batches, heads  # the call's: mask_mod sees them all
        self.compiled = compiled  # mask_mod through mods.compile_block
        self.partial, self.full = tables(block_mask)  # (B, H, nq, nk), the mask's blocks
        listed = (self.partial | self.full).flatten(0, 1).any(dim=0)  # (nq, nk)
        self.group = _largest_group(listed, most)
        bq, bk = block_mask.BLOCK_SIZE
        self.block_size = (bq * self.group[0], bk * self.group[1])
        full = self.full.flatten(0, 1).all(dim=0)
        # blocks past the matrix's end: never listed, and no reason for a block to be masked
        grouped = _any_in_group(listed, self.group)
        self.key_blocks = [row.nonzero().flatten().tolist() for row in grouped]
        self.all_full = _grouped(full, self.group, True).all(-1).all(1).tolist()

    def allowed(self, qb: int, kb: int, rows: range, keys: range) -> Tensor | None:
        """Bool, broadcastable to ``(b, h, len(rows), len(keys))``, for the scores of rows
        ``rows`` (in the kernel's query block ``qb``) and keys ``keys`` (in its key block
        ``kb``), or None if every score there is allowed for every batch and head."""
        if self.all_full[qb][kb]:
            return None
        return scores_allowed(
            self.block_mask,
            self.partial,
            self.full,
            rows,
            keys,
            self.batches,
            self.heads,
            self.compiled,
        )


def _grouped(table: Tensor, group: tuple[int, int], fill: bool) -> Tensor:
    """``(nq, nk)`` -> ``(NQ, gq, NK, gk)``: the mask's blocks by the kernel's blocks of ``group``
    of them, padded with ``fill`` past the matrix's end."""
    gq, gk = group
    nq, nk = table.shape
    padded = torch.nn.functional.pad(table, (0, -nk % gk, 0, -nq % gq), value=fill)
    return padded.view(padded.shape[0] // gq, gq, padded.shape[1] // gk, gk)


def _any_in_group(listed: Tensor, group: tuple[int, int]) -> Tensor:
    """``(NQ, NK)``: the kernel's blocks that hold a listed block of the mask."""
    return _grouped(listed, group, False).any(-1).any(1)


def _largest_group(listed: Tensor, most: tuple[int, int]) -> tuple[int, int]:
    """The largest group, up to ``most``, whose blocks cover at most a quarter more of the scores
    than the mask's listed blocks: a sparse mask (packed documents) keeps small blocks, a dense
    one (causal) gets large ones."""
    needed = int(listed.sum())
    gq, gk = most
    while gq * gk > 1:
        if int(_any_in_group(listed, (gq, gk)).sum()) * gq * gk <= 1.25 * needed:
            return gq, gk
        gq, gk = (gq, gk // 2) if gk >= gq else (gq // 2, gk)
    return 1, 1
