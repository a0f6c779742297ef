"""ContextParallel (attnkit.distributed.module): a module run over a sequence split across ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnkit
from attnkit.distributed import ContextParallel
from helpers import ring_ranks


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_a_module_run_context_parallel_equals_the_module_on_the_whole_sequence(layout):
    for rank, found in enumerate(ring_ranks.run(3, ring_ranks.module_case, layout)):
        for name, difference in found.items():
            assert difference <= 1e-10, f"rank {rank}: {name} differs by {difference:.3g}"


def test_without_a_process_group_it_says_what_to_do_before_any_work():
    """The module's attention call, its positions and its size all need the ranks' group."""
    module = attnkit.MultiHeadAttention(8, 8, None, 0.0, 2, rope=True)
    parallel = ContextParallel(layout="zigzag")
    message = r"call torch\.distributed\.init_process_group first"
    for ask in (parallel.size, lambda: parallel.positions(4)):
        with pytest.raises(ValueError, match=message):
            ask()
    with pytest.raises(ValueError, match=message):
        module(torch.randn(1, 4, 8), context_parallel=parallel)


def test_a_bad_timeout_is_refused_whatever_it_is_asked():
    parallel = ContextParallel(timeout=0)
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, got 0"):
        parallel.size()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, got 0"):
        parallel.attention(q, q, q)


def test_it_is_a_frozen_description_of_group_layout_and_timeout():
    parallel = ContextParallel()
    assert (parallel.group, parallel.layout, parallel.timeout) == (None, "contiguous", 60.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        parallel.layout = "zigzag"
