"""One ring call's plan: the pieces of this rank's queries and of every rank's keys, the order in
which they travel, and the call of each (query piece, key part) pair that may meet, made from the
checked call of this rank's shard. `distributed.ring` makes it;
`distributed.passes` walks it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import Tensor

from attnkit import force, masks, mods
from attnkit.block_mask import create_block_mask
from attnkit.call import Call, call_of
from attnkit.distributed.layout import Chunk, Piece, chunks, local, pieces_of
from attnkit.distributed.transport import Ring

KEY_PIECE = 1024
"""About how many keys of a chunk travel together as a piece (a chunk is cut into near-equal
slices). Each rank holds two pieces of other ranks' keys and values at a time (the one it computes
with, the one arriving), and in the backward three of their gradients' sums, so smaller pieces take
less memory. How well a transfer hides behind the compute does not depend on the piece's size
(both grow with it); the fixed cost of each step does."""

QUERY_PIECE = 2048
"""About how many queries of a chunk one call of the tiled kernel takes: the call's own buffers
(its queries scaled, their gradients) grow with it, and the fixed cost of a call shrinks."""


def piece_sizes() -> tuple[int, int]:
    """``(key_piece, query_piece)``: `KEY_PIECE` and `QUERY_PIECE`, or as
    [forced][attnkit.force.pieces]."""
    key_piece, query_piece = force.piece_sizes()
    return key_piece or KEY_PIECE, query_piece or QUERY_PIECE


@dataclass(frozen=True)
class RingPlan:
    """One call's geometry and options: the pieces of this rank's queries and of every rank's
    keys, and the checked call of this rank's shard, from which each pair's call is made."""

    ring: Ring
    q_pieces: list[Chunk]
    k_pieces: list[list[Piece]]  # [rank][j]
    t: int
    s: int
    shard_call: Call  # without its tensors
    causal: bool
    window: tuple[int, int] | None
    mask_mod: mods.MaskMod | None = None

    @staticmethod
    def of(
        ring: Ring,
        t: int,
        s: int,
        layout: str,
        shard_call: Call,
        causal: bool,
        window: tuple[int, int] | None,
        mask_mod: mods.MaskMod | None,
    ) -> RingPlan:
        q_chunks = local(chunks(t, ring.size, layout)[ring.rank])
        k_chunks = [local(c) for c in chunks(s, ring.size, layout)]
        key_piece, query_piece = piece_sizes()
        count = pieces_of(k_chunks[0][0].length, key_piece)
        return RingPlan(
            ring=ring,
            q_pieces=[p for c in q_chunks for p in c.slices(pieces_of(c.length, query_piece))],
            k_pieces=[Piece.cut_up(shard, count) for shard in k_chunks],
            t=t,
            s=s,
            shard_call=shard_call.with_tensors(*[None] * 6),
            causal=causal,
            window=window,
            mask_mod=mask_mod,
        )

    def schedule(self) -> Iterator[tuple[int, int, int]]:
        """``(j, step, src)`` of each step: round ``j`` brings piece ``j`` of every rank's keys
        around the ring, this rank's own first (step 0), then that of rank ``src``, which arrives
        from the previous rank while the one before is computed."""
        for j in range(len(self.k_pieces[0])):
            for step in range(self.ring.size):
                yield j, step, self.ring.peer(-step)

    def pairs(self, src: int, j: int) -> list[tuple[Chunk, Chunk]]:
        """The (query piece, key part) pairs of piece ``j`` of rank ``src``'s keys in which some
        query may see some key by position: the others are never computed."""
        limits = masks.merge_window(self.causal, self.window, self.t, self.s)
        left, right = limits or (-1, -1)
        visible = []
        for qc in self.q_pieces:
            first, last = qc.start + self.s - self.t, qc.start + qc.length - 1 + self.s - self.t
            for kc in self.k_pieces[src][j].parts:
                if kc.length == 0:
                    continue
                if right >= 0 and kc.start > last + right:
                    continue
                if left >= 0 and kc.start + kc.length - 1 < first - left:
                    continue
                visible.append((qc, kc))
        return visible

    def pair(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_mask: Tensor | None,
        slopes: Tensor | None,
        mod_tensors: tuple[Tensor, ...],
        qc: Chunk,
        kc: Chunk,
    ) -> Call:
        """The call of one pair: the shard's call with its masks and ALiBi in global positions and
        its mods seeing global indices (nothing is checked again)."""
        shift = (qc.start + self.s - self.t) - kc.start - (kc.length - qc.length)
        base = self.shard_call
        at = mods.at_positions(
            {"score_mod": base.score_mod, "mask_mod": self.mask_mod}, qc.start, kc.start
        )
        b, h, t, _ = q.shape
        s = k.shape[2]
        window = masks.merge_window(self.causal, self.window, t, s, shift)
        block_mask = None
        if at["mask_mod"] is not None:
            block_mask = create_block_mask(at["mask_mod"], b, h, t, s, device=q.device)
        return call_of(
            q,
            k,
            v,
            masks.Masks(window, key_mask, None, shift),
            base.scale,
            softcap=base.softcap,
            alibi_slopes=slopes,
            return_lse=True,
            score_mod=at["score_mod"],
            block_mask=block_mask,
            mod_tensors=mod_tensors,
            mod_adds=base.mod_adds,
        )
