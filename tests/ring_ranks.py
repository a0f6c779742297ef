"""Running a function on real processes joined by torch.distributed (gloo over TCP on loopback),
for the ring attention tests; and the functions the ranks run. A module of its own, so that the
spawned processes can import what they run."""

from __future__ import annotations

import datetime
import math
import os
import queue
import socket
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from attnkit import distributed as ring
from attnkit import functional as F
from attnkit.backends import tiled


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(world: int, target: Callable, *args, address: str = "127.0.0.1", wait: float = 180.0):
    """``target(rank, world, *args)`` on ``world`` new processes; their results by rank. A rank
    that raises makes this raise, with its traceback."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [
        context.Process(target=_rank, args=(rank, world, address, port, target, args, results))
        for rank in range(world)
    ]
    for p in ranks:
        p.start()
    got: dict[int, object] = {}
    try:
        for _ in range(world):
            rank, ok, value = results.get(timeout=wait)
            if not ok:
                raise AssertionError(f"rank {rank} raised:\n{value}")
            got[rank] = value
    except queue.Empty:
        raise AssertionError(
            f"ranks {sorted(set(range(world)) - set(got))} did not answer"
        ) from None
    finally:
        for p in ranks:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(world)]


def _rank(rank, world, address, port, target, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        results.put((rank, True, target(rank, world, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()
        os._exit(0)  # no atexit work that could wait on a peer


# The cases: each builds the whole sequence the same way on every rank (same seed), runs ring
# attention on this rank's shard and compares with float64 attention of the whole sequence.

TABLE_SIZE = 200  # relative-position table: positions -99 .. 100


def relative_bias(table: Tensor):
    def bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 99]

    return bias


def compare_case(rank: int, world: int, case: dict) -> dict[str, float]:
    """Ring attention of ``case`` on this rank against float64 attention of the whole sequence:
    the largest differences of the output, lse and gradients of this rank's shard (and of the
    slopes' or table's gradient, summed over the ranks)."""
    tiled.BLOCK_Q, tiled.BLOCK_K = 5, 7  # many blocks, lengths that do not divide them
    dtype = case.get("dtype", torch.float64)
    b, h, h_kv, d = 2, case.get("h", 2), case.get("h_kv", 2), 8
    t, s = case["t"], case.get("s", case["t"])
    layout = case.get("layout", "contiguous")
    torch.manual_seed(case.get("seed", 0))
    q = torch.randn(b, h, t, d, dtype=torch.float64)
    k, v = (
        torch.randn(b, h_kv, s, d, dtype=torch.float64),
        torch.randn(b, h_kv, s, d, dtype=torch.float64),
    )
    d_out, d_lse = (
        torch.randn(b, h, t, d, dtype=torch.float64),
        torch.randn(b, h, t, dtype=torch.float64),
    )
    options = {"causal": case.get("causal", False)}
    if case.get("key_mask"):
        key_mask = torch.rand(b, s) > 0.3
        key_mask[:, 0] = True
        options["key_mask"] = key_mask
    for name in ("window", "softcap", "scale"):
        if name in case:
            options[name] = case[name]
    trained = {}
    if case.get("alibi"):
        trained["alibi_slopes"] = torch.linspace(0.1, 0.9, h, dtype=torch.float64)
    table = None
    if case.get("relative_bias"):
        table = torch.randn(h, TABLE_SIZE, dtype=torch.float64) * 0.5

    def run_it(q, k, v, options, trained, table, attend):
        leaves = [x.requires_grad_() for x in (q, k, v, *trained.values())]
        extra = dict(options)
        extra.update(zip(trained, leaves[3:]))
        if table is not None:
            table = table.requires_grad_()
            leaves.append(table)
            extra["score_mod"] = relative_bias(table)
        out, lse = attend(*leaves[:3], **extra)
        return out, lse, leaves

    def whole(q, k, v, **options):
        return F.attention(q, k, v, return_lse=True, backend="reference", **options)

    out, lse, leaves = run_it(q, k, v, options, trained, table, whole)
    finite = ~lse.isinf()
    loss = (out * d_out).sum() + (lse.where(finite, 0.0) * d_lse).sum()
    want = [out, lse, *torch.autograd.grad(loss, leaves)]

    def cut(x, dim):
        return ring.shard(x, dim, layout=layout)

    local = {"causal": options["causal"], "layout": layout}
    if "key_mask" in options:
        local["key_mask"] = cut(options["key_mask"], 1)
    for name in ("window", "softcap", "scale"):
        if name in options:
            local[name] = options[name]
    local_trained = {n: x.detach().to(dtype) for n, x in trained.items()}
    local_table = None if table is None else table.detach().to(dtype)

    def in_ring(q, k, v, **options):
        return ring.ring_attention(q, k, v, return_lse=True, **options)

    shards = [cut(x.detach(), 2).to(dtype) for x in (q, k, v)]
    out_r, lse_r, leaves_r = run_it(*shards, local, local_trained, local_table, in_ring)
    d_out_r, d_lse_r = cut(d_out, 2).to(dtype), cut(d_lse, 2).to(dtype)
    finite_r = ~lse_r.isinf()
    loss_r = (out_r * d_out_r).sum() + (lse_r.where(finite_r, 0.0) * d_lse_r).sum()
    got = [out_r, lse_r, *torch.autograd.grad(loss_r, leaves_r)]
    for x in got[5:]:  # a tensor every rank holds: its gradient is the sum of the ranks' parts
        dist.all_reduce(x)
    differences = {}
    names = ["out", "lse", "dq", "dk", "dv", *trained, *(["table"] if table is not None else [])]
    for name, g, w in zip(names, got, want):
        w = w.detach() if name in ("alibi_slopes", "table") else cut(w.detach(), 2)
        same_inf = torch.equal(g.isinf(), w.isinf())
        g, w = g.detach().double().nan_to_num(posinf=0, neginf=0), w.nan_to_num(posinf=0, neginf=0)
        differences[name] = (g - w).abs().max().item() if same_inf else math.inf
        differences[name + " scale"] = w.abs().max().item()
    return differences


def compare_cases(rank: int, world: int, cases: dict[str, dict]) -> dict[str, dict[str, float]]:
    return {name: compare_case(rank, world, case) for name, case in cases.items()}
