"""attnkit.distributed.layout in one process: how a sequence is cut over the ranks (chunks), and
the pieces a shard's keys travel in (Chunk.slices, Piece.cut_up, cut and place). shard and
unshard need a process group: tests/distributed/test_ring.py runs them on real processes."""

from __future__ import annotations

import pytest
import torch

from attnkit.distributed import LAYOUTS, chunks
from attnkit.distributed.layout import Chunk, Piece, local, pieces_of


def test_contiguous_gives_each_rank_one_chunk_in_order():
    assert chunks(12, 3, "contiguous") == [[(0, 4)], [(4, 4)], [(8, 4)]]
    assert chunks(5, 1, "contiguous") == [[(0, 5)]]


def test_zigzag_gives_rank_r_chunks_r_and_2p_minus_1_minus_r():
    assert chunks(16, 4, "zigzag") == [
        [(0, 2), (14, 2)],
        [(2, 2), (12, 2)],
        [(4, 2), (10, 2)],
        [(6, 2), (8, 2)],
    ]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_the_ranks_chunks_cover_the_sequence_once(layout, size):
    n = 2 * size * 3
    covered = sorted(
        position
        for pieces in chunks(n, size, layout)
        for start, length in pieces
        for position in range(start, start + length)
    )
    assert covered == list(range(n))
    assert len({sum(length for _, length in pieces) for pieces in chunks(n, size, layout)}) == 1


def test_a_length_that_does_not_split_or_an_unknown_layout_is_refused():
    with pytest.raises(ValueError, match=r"a sequence of 10 does not split into 4 equal chunks "):
        chunks(10, 2, "zigzag")
    with pytest.raises(ValueError, match=r"pad it to a multiple of 3 and mask the padding"):
        chunks(10, 3, "contiguous")
    with pytest.raises(ValueError, match=r"layout must be one of 'contiguous', 'zigzag', got 'x'"):
        chunks(12, 2, "x")


def test_a_chunk_is_cut_into_near_equal_slices_that_keep_their_positions():
    chunk = Chunk(offset=3, start=40, length=10)
    slices = chunk.slices(3)
    assert [s.length for s in slices] == [3, 3, 4]
    assert [(s.offset, s.start) for s in slices] == [(3, 40), (6, 43), (9, 46)]
    assert [s.rows for s in slices] == [slice(3, 6), slice(6, 9), slice(9, 13)]
    assert chunk.slices(1) == [chunk]


def test_local_lays_a_ranks_chunks_one_after_the_other():
    assert local([(2, 3), (13, 3)]) == [Chunk(0, 2, 3), Chunk(3, 13, 3)]


def test_pieces_of_a_chunk_are_about_the_asked_size():
    assert [pieces_of(n, 4) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]
    assert pieces_of(0, 4) == 1


@pytest.mark.parametrize("count", [1, 2, 3])
def test_pieces_take_the_same_slice_of_every_chunk_and_put_them_back(count):
    shard = local(chunks(24, 2, "zigzag")[1])  # rank 1 of 2: positions 6..11 and 12..17
    pieces = Piece.cut_up(shard, count)
    assert len(pieces) == count
    x = torch.arange(12.0).view(1, 12).expand(2, 12) * torch.tensor([[1.0], [-1.0]])
    rebuilt = torch.full_like(x, float("nan"))
    seen = []
    for piece in pieces:
        part = piece.cut(x, 1)
        assert part.is_contiguous() and part.shape[1] == sum(c.length for c in piece.parts)
        # a piece's parts lie one after the other in it, each from its home in the shard
        for home, c in zip(piece.homes, piece.parts):
            assert torch.equal(part[:, c.rows], x[:, home : home + c.length])
            seen += [c.start + i for i in range(c.length)]
        assert len(piece.parts) == 2  # one slice of each of the rank's two chunks
        piece.place(part, rebuilt, 1)
    assert torch.equal(rebuilt, x)
    assert sorted(seen) == list(range(6, 18))  # every key of the shard, once, at its position
