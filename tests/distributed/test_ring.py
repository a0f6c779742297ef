"""Ring attention (attnkit.distributed) on real processes: gloo over TCP on loopback, world sizes
1 to 4, against float64 attention of the whole sequence in one process."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.distributed import ring_attention
from helpers import ring_ranks

CASES = {  # lengths: contiguous splits into 1..4 chunks (12), zigzag into 2..8 (24)
    "full, whole shards travel": {"t": 12, "pieces": (1024, 1024)},
    "causal, whole shards travel": {"t": 12, "causal": True, "pieces": (1024, 1024)},
    "causal": {"t": 12, "causal": True},
    "causal, zigzag": {"t": 24, "causal": True, "layout": "zigzag"},
    "GQA, causal, zigzag": {"t": 24, "h": 4, "h_kv": 2, "causal": True, "layout": "zigzag"},
    "MQA, key padding": {"t": 12, "h": 4, "h_kv": 1, "key_mask": True},
    "key padding holding NaN, causal, zigzag": {
        "t": 24, "causal": True, "layout": "zigzag", "key_mask": True, "nan_padding": True
    },
    "ALiBi, causal": {"t": 12, "causal": True, "alibi": True},
    "sinks, GQA, causal, zigzag": {
        "t": 24, "h": 4, "h_kv": 2, "causal": True, "layout": "zigzag", "sinks": True
    },
    "sinks, key padding": {"t": 12, "key_mask": True, "sinks": True},
    "sliding window, zigzag": {"t": 24, "causal": True, "window": (3, 0), "layout": "zigzag"},
    "two-sided window, key padding": {"t": 24, "window": (2, 5), "key_mask": True},
    "softcap, scale": {"t": 12, "softcap": 2.0, "scale": 0.3},
    "t < s, causal": {"t": 12, "s": 24, "causal": True},
    "t > s, causal, zigzag": {"t": 48, "s": 24, "causal": True, "layout": "zigzag"},
    "relative bias score_mod, causal": {"t": 12, "causal": True, "relative_bias": True},
    "document mask_mod, causal, zigzag": {
        "t": 24, "causal": True, "layout": "zigzag", "documents": True
    },
    # The tiled backend is the oracle here: with dO = 0 where the output is NaN, the reference
    # gives dq and dk without NaN and the tiled kernel's backward 0 * NaN = NaN.
    "NaN value behind the causal mask, zigzag": {
        "t": 24, "causal": True, "layout": "zigzag", "nan_value": True, "oracle": "tiled"
    },
    "bf16, causal, zigzag, GQA": {
        "t": 24, "h": 4, "h_kv": 2, "causal": True, "layout": "zigzag", "dtype": torch.bfloat16
    },
    "float32, causal, zigzag, ALiBi": {
        "t": 24, "causal": True, "layout": "zigzag", "alibi": True, "dtype": torch.float32
    },
}  # fmt: skip


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"world {w}")
def differences(request):
    """Every case run once per world size (one set of processes for all of them)."""
    return request.param, ring_ranks.run(request.param, ring_ranks.compare_cases, CASES)


@pytest.mark.parametrize("case", CASES)
def test_ring_attention_equals_attention_of_the_whole_sequence(differences, case):
    world, by_rank = differences
    dtype = CASES[case].get("dtype", torch.float64)
    for rank, found in enumerate(by_rank):
        for name, difference in found[case].items():
            if name.endswith((" scale", " naive")):
                continue
            scale = found[case][name + " scale"]
            if dtype == torch.bfloat16:  # 2x the naive formula's error in bf16, 3x for gradients
                if name == "lse":
                    continue
                allowed = (2 if name == "out" else 3) * found[case][name + " naive"]
            elif dtype == torch.float32:
                allowed = 1e-5 + 1.3e-6 * scale
            else:
                allowed = 1e-10 * max(1.0, scale)
            assert difference <= allowed, (
                f"world {world}, rank {rank}: {name} differs by {difference:.3g}"
            )


@pytest.mark.parametrize(("layout", "piece"), [("contiguous", 4), ("zigzag", 8)])
def test_keys_travel_a_piece_at_a_time(layout, piece):
    # shards of 16 keys: one chunk of 16 (contiguous) or two of 8 (zigzag), cut into slices of 4;
    # a piece is the same slice of each chunk
    for largest in ring_ranks.run(2, ring_ranks.largest_transfer, layout):
        assert largest == piece


@pytest.mark.parametrize("world", [1, 2])
def test_it_computes_in_the_inputs_dtype_under_autocast(world):
    for differences in ring_ranks.run(world, ring_ranks.under_autocast):
        assert differences == [0.0] * 4


def test_shards_of_different_lengths_raise_on_every_rank():
    for rank, (kind, message) in enumerate(ring_ranks.run(3, ring_ranks.mismatched_shards)):
        assert kind == "ValueError"
        t = 4 if rank == 0 else 6
        assert f"shards or options differ (rank {rank} has {{'q': (1, 2, {t}, 8)," in message


def test_shards_of_different_dtypes_or_options_raise_on_every_rank():
    for kind, message in ring_ranks.run(2, ring_ranks.mismatched_options):
        assert kind == "ValueError"
        assert "shards or options differ" in message


def test_ranks_that_cut_the_keys_into_other_pieces_raise_on_every_rank():
    for kind, message in ring_ranks.run(3, ring_ranks.mismatched_pieces):
        assert kind == "ValueError"
        assert "shards or options differ" in message and "'key_piece': " in message


def test_a_subgroup_whose_ranks_are_not_the_global_ones():
    outside, *inside = ring_ranks.run(3, ring_ranks.in_a_subgroup)
    assert outside is None
    for differences in inside:
        assert max(differences) <= 1e-12


def test_a_second_derivative_is_refused_not_wrong():
    for kind, message in ring_ranks.run(2, ring_ranks.double_backward):
        assert (kind, message) == (
            "RuntimeError",
            "ring attention has no second derivative: its backward cannot run with "
            "create_graph=True",
        )


def test_a_length_the_layout_cannot_split_raises_on_every_rank():
    for kind, message in ring_ranks.run(2, ring_ranks.zigzag_misfit):
        assert (kind, message) == (
            "ValueError",
            "a sequence of 6 does not split into 4 equal chunks (zigzag layout over 2 ranks): "
            "pad it to a multiple of 4 and mask the padding with key_mask",
        )


def test_a_rank_outside_the_group_is_told_so():
    inside, outside = ring_ranks.run(2, ring_ranks.outside_the_group)
    assert inside == ("", "no error")  # a group of one: attention of its own shard
    assert outside == ("ValueError", "this process is not a member of the group")


def test_without_a_process_group_it_says_what_to_do():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"call torch\.distributed\.init_process_group first"):
        ring_attention(q, q, q)


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), True, "60"])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_refused(timeout):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, got "):
        ring_attention(q, q, q, timeout=timeout)


@pytest.mark.parametrize("option", ["attn_mask", "dropout_p", "return_weights", "block_mask"])
def test_options_it_cannot_split_are_refused_by_name(option):
    q = torch.randn(1, 2, 4, 8)
    value = {
        "attn_mask": torch.ones(4, 4, dtype=torch.bool),
        "dropout_p": 0.1,
        "return_weights": True,
        "block_mask": attnkit.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 4, 4),
    }[option]
    with pytest.raises(ValueError, match=f"ring_attention does not take {option}: "):
        ring_attention(q, q, q, **{option: value})


@pytest.mark.parametrize("how", ["die", "hang"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_failed_rank_makes_the_others_raise_within_the_timeout(how, where):
    world, victim, timeout = 3, 1, 4.0
    results = ring_ranks.run(
        world, ring_ranks.dies_or_hangs, victim, how, timeout, where, lost=(victim,)
    )
    for rank, found in enumerate(results):
        if rank == victim:
            continue
        assert found["error"] is not None, f"rank {rank} finished without an error"
        assert found["seconds"] <= timeout + 10
        assert f"ring attention: rank {rank} of {world}" in found["error"]
        assert found["waited_on"] in range(world) and found["waited_on"] != rank
    neighbour = results[(victim + 1) % world]  # it receives from the victim
    assert neighbour["waited_on"] == victim
    if how == "die":
        assert neighbour["failed"] == victim
