"""Attention over a sequence split across processes: ring attention (context parallelism) on
``torch.distributed``, exact, forward and backward.

Each of the ``P`` ranks of a process group holds a shard of the sequence: its queries, keys and
values, ``(b, h, t / P, d)`` and ``(b, h_kv, s / P, d)``. The keys and values travel around the
ring (rank ``r`` sends to ``r + 1`` and receives from ``r - 1``) while each rank attends with its
queries to the keys it holds, the next transfer running behind the current block's compute. The
partial results merge through their log-sum-exp, so no rank ever holds the whole sequence, and a
row's result is the softmax over every key (Liu et al., 2023, "Ring Attention with Blockwise
Transformers"). The backward sends the keys and values around once more, each with the gradients
of its keys and values, which every rank adds to and which arrive home after ``P`` steps; each
block's weights are recomputed from the rows' whole lse, as the tiled kernel's backward does for
its own blocks.

A shard's keys travel in pieces of about ``KEY_PIECE`` keys of each chunk, in rounds: round ``j``
takes piece ``j`` of every shard once around the ring. A rank so holds two pieces of other ranks'
keys and values at a time, not two shards, and in the backward three pieces of gradient sums: at
4 ranks its peak extra memory is about a quarter of one process's on the whole sequence. With one
rank, the call is [`attention`][attnkit.functional.attention] of the shard, the whole sequence.

Positions are global: a causal mask, a window and ALiBi see where each chunk sits in the whole
sequence (queries aligned bottom-right when ``t != s``, as everywhere in attnkit); ``score_mod``
receives global ``q_idx``/``kv_idx``. ``layout`` says how the sequence was cut: ``"contiguous"``
(rank ``r`` holds chunk ``r`` of ``P``) or ``"zigzag"`` (chunks ``r`` and ``2P - 1 - r`` of
``2P``, which gives every rank the same causal work); [`shard`][attnkit.distributed.shard] and
[`unshard`][attnkit.distributed.unshard] cut and join a tensor that way.

A peer that dies or stops answering makes every rank that waits on it raise
[`RingError`][attnkit.distributed.RingError] within ``timeout`` seconds, naming the rank it waited
on, rather than hang until the process group's own timeout.

Runs over any backend of ``torch.distributed`` with point-to-point operations (gloo on CPUs,
NCCL on GPUs).
"""

from __future__ import annotations

import datetime
import itertools
import math
import os
import queue
import socket
import time
import traceback
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from attnkit import functional, masks, mods
from attnkit.backends import choose_backend, tiled
from attnkit.backends.base import Request

LAYOUTS = ("contiguous", "zigzag")
DEFAULT_TIMEOUT = 60.0
"""Seconds a rank waits for a peer before it raises [`RingError`][attnkit.distributed.RingError]."""

_NEG_INF = float("-inf")


class RingError(RuntimeError):
    """A peer of the ring failed or did not answer within the timeout.

    Attributes:
        rank: the rank (in the group) that raised.
        waited_on: the rank it was waiting on, or -1 when it waited on every rank (the check of
            the shards' shapes, before the ring starts).
        failed: the rank whose connection broke (it died, or stopped after a failure of its
            own), or None when it only went quiet (a dead link and a hung process look the same
            from here).
    """

    def __init__(self, message: str, rank: int, waited_on: int, failed: int | None = None):
        super().__init__(message)
        self.rank, self.waited_on, self.failed = rank, waited_on, failed


@dataclass(frozen=True)
class _Ring:
    """Where this rank sits (its group, its rank and the group's size) and how long it waits for
    a peer."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    timeout: float

    @staticmethod
    def of(group, timeout: float) -> _Ring:
        if isinstance(timeout, bool) or not (
            isinstance(timeout, (int, float)) and 0 < timeout < math.inf
        ):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "ring attention needs torch.distributed: call torch.distributed.init_process_group "
                "first"
            )
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise ValueError("this process is not a member of the group")
        return _Ring(group, rank, size, float(timeout))

    def peer(self, offset: int) -> int:
        """The group rank ``rank + offset`` (mod the size)."""
        return (self.rank + offset) % self.size

    def _global(self, peer: int) -> int:
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    def failed(self, error: Exception, peer: int, what: str) -> RingError:
        """The RingError of ``error``, met while exchanging ``what`` with group rank ``peer``:
        a broken connection (the peer stopped) or a timeout (it, or a link, went quiet)."""
        broke = "timed out" not in str(error).lower()
        if broke:
            said = (
                f"lost its connection to rank {peer} ({what}): rank {peer} stopped (it died, "
                "or raised an error of its own)"
            )
        else:
            said = (
                f"waited {self.timeout:g} s for rank {peer} ({what}) in vain: a peer died or "
                "a link is down"
            )
        return RingError(
            f"ring attention: rank {self.rank} of {self.size} {said}. The process group is "
            "unusable from here: destroy it.",
            self.rank,
            peer,
            peer if broke else None,
        )

    def exchange(self, outgoing: list[Tensor], incoming: list[Tensor], what: str) -> Callable:
        """Start sending ``outgoing`` to the next rank and receiving ``incoming`` from the
        previous one; returns the function that waits for both."""
        if not (outgoing or incoming):
            return lambda: None
        nxt, prev = self.peer(1), self.peer(-1)
        peers = [nxt] * len(outgoing) + [prev] * len(incoming)
        ops = [dist.P2POp(dist.isend, x, self._global(nxt), self.group) for x in outgoing]
        ops += [dist.P2POp(dist.irecv, x, self._global(prev), self.group) for x in incoming]
        if dist.get_backend(self.group) == dist.Backend.NCCL:  # NCCL's pairs must start together
            try:
                works = dist.batch_isend_irecv(ops)
            except RuntimeError as error:
                raise self.failed(error, prev, what) from error
        else:  # one at a time, so that a dead peer is named
            works = []
            for op, peer in zip(ops, peers):
                try:
                    works.append(op.op(op.tensor, op.peer, op.group))
                except RuntimeError as error:
                    raise self.failed(error, peer, what) from error

        def wait() -> None:
            for work, peer in zip(works, peers):
                try:
                    work.wait(timeout=datetime.timedelta(seconds=self.timeout))
                except RuntimeError as error:
                    raise self.failed(error, peer, what) from error

        return wait

    def all_gather(self, x: Tensor, what: str) -> list[Tensor]:
        gathered = [torch.empty_like(x) for _ in range(self.size)]
        try:
            work = dist.all_gather(gathered, x, group=self.group, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as error:
            broke = "timed out" not in str(error).lower()
            said = (
                "lost its connection to another rank: one stopped (it died, or raised an error "
                "of its own, such as a check of its arguments)"
                if broke
                else f"waited {self.timeout:g} s in vain: a peer died or a link is down"
            )
            raise RingError(
                f"ring attention: rank {self.rank} of {self.size}, gathering every rank's {what}, "
                f"{said}",
                self.rank,
                -1,
            ) from error
        return gathered


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
    ring = _Ring.of(group, DEFAULT_TIMEOUT)
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
    ring = _Ring.of(group, timeout)
    parts = ring.all_gather(x.detach().contiguous(), "part of the sequence")
    by_start = {}
    for part, pieces in zip(parts, chunks(x.shape[dim] * ring.size, ring.size, layout)):
        offset = 0
        for start, n in pieces:
            by_start[start] = part.narrow(dim, offset, n)
            offset += n
    return torch.cat([by_start[start] for start in sorted(by_start)], dim=dim)


@dataclass(frozen=True)
class ContextParallel:
    """How a module runs over a sequence split across the ranks of ``group``: pass it as
    ``MultiHeadAttention(...)(x, context_parallel=ContextParallel(...))``, ``x`` being this
    rank's shard cut by ``layout`` (see [`shard`][attnkit.distributed.shard]). The module's
    projections run on the shard, its RoPE at the tokens' global positions, and its attention
    call becomes [`ring_attention`][attnkit.distributed.ring_attention] with the same options.

    Example:
        ``out = mha(shard(x, 1, layout="zigzag"), context_parallel=ContextParallel(layout="zigzag"))``
        gives on each rank ``shard(mha(x), 1, layout="zigzag")``; the gradient of ``x`` is the
        shard of the whole one, and each parameter's is this rank's part: sum it over the
        group (DDP does), as for any parameter every rank holds.

    RoPE takes each token's index in the whole sequence as its position (a ``key_mask`` does not
    move the positions, unlike an unsplit call with left padding, where they count real tokens).
    """

    group: dist.ProcessGroup | None = None
    layout: str = "contiguous"
    timeout: float = DEFAULT_TIMEOUT

    def size(self) -> int:
        """How many ranks the sequence is split over."""
        return _Ring.of(self.group, self.timeout).size

    def positions(self, t: int, device: torch.device | None = None) -> Tensor:
        """The global positions ``(t,)`` of this rank's ``t`` tokens."""
        ring = _Ring.of(self.group, self.timeout)
        pieces = chunks(t * ring.size, ring.size, self.layout)[ring.rank]
        return torch.cat([torch.arange(start, start + n, device=device) for start, n in pieces])

    def attention(self, q: Tensor, k: Tensor, v: Tensor, **options) -> Tensor:
        """[`ring_attention`][attnkit.distributed.ring_attention] over this group and layout."""
        return ring_attention(
            q, k, v, group=self.group, layout=self.layout, timeout=self.timeout, **options
        )


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    layout: str = "contiguous",
    key_mask: Tensor | None = None,
    window: tuple[int, int] | None = None,
    alibi_slopes: Tensor | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    score_mod: mods.ScoreMod | None = None,
    return_lse: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    block_mask: BlockMask | None = None,
    mask_mod: mods.MaskMod | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """[`attention`][attnkit.functional.attention] over a sequence whose queries, keys and values
    are split along it over the ranks of ``group``: each rank passes its shard and gets its
    shard of the output (and of the lse). Every rank must call it, with shards of the same shape.
    It computes in the inputs' dtype, under autocast too. With one rank it is ``attention`` of
    the shard, the whole sequence (which, unlike a ring of several, takes a second derivative).

    Args:
        q: this rank's queries ``(b, h, t / P, d)``.
        k: this rank's keys ``(b, h_kv, s / P, d)`` (``h_kv`` divides ``h``: GQA, MQA).
        v: this rank's values ``(b, h_kv, s / P, d_v)``.
        group: the process group (the default group if None).
        causal: key ``j`` visible to query ``i`` iff ``j <= i + s - t``, in global positions.
        layout: how the sequence was cut, ``"contiguous"`` or ``"zigzag"`` (see
            [`shard`][attnkit.distributed.shard]); ``"zigzag"`` balances causal work.
        key_mask: this rank's part ``(b, s / P)`` of the key padding mask, True for a real token.
        window: ``(left, right)`` around each query's global position; -1 unbounded.
        alibi_slopes: ``(h,)``; the distances are global. Its gradient, like any tensor every rank
            holds a copy of, is this rank's part: sum it over the group (as DDP does).
        softcap: scores become ``softcap * tanh(score / softcap)``.
        scale: multiplies ``q . k``; ``1 / sqrt(d)`` by default.
        score_mod: as in [`attention`][attnkit.functional.attention], with global ``q_idx`` and
            ``kv_idx``; the gradients of the tensors it reads are this rank's part, as the
            slopes'.
        return_lse: also return this rank's lse ``(b, h, t / P)``, with gradients through it.
        timeout: seconds to wait for a peer before raising
            [`RingError`][attnkit.distributed.RingError].
        attn_mask: refused: a dense mask of the whole sequence is what ring attention avoids.
        dropout_p: refused (0 only).
        return_weights: refused: the weights are ``t x s``.
        block_mask: refused: its tables are for the whole sequence; pass its ``mask_mod``.
        mask_mod: as in [`attention`][attnkit.functional.attention], with global ``q_idx`` and
            ``kv_idx``; evaluated on each pair of pieces as they meet.

    Returns:
        This rank's output ``(b, h, t / P, d_v)``, or ``(out, lse)`` with ``return_lse``.

    Raises:
        ValueError: a refused option; shards whose shapes differ between ranks (on every rank);
            a length that does not fit the layout; no process group, or not a member of it.
        RingError: a peer died or did not answer within ``timeout`` seconds.
    """
    for name, given in (
        ("attn_mask", attn_mask is not None),
        ("dropout_p", dropout_p != 0.0),
        ("return_weights", return_weights),
        ("block_mask", block_mask is not None),
    ):
        if given:
            raise ValueError(f"ring_attention does not take {name}: {_REFUSED[name]}")
    ring = _Ring.of(group, timeout)
    options = {
        "key_mask": key_mask,
        "causal": causal,
        "window": window,
        "alibi_slopes": alibi_slopes,
        "softcap": softcap,
        "scale": scale,
        "score_mod": score_mod,
        "mask_mod": mask_mod,
    }
    functional._request(  # this shard's own checks: shapes, dtypes, options
        q, k, v, attn_mask=None, dropout_p=0.0, return_lse=False, return_weights=False, **options
    )
    t, s = _agree(
        ring,
        q,
        k,
        v,
        layout,
        causal=causal,
        key_mask=key_mask is not None,
        window=window,
        alibi_slopes=None if alibi_slopes is None else alibi_slopes.tolist(),
        softcap=softcap,
        scale=scale,
        score_mod=mods.name_of(score_mod) if score_mod is not None else None,
        mask_mod=mods.name_of(mask_mod) if mask_mod is not None else None,
        key_piece=KEY_PIECE,  # the pieces that travel must have the same sizes everywhere
    )
    if ring.size == 1:  # the shard is the whole sequence: attention of it, in the inputs' dtype
        with torch.autocast(q.device.type, enabled=False):
            return functional.attention(q, k, v, return_lse=return_lse, backend="tiled", **options)
    call = _Call.of(
        ring,
        t,
        s,
        layout,
        causal=causal,
        window=window,
        softcap=softcap,
        scale=scale,
        score_mod=score_mod,
        mask_mod=mask_mod,
    )
    piece = call.k_pieces[ring.rank][0]  # any pair: the tiled kernel's refusals
    qc, kc = call.q_pieces[0], piece.parts[0]
    rows = (slice(None), slice(None), qc.rows)
    k_first, v_first = (x.narrow(2, piece.homes[0], kc.length) for x in (k, v))
    first = call.request(q[rows], k_first, v_first, None, alibi_slopes, qc, kc)
    choose_backend("tiled", first, q[rows], k_first, v_first)  # raises if it cannot, saying why
    mod_tensors = functional._mod_tensors(score_mod, q)
    function = _RingAttentionWithMods if mod_tensors else _RingAttention
    out, lse = function.apply(q, k, v, alibi_slopes, key_mask, call, *mod_tensors)
    return (out, lse) if return_lse else out


_REFUSED = {
    "attn_mask": "a dense (t, s) mask of the whole sequence is what ring attention avoids; use "
    "causal, window, key_mask or score_mod",
    "dropout_p": "dropout on the weights is not supported across the ring (pass 0.0)",
    "return_weights": "the weights are t x s, which no rank holds",
    "block_mask": "a BlockMask's tables are for the whole sequence; pass its mask_mod instead",
}


_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _agree(ring: _Ring, q, k, v, layout: str, **options) -> tuple[int, int]:
    """Check that every rank holds shards of one shape, dtype and device and asked for the same
    options; return the global query and key lengths. The ranks compare what each holds, so all
    of them raise the same error."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    t = q.shape[2]
    described = {
        "q": tuple(q.shape),
        "k": tuple(k.shape),
        "v": tuple(v.shape),
        "dtype": str(q.dtype).removeprefix("torch."),
        "device": q.device.type,
        "layout": layout,
        **options,
    }
    mine = [float(x) for x in (*q.shape, *k.shape, *v.shape)]
    mine += [_DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1, q.is_cuda, LAYOUTS.index(layout)]
    mine += [zlib.crc32(repr(value).encode()) for value in options.values()]  # one number each
    everyone = ring.all_gather(torch.tensor(mine, dtype=torch.float64, device=q.device), "shards")
    if any(not torch.equal(x, everyone[0]) for x in everyone):
        raise ValueError(
            f"ring_attention: the ranks' shards or options differ (rank {ring.rank} has "
            f"{described}); every rank must pass shards of one shape, dtype and device, and the "
            "same options"
        )
    t_all, s_all = t * ring.size, k.shape[2] * ring.size
    chunks(t_all, ring.size, layout), chunks(s_all, ring.size, layout)  # raise if they do not fit
    return t_all, s_all


@dataclass(frozen=True)
class _Chunk:
    """Rows that lie together: ``length`` rows from ``offset`` in the tensor that holds them
    (a shard, or a piece of one), which sit from ``start`` in the whole sequence."""

    offset: int
    start: int
    length: int

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.length)

    def slices(self, count: int) -> list[_Chunk]:
        """The chunk cut into ``count`` near-equal slices."""
        cuts = [self.length * j // count for j in range(count + 1)]
        return [_Chunk(self.offset + a, self.start + a, b - a) for a, b in itertools.pairwise(cuts)]


def _local(pieces: list[tuple[int, int]]) -> list[_Chunk]:
    offsets = [0]
    for _, n in pieces:
        offsets.append(offsets[-1] + n)
    return [_Chunk(o, start, n) for o, (start, n) in zip(offsets, pieces)]


@dataclass(frozen=True)
class _Piece:
    """Piece ``j`` of ``count`` of a shard's keys, as it travels: the ``j``-th of ``count``
    near-equal slices of each of the shard's chunks, joined. ``parts`` are those slices as the
    piece holds them; ``homes`` their offsets in the shard."""

    parts: tuple[_Chunk, ...]
    homes: tuple[int, ...]

    @staticmethod
    def cut_up(shard: list[_Chunk], count: int) -> list[_Piece]:
        """The ``count`` pieces of a shard of these chunks."""
        pieces = []
        for parts in zip(*(chunk.slices(count) for chunk in shard)):
            offsets = itertools.accumulate((p.length for p in parts), initial=0)
            pieces.append(
                _Piece(
                    tuple(_Chunk(o, p.start, p.length) for o, p in zip(offsets, parts)),
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


KEY_PIECE = 1024
"""About how many keys of a chunk travel together as a piece (a chunk is cut into near-equal
slices). Each rank holds two pieces of other ranks' keys and values at a time (the one it computes
with, the one arriving), and in the backward three of their gradients' sums, so smaller pieces take
less memory. How well a transfer hides behind the compute does not depend on the piece's size
(both grow with it); the fixed cost of each step does."""

QUERY_PIECE = 2048
"""About how many queries of a chunk one call of the tiled kernel takes: the call's own buffers
(its queries scaled, their gradients) grow with it, and the fixed cost of a call shrinks."""


def _pieces(length: int, piece: int) -> int:
    """How many near-equal slices of about ``piece`` cut a chunk of ``length``."""
    return max(1, -(-length // piece))


@dataclass(frozen=True)
class _Call:
    """One call's options and geometry: the pieces of this rank's queries and of every rank's
    keys."""

    ring: _Ring
    q_pieces: list[_Chunk]
    k_pieces: list[list[_Piece]]  # [rank][j]
    t: int
    s: int
    causal: bool
    window: tuple[int, int] | None
    softcap: float | None
    scale: float | None
    score_mod: mods.ScoreMod | None
    mask_mod: mods.MaskMod | None = None

    @staticmethod
    def of(ring: _Ring, t: int, s: int, layout: str, **options) -> _Call:
        q_chunks = _local(chunks(t, ring.size, layout)[ring.rank])
        k_chunks = [_local(c) for c in chunks(s, ring.size, layout)]
        count = _pieces(k_chunks[0][0].length, KEY_PIECE)
        return _Call(
            ring=ring,
            q_pieces=[p for c in q_chunks for p in c.slices(_pieces(c.length, QUERY_PIECE))],
            k_pieces=[_Piece.cut_up(shard, count) for shard in k_chunks],
            t=t,
            s=s,
            **options,
        )

    def schedule(self) -> Iterator[tuple[int, int, int]]:
        """``(j, step, src)`` of each step: round ``j`` brings piece ``j`` of every rank's keys
        around the ring, this rank's own first (step 0), then that of rank ``src``, which arrives
        from the previous rank while the one before is computed."""
        for j in range(len(self.k_pieces[0])):
            for step in range(self.ring.size):
                yield j, step, self.ring.peer(-step)

    def pairs(self, src: int, j: int) -> list[tuple[_Chunk, _Chunk]]:
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

    def request(self, q, k, v, key_mask, slopes, qc: _Chunk, kc: _Chunk) -> Request:
        """The request of one pair: its masks and ALiBi in global positions, its score_mod with
        global indices."""
        shift = (qc.start + self.s - self.t) - kc.start - (kc.length - qc.length)
        given = {"score_mod": self.score_mod, "mask_mod": self.mask_mod}
        at = mods.at_positions(given, qc.start, kc.start)
        return functional._request(
            q,
            k,
            v,
            attn_mask=None,
            key_mask=key_mask,
            causal=self.causal,
            window=self.window,
            alibi_slopes=slopes,
            softcap=self.softcap,
            scale=self.scale,
            dropout_p=0.0,
            return_lse=True,
            return_weights=False,
            score_mod=at["score_mod"],
            mask_mod=at["mask_mod"],
            shift=shift,
        )


def _merge(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """Join a block's ``(out_b, lse_b)`` into the rows' running ``(out, lse)``, in place (``out_b``
    is spent). A row that has seen no allowed key on either side stays 0 and -inf (the usual
    sigmoid form of this merge gives NaN there); a NaN lse spreads."""
    both = torch.logaddexp(lse, lse_b)
    base = both.masked_fill(both == _NEG_INF, 0.0)
    out.mul_(torch.exp(lse - base)[..., None]).add_(out_b.mul_(torch.exp(lse_b - base)[..., None]))
    lse.copy_(both)


def _forward(q, k, v, slopes, key_mask, call: _Call) -> tuple[Tensor, Tensor]:
    with torch.autocast(q.device.type, enabled=False):  # in the inputs' dtype, as in one process
        return _ring_forward(q, k, v, slopes, key_mask, call)


def _ring_forward(q, k, v, slopes, key_mask, call: _Call) -> tuple[Tensor, Tensor]:
    ring = call.ring
    stats = torch.promote_types(q.dtype, torch.float32)
    b, h, t, _ = q.shape
    out = q.new_zeros(b, h, t, v.shape[-1], dtype=stats)
    lse = q.new_full((b, h, t), _NEG_INF, dtype=stats)

    def attend(held: list[Tensor], src: int, j: int) -> None:
        """Merge this rank's queries' attention to piece ``j`` of rank ``src``'s keys into the
        rows' running output and lse."""
        k_src, v_src, mask_src = _received(held)
        for qc, kc in call.pairs(src, j):
            qi, ki, vi = q[:, :, qc.rows], k_src[:, :, kc.rows], v_src[:, :, kc.rows]
            mi = None if mask_src is None else mask_src[:, kc.rows]
            request = call.request(qi, ki, vi, mi, slopes, qc, kc)
            out_b, lse_b = tiled.partial(qi, ki, vi, request)  # in `stats`: rounded at the end
            _merge(out[:, :, qc.rows], lse[:, :, qc.rows], out_b, lse_b)

    held: list[Tensor] = []
    for j, step, src in call.schedule():
        if step == 0:
            held = _travelling(k, v, key_mask, call.k_pieces[ring.rank][j])
        goes_on = step < ring.size - 1  # to the next rank, which computes with it next step
        incoming = [torch.empty_like(x) for x in held] if goes_on else []
        arrived = ring.exchange(held if goes_on else [], incoming, "keys and values")
        attend(held, src, j)
        arrived()
        held = incoming
    return out.to(q.dtype), lse


def _backward(q, k, v, slopes, key_mask, out, lse, dout, dlse, mod_tensors, call: _Call):
    """The gradients of this rank's q, k, v (and of the slopes and the mod's tensors: this rank's
    part). The pieces of keys and values go around as in the forward. Each step computes the
    gradients of the piece it holds from this rank's queries while the sum of the ranks before it
    for that piece arrives; the sum then goes on, and after a round reaches the piece's own rank
    (during the next round's first step, or after the last round)."""
    ring = call.ring
    stats = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros_like(q, dtype=stats)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)  # each row placed once, when its sum is home
    slopes_grad = slopes is not None and slopes.requires_grad
    dslopes = torch.zeros_like(slopes) if slopes_grad else None
    mod_grads: list[Tensor | None] = [None] * len(mod_tensors)

    def gradients(held: list[Tensor], src: int, j: int) -> list[Tensor]:
        """dK and dV of piece ``j`` of rank ``src``'s keys from this rank's queries, in `stats`;
        adds this rank's queries' part into dq, dslopes and mod_grads."""
        nonlocal dslopes, mod_grads
        k_src, v_src, mask_src = _received(held)
        dk_piece = k_src.new_zeros(k_src.shape, dtype=stats)
        dv_piece = v_src.new_zeros(v_src.shape, dtype=stats)
        for qc, kc in call.pairs(src, j):
            qi, ki, vi = q[:, :, qc.rows], k_src[:, :, kc.rows], v_src[:, :, kc.rows]
            mi = None if mask_src is None else mask_src[:, kc.rows]
            request = call.request(qi, ki, vi, mi, slopes, qc, kc)._replace(mod_tensors=mod_tensors)
            rows = (slice(None), slice(None), qc.rows)
            gq, gk, gv, gs, gm = tiled.backward(
                qi,
                ki,
                vi,
                out[rows],
                lse[rows],
                None if dout is None else dout[rows],
                None if dlse is None else dlse[rows],
                request,
                tiled.spec_of(request),
                slopes_grad=slopes_grad,
                cast=False,
            )
            dq[rows] += gq
            dk_piece[:, :, kc.rows] += gk
            dv_piece[:, :, kc.rows] += gv
            if gs is not None:
                dslopes += gs
            mod_grads = [
                a if b is None else b if a is None else a + b for a, b in zip(mod_grads, gm)
            ]
        return [dk_piece, dv_piece]

    def home(j: int, sums: list[Tensor]) -> None:
        """The sums over every rank of this rank's piece ``j``: its keys' and values' gradients."""
        piece = call.k_pieces[ring.rank][j]
        piece.place(sums[0], dk, 2)
        piece.place(sums[1], dv, 2)

    held: list[Tensor] = []
    sums: list[Tensor] = []  # of the piece computed last step, for the next rank
    for j, step, src in call.schedule():
        if step == 0:
            held = _travelling(k, v, key_mask, call.k_pieces[ring.rank][j])
        goes_on = step < ring.size - 1
        incoming = [torch.empty_like(x) for x in held] if goes_on else []
        before = [torch.empty_like(x) for x in sums]  # step 0: this rank's piece j - 1, home
        arrived = ring.exchange(
            (held if goes_on else []) + sums, incoming + before, "keys, values and gradients"
        )
        grads = gradients(held, src, j)
        arrived()
        if step > 0:  # the sums of the ranks before this one for the piece held
            grads = [g.add_(x) for g, x in zip(grads, before)]
        elif before:
            home(j - 1, before)
        sums, held = grads, incoming
    back = [torch.empty_like(x) for x in sums]  # the last piece's sums go home
    ring.exchange(sums, back, "gradients of keys and values")()
    home(len(call.k_pieces[ring.rank]) - 1, back)
    return dq.to(q.dtype), dk, dv, dslopes, mod_grads


def _travelling(k: Tensor, v: Tensor, key_mask: Tensor | None, piece: _Piece) -> list[Tensor]:
    """What goes around the ring of this rank's ``piece``: its keys and values, contiguous, their
    padding zeroed (it may hold anything, and 0 times a NaN there would reach the gradients), and
    its key mask as bytes."""
    mask = None if key_mask is None else piece.cut(key_mask, 1)
    held = [masks.zero_padding(piece.cut(x, 2), mask) for x in (k, v)]
    if mask is not None:
        held.append(mask.to(torch.uint8))
    return held


def _received(held: list[Tensor]) -> tuple[Tensor, Tensor, Tensor | None]:
    key_mask = held[2].bool() if len(held) > 2 else None
    return held[0], held[1], key_mask


class _RingAttention(torch.autograd.Function):
    """``(out, lse)`` of this rank's queries over every rank's keys; saves only this rank's
    shards, its output and its lse."""

    @staticmethod
    def forward(ctx, q, k, v, slopes, key_mask, call: _Call):
        out, lse = _forward(q, k, v, slopes, key_mask, call)
        ctx.save_for_backward(q, k, v, slopes, key_mask, out, lse)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "ring attention has no second derivative: its backward cannot run with "
                "create_graph=True"
            )
        q, k, v, slopes, key_mask, out, lse, *mod_tensors = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv, dslopes, mod_grads = _backward(
                q, k, v, slopes, key_mask, out, lse, dout, dlse, tuple(mod_tensors), ctx.call
            )
        return dq, dk, dv, dslopes, None, None, *mod_grads


class _RingAttentionWithMods(_RingAttention):
    """The same, for a ``score_mod`` that reads tensors requiring grad: they follow as inputs."""

    @staticmethod
    def forward(ctx, q, k, v, slopes, key_mask, call: _Call, *mod_tensors):
        out, lse = _forward(q, k, v, slopes, key_mask, call)
        ctx.save_for_backward(q, k, v, slopes, key_mask, out, lse, *mod_tensors)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return out, lse


def run_local(
    world: int, target: Callable, *args: Any, lost: tuple[int, ...] = (), wait: float = 3600.0
) -> list:
    """``target(rank, world, *args)`` on ``world`` new processes of this machine, joined in a
    gloo group over loopback, one thread each: their return values, by rank. For trying ring
    attention on one machine, for its tests and for ``attnkit bench --ring``. ``target`` must be
    a module's function (the new processes import it).

    Args:
        world: how many processes.
        target: ``target(rank, world, *args)``, run in each process after it has joined.
        *args: passed on to ``target``.
        lost: ranks not waited for (their result is None), killed at the end: for tests of a
            rank that dies or hangs.
        wait: seconds to wait for each result.

    Raises:
        RuntimeError: a rank raised (with its traceback), or did not answer within ``wait``.
    """
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ranks = [
        context.Process(target=_local_rank, args=(rank, world, port, target, args, results))
        for rank in range(world)
    ]
    for p in ranks:
        p.start()
    got: dict[int, object] = dict.fromkeys(lost)
    deadline = time.monotonic() + wait
    try:
        while len(got) < world:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                silent = sorted(set(range(world)) - set(got))
                dead = [r for r in silent if ranks[r].exitcode is not None]
                if dead:  # a crash, the OOM killer, a failed start: no result will come
                    raise RuntimeError(
                        f"ranks {dead} ended without a result (exit codes "
                        f"{[ranks[r].exitcode for r in dead]})"
                    ) from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ranks {silent} did not answer within {wait:g} s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} raised:\n{value}")
            got[rank] = value
    finally:
        for rank, p in enumerate(ranks):
            p.join(timeout=0 if rank in lost else 30)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(world)]


def _local_rank(rank, world, port, target, args, results) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=600),
        )
        results.put((rank, True, target(rank, world, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # the result is on its way before the process ends
        if dist.is_initialized():
            dist.destroy_process_group()
        os._exit(0)  # no exit handler may wait on a peer that failed
