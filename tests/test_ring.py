"""Ring attention (attnkit.distributed) on real processes: gloo over TCP on loopback, world sizes
1 to 4, against float64 attention of the whole sequence in one process."""

from __future__ import annotations

import pytest
import torch

import ring_ranks

CASES = {  # lengths: contiguous splits into 1..4 chunks (12), zigzag into 2..8 (24)
    "full": {"t": 12},
    "causal": {"t": 12, "causal": True},
    "causal, zigzag": {"t": 24, "causal": True, "layout": "zigzag"},
    "GQA, causal, zigzag": {"t": 24, "h": 4, "h_kv": 2, "causal": True, "layout": "zigzag"},
    "MQA, key padding": {"t": 12, "h": 4, "h_kv": 1, "key_mask": True},
    "ALiBi, causal": {"t": 12, "causal": True, "alibi": True},
    "sliding window, zigzag": {"t": 24, "causal": True, "window": (3, 0), "layout": "zigzag"},
    "two-sided window, key padding": {"t": 24, "window": (2, 5), "key_mask": True},
    "softcap, scale": {"t": 12, "softcap": 2.0, "scale": 0.3},
    "t < s, causal": {"t": 12, "s": 24, "causal": True},
    "t > s, causal, zigzag": {"t": 48, "s": 24, "causal": True, "layout": "zigzag"},
    "relative bias score_mod, causal": {"t": 12, "causal": True, "relative_bias": True},
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
    float32 = CASES[case].get("dtype") == torch.float32
    for rank, found in enumerate(by_rank):
        for name, difference in found[case].items():
            if name.endswith(" scale"):
                continue
            scale = found[case][name + " scale"]
            allowed = 1e-5 + 1.3e-6 * scale if float32 else 1e-10 * max(1.0, scale)
            assert difference <= allowed, (
                f"world {world}, rank {rank}: {name} differs by {difference:.3g}"
            )
