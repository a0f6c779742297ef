"""attnkit.distributed.transport in one process: what Ring.of refuses (a timeout that is not a
positive number of seconds, no process group), the ring's neighbours, and the RingError a failed
exchange becomes. Dead and silent peers on real processes: tests/distributed/test_ring.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from attnkit.distributed import DEFAULT_TIMEOUT, RingError
from attnkit.distributed.transport import Ring


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), float("nan"), True, "60", None])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_refused(timeout):
    with pytest.raises(ValueError, match=r"timeout must be a positive number of seconds, got "):
        Ring.of(None, timeout)


def test_without_a_process_group_it_says_what_to_do():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"call torch\.distributed\.init_process_group first"):
        Ring.of(None, DEFAULT_TIMEOUT)


def test_the_ring_sends_to_the_next_rank_and_receives_from_the_previous():
    ring = Ring(None, rank=0, size=3, timeout=5.0)
    assert [ring.peer(offset) for offset in (1, -1, 2, 3, -4)] == [1, 2, 2, 0, 2]


def test_a_broken_connection_names_the_peer_that_stopped():
    ring = Ring(None, rank=2, size=4, timeout=5.0)
    error = ring.failed(RuntimeError("Connection closed by peer"), 1, "keys and values")
    assert isinstance(error, RingError) and isinstance(error, RuntimeError)
    assert (error.rank, error.waited_on, error.failed) == (2, 1, 1)
    assert str(error).startswith("ring attention: rank 2 of 4 lost its connection to rank 1 ")
    assert "(keys and values): rank 1 stopped" in str(error)
    assert str(error).endswith("The process group is unusable from here: destroy it.")


def test_a_timeout_names_the_peer_it_waited_on_and_no_failed_rank():
    ring = Ring(None, rank=0, size=2, timeout=4.0)
    error = ring.failed(RuntimeError("Operation Timed Out!"), 1, "gradients")
    assert (error.rank, error.waited_on, error.failed) == (0, 1, None)
    assert "waited 4 s for rank 1 (gradients) in vain: a peer died or a link is down" in str(error)


def test_an_exchange_of_nothing_waits_for_nothing():
    ring = Ring(None, rank=0, size=2, timeout=1.0)  # no group: nothing may reach torch.distributed
    assert ring.exchange([], [], "nothing")() is None
