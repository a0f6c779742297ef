"""attnkit.distributed.plan: how one rank's call is cut up (pieces of queries and of every rank's
keys, in the sizes forced or by default), the order in which the keys travel, which pairs are
computed, and the call of each pair (masks in global positions). No process group: a plan only
reads the ring's rank and size. What the passes make of it: tests/distributed/test_passes.py."""

from __future__ import annotations

import pytest
import torch

from attnkit import force
from attnkit.distributed.plan import KEY_PIECE, QUERY_PIECE, RingPlan, piece_sizes
from attnkit.distributed.transport import Ring
from attnkit.functional import checked_call


def plan_of(rank, size, *, n=24, layout="contiguous", causal=False, window=None):
    q = torch.randn(1, 2, n // size, 4)
    ring = Ring(None, rank, size, 60.0)
    call = checked_call(q, q, q, causal=causal, window=window)
    return RingPlan.of(ring, n, n, layout, call, causal, window, None)


def test_the_pieces_follow_the_forced_sizes_and_cover_the_shard():
    with force.pieces(3, 5):
        plan = plan_of(1, 3)  # a shard of 8 rows, from row 8
    assert [(p.start, p.length) for p in plan.q_pieces] == [(8, 4), (12, 4)]  # 2 of about 5
    assert len(plan.k_pieces) == 3 and all(len(pieces) == 3 for pieces in plan.k_pieces)
    keys = [part for piece in plan.k_pieces[2] for part in piece.parts]
    assert sum(part.length for part in keys) == 8 and keys[0].start == 16
    assert plan.shard_call.q is None  # the plan keeps the call's options, not its tensors


def test_the_default_sizes_are_the_modules_and_forcing_one_keeps_the_other():
    assert piece_sizes() == (KEY_PIECE, QUERY_PIECE)
    with force.pieces(query_piece=7):
        assert piece_sizes() == (KEY_PIECE, 7)
    assert len(plan_of(0, 2).q_pieces) == 1  # 12 rows: one piece of at most 2048


def test_each_round_brings_the_ranks_own_keys_first_then_those_of_the_ranks_before():
    with force.pieces(6):
        plan = plan_of(1, 3)  # 8 keys a shard: two pieces, so two rounds
    assert list(plan.schedule()) == [
        (0, 0, 1),
        (0, 1, 0),
        (0, 2, 2),
        (1, 0, 1),
        (1, 1, 0),
        (1, 2, 2),
    ]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_only_the_pairs_where_a_query_may_see_a_key_are_computed(layout):
    size = 3
    for rank in range(size):
        full, causal = (
            plan_of(rank, size, layout=layout),
            plan_of(rank, size, layout=layout, causal=True),
        )
        for src in range(size):
            every = full.pairs(src, 0)
            assert len(every) == len(full.q_pieces) * len(full.k_pieces[src][0].parts)
            seen = causal.pairs(src, 0)
            for (
                qc,
                kc,
            ) in every:  # a pair is kept exactly where its first key is not after its last query
                assert ((qc, kc) in seen) == (kc.start <= qc.start + qc.length - 1)


@pytest.mark.parametrize(
    ("causal", "window"), [(True, None), (False, (2, 1)), (True, (3, 0))], ids=str
)
def test_a_pairs_call_masks_as_the_whole_sequence_would_at_its_global_positions(causal, window):
    n, size = 24, 3
    rows, cols = torch.arange(n)[:, None], torch.arange(n)
    whole = torch.ones(n, n, dtype=torch.bool)
    if causal:
        whole &= cols <= rows
    if window is not None:
        whole &= (cols >= rows - window[0]) & (cols <= rows + window[1])
    with force.pieces(3, 5):
        plan = plan_of(2, size, layout="zigzag", causal=causal, window=window)
    q = torch.randn(1, 2, n // size, 4)
    checked = 0
    for src in range(size):
        for j in range(len(plan.k_pieces[src])):
            for qc, kc in plan.pairs(src, j):
                sub_q, sub_k = q[:, :, : qc.length], q[:, :, : kc.length]
                call = plan.pair(sub_q, sub_k, sub_k, None, None, (), qc, kc)
                allowed = call.masks.allowed(qc.length, kc.length, q.device)
                want = whole[qc.start : qc.start + qc.length, kc.start : kc.start + kc.length]
                got = torch.ones_like(want) if allowed is None else allowed.reshape(want.shape)
                assert torch.equal(got, want), (qc, kc)
                checked += 1
    assert checked > 3
