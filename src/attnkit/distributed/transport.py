"""How the ranks of a ring talk: sends and receives with a timeout, and the errors a dead or
silent peer becomes ([`RingError`][attnkit.distributed.RingError])."""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_TIMEOUT = 60.0
"""Seconds a rank waits for a peer before it raises [`RingError`][attnkit.distributed.RingError]."""


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
class Ring:
    """Where this rank sits (its group, its rank and the group's size) and how long it waits for
    a peer."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    timeout: float

    @staticmethod
    def of(group, timeout: float) -> Ring:
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
        return Ring(group, rank, size, float(timeout))

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
