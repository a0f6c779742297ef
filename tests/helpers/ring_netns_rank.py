"""One rank of a ring attention test across network namespaces, started by test_ring_netns.py
through ``ip netns exec``: joins the group over its own address, runs a job, prints its result
as one JSON line."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import time

import ring_ranks  # run as a script from this folder
import torch
import torch.distributed as dist

from attnkit import distributed as ring
from attnkit.distributed import passes


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--port"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--job", choices=["compare", "link-down"], required=True)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--markers", type=pathlib.Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=60),
    )
    if args.job == "compare":
        cases = {"causal, zigzag, GQA, ALiBi": {
            "t": 24, "h": 4, "h_kv": 2, "causal": True, "layout": "zigzag", "alibi": True
        }}  # fmt: skip
        result = ring_ranks.compare_cases(args.rank, args.world, cases)
    else:
        result = _link_down(args)
    print(json.dumps(result), flush=True)
    os._exit(0)


def _link_down(args) -> dict:
    """Forward, then a backward that says it has begun (a marker file) and pauses, so that the
    test can take a link down while the backward's transfers are under way."""
    original = passes.backward_pass

    def announced(*a, **kw):
        (args.markers / f"backward-{args.rank}").touch()
        time.sleep(2.0)
        return original(*a, **kw)

    passes.backward_pass = announced
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    start = None
    try:
        out = ring.ring_attention(q, k, v, causal=True, timeout=args.timeout)
        start = time.monotonic()
        out.sum().backward()
    except ring.RingError as error:
        return {"error": str(error), "seconds": time.monotonic() - (start or time.monotonic())}
    return {"error": None}


if __name__ == "__main__":
    main()
