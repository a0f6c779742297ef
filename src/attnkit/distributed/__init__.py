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

The package, one file per idea: ``transport`` (sends and receives with a timeout, and
[`RingError`][attnkit.distributed.RingError]), ``layout`` (how a sequence is cut, and the pieces
that travel), ``ring`` ([`ring_attention`][attnkit.distributed.ring_attention]: checks, the
ranks' agreement, the plan of a call), ``passes`` (the forward and backward around the ring) and
``module`` ([`ContextParallel`][attnkit.distributed.ContextParallel]).
"""

from attnkit.distributed.layout import LAYOUTS, chunks, shard, unshard
from attnkit.distributed.module import ContextParallel
from attnkit.distributed.plan import KEY_PIECE, QUERY_PIECE
from attnkit.distributed.ring import ring_attention
from attnkit.distributed.transport import DEFAULT_TIMEOUT, RingError

__all__ = [
    "DEFAULT_TIMEOUT",
    "KEY_PIECE",
    "LAYOUTS",
    "QUERY_PIECE",
    "ContextParallel",
    "RingError",
    "chunks",
    "ring_attention",
    "shard",
    "unshard",
]
