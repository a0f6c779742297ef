"""What tests/bench/test_launch.py runs on the ranks that run_local starts: a module of its own,
so that the new processes can import it."""

from __future__ import annotations

import time

import torch.distributed as dist


def joined(rank: int, world: int, offset: int, hangs: int) -> tuple:
    """What this rank sees of the group it joined; rank ``hangs`` never answers."""
    if rank == hangs:
        time.sleep(3600)
    return rank, world, dist.get_rank(), dist.get_world_size(), dist.get_backend(), rank + offset


def raises_on(rank: int, world: int, bad: int) -> int:
    if rank == bad:
        raise ValueError(f"rank {rank} of {world} says no")
    return rank
