"""attnkit.bench.launch.run_local: processes of this machine joined in a gloo group, their results
by rank, a rank's error with its traceback, and ranks not waited for."""

from __future__ import annotations

import time

import pytest

from attnkit.bench.launch import run_local
from helpers import launch_targets


def test_each_rank_joins_one_gloo_group_and_returns_by_rank_unwaited_ranks_give_none():
    start = time.monotonic()
    results = run_local(3, launch_targets.joined, 10, 2, lost=(2,), wait=120.0)
    assert results == [(0, 3, 0, 3, "gloo", 10), (1, 3, 1, 3, "gloo", 11), None]
    assert time.monotonic() - start < 100  # rank 2 sleeps for an hour: it was not waited for


def test_a_rank_that_raises_is_reported_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"rank 1 raised:\nTraceback") as raised:
        run_local(2, launch_targets.raises_on, 1, wait=120.0)
    assert "ValueError: rank 1 of 2 says no" in str(raised.value)
