"""How a sequence is cut over the ranks (``contiguous`` or ``zigzag``), and the pieces a shard's
keys travel in."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from attnkit.distributed.transport import DEFAULT_TIMEOUT, Ring

LAYOUTS = ("contiguous", "zigzag")


def chunks(n: int, size: int, layout: str) -> list[list[tuple[int, int]]]:
    """For each rank of ``size``, the ``(start, length)`` of the pieces of a sequence of ``n``
    that it holds under ``layout``, in the order it holds them.

    Raises:
        ValueError: ``layout`` is unknown, or ``n`` does not split into its equal chunks.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    parts = size if layout == "contiguous" else 2 * size
    if n % parts:
        raise ValueError(
            f"a sequence of {n} does not split into {parts} equal chunks ({layout} layout over "
            f"{size} ranks): pad it to a multiple of {parts} and mask the padding with key_mask"
        )
    c = n // parts
    if layout == "contiguous":
        return [[(r * c, c)] for r in range(size)]
    return [[(r * c, c), ((2 * size - 1 - r) * c, c)] for r in range(size)]


def shard(
    x: Tensor, dim: int, group: dist.ProcessGroup | None = None, layout: str = "contiguous"
) -> Tensor:
    """This rank's part of ``x`` (the whole sequence along ``dim``) under ``layout``.

    Example:
        On rank 1 of 2, ``shard(torch.arange(8), 0, layout="zigzag")`` is ``tensor([2, 3, 4, 5])``.
    """
    ring = Ring.of(group, DEFAULT_TIMEOUT)
    pieces = chunks(x.shape[dim], ring.size, layout)[ring.rank]
    return torch.cat([x.narrow(dim, start, n) for start, n in pieces], dim=dim)


def unshard(
    x: Tensor,
    dim: int,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    timeout: float = DEFAULT_TIMEOUT,
) -> Tensor:
    """The whole sequence along ``dim``, on every rank, from every rank's part ``x`` (an
    all-gather): the inverse of [`shard`][attnkit.distributed.shard]. No gradient flows through
    it."""
    ring = Ring.of(group, timeout)
    parts = ring.all_gather(x.detach().contiguous(), "part of the sequence")
    by_start = {}
    for part, pieces in zip(parts, chunks(x.shape[dim] * ring.size, ring.size, layout)):
        offset = 0
        for start, n in pieces:
            by_start[start] = part.narrow(dim, offset, n)
            offset += n
    return torch.cat([by_start[start] for start in sorted(by_start)], dim=dim)


@dataclass(frozen=True)
class Chunk:
    """Rows that lie together: ``length`` rows from ``offset`` in the tensor that holds them
    (a shard, or a piece of one), which sit from ``start`` in the whole sequence."""

    offset: int
    start: int
    length: int

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.length)

    def slices(self, count: int) -> list[Chunk]:
        """The chunk cut into ``count`` near-equal slices."""
        cuts = [self.length * j // count for j in range(count + 1)]
        return [Chunk(self.offset + a, self.start + a, b - a) for a, b in itertools.pairwise(cuts)]


def local(pieces: list[tuple[int, int]]) -> list[Chunk]:
    offsets = [0]
    for _, n in pieces:
        offsets.append(offsets[-1] + n)
    return [Chunk(o, start, n) for o, (start, n) in zip(offsets, pieces)]


@dataclass(frozen=True)
class Piece:
    """Piece ``j`` of ``count`` of a shard's keys, as it travels: the ``j``-th of ``count``
    near-equal slices of each of the shard's chunks, joined. ``parts`` are those slices as the
    piece holds them; ``homes`` their offsets in the shard."""

    parts: tuple[Chunk, ...]
    homes: tuple[int, ...]

    @staticmethod
    def cut_up(shard: list[Chunk], count: int) -> list[Piece]:
        """The ``count`` pieces of a shard of these chunks."""
        pieces = []
        for parts in zip(*(chunk.slices(count) for chunk in shard)):
            offsets = itertools.accumulate((p.length for p in parts), initial=0)
            pieces.append(
                Piece(
                    tuple(Chunk(o, p.start, p.length) for o, p in zip(offsets, parts)),
                    tuple(p.offset for p in parts),
                )
            )
        return pieces

    def cut(self, x: Tensor, dim: int) -> Tensor:
        """This piece of the shard ``x``, a contiguous copy (it travels)."""
        return torch.cat([x.narrow(dim, h, c.length) for h, c in zip(self.homes, self.parts)], dim)

    def place(self, x: Tensor, into: Tensor, dim: int) -> None:
        """Copy ``x``, this piece, to its rows of the shard ``into``."""
        for h, c in zip(self.homes, self.parts):
            into.narrow(dim, h, c.length).copy_(x.narrow(dim, c.offset, c.length))


def pieces_of(length: int, piece: int) -> int:
    """How many near-equal slices of about ``piece`` cut a chunk of ``length``."""
    return max(1, -(-length // piece))
