"""Processes of this machine joined in a gloo group over loopback: for trying ring attention on
one machine, for ``attnkit bench --ring`` and for the tests."""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


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
