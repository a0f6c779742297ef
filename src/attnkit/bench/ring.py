"""``attnkit bench --ring``: ring attention over processes of this machine, joined by gloo on
loopback, against attention of the whole sequence in one process.

For each sequence length, world size and layout, the ranks start as new processes with one thread
each and run forward + backward, causal, on their shards: after a run on a short sequence
(``WARM_UP_TOKENS``), the first run gives each rank's peak extra memory (its peak RSS over its
RSS before the run), the next ``warmups`` warm up, and ``repeats`` are
timed between barriers. Per case: the time of a step (the slowest rank's, median), each rank's
CPU time (its work, which the machine's cores share when there are more ranks than cores), the
busiest rank's CPU time over the least busy one's (the balance of the layout), the bytes each rank
sends per step, and the peak memory per rank. ``whole`` is
[`attention`][attnkit.functional.attention] of the whole sequence in one process, one thread.
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from attnkit._progress import Progress
from attnkit.bench.launch import run_local
from attnkit.bench.measure import resident_mib
from attnkit.bench.report import machine, write_record

WARM_UP_TOKENS = 1024
"""Tokens a rank of the step run before the one whose memory is measured: enough for whole blocks
of the kernel, so that the buffers made once a process (the BLAS library's, gloo's) are not counted
as the step's."""


@dataclass(frozen=True)
class RingConfig:
    ns: tuple[int, ...] = (16384, 65536)
    worlds: tuple[int, ...] = (1, 2, 4)
    layouts: tuple[str, ...] = ("contiguous", "zigzag")
    b: int = 1
    h: int = 1
    d: int = 64
    repeats: int = 3
    warmups: int = 1

    @staticmethod
    def smoke(**overrides) -> RingConfig:
        return RingConfig(
            **{"ns": (256,), "worlds": (1, 2), "repeats": 1, "warmups": 0, **overrides}
        )


def run_ring(config: RingConfig, progress: Progress | None = None) -> dict:
    """Every case of ``config``; a record with the machine and one row per case."""
    cases = [(n, 1, "whole") for n in config.ns]
    for n in config.ns:
        for world in config.worlds:
            for layout in config.layouts if world > 1 else config.layouts[:1]:
                cases.append((n, world, layout))
    progress = progress or Progress(len(cases))
    rows = []
    for n, world, layout in cases:
        progress.step(f"ring N={n} P={world} {layout}")
        ranks = run_local(world, _rank_main, n, layout, config)
        rows.append(_summary(n, world, layout, ranks))
    return {"machine": machine(), "config": asdict(config), "rows": rows}


def _summary(n: int, world: int, layout: str, ranks: list[dict]) -> dict:
    cpu = [r["cpu_s"] for r in ranks]
    return {
        "n": n,
        "world": world,
        "layout": layout,
        "step_s": statistics.median(max(times) for times in zip(*(r["wall_s"] for r in ranks))),
        "cpu_s": cpu,
        "balance": max(cpu) / max(min(cpu), 1e-9),
        "sent_mib": max(r["sent_bytes"] for r in ranks) / 2**20,
        "peak_mib": max(r["peak_mib"] for r in ranks),
    }


def _rank_main(rank: int, world: int, n: int, layout: str, config: RingConfig) -> dict:
    """One rank of one case: its peak extra memory, its step times, CPU times and bytes sent."""
    import torch.distributed as dist

    from attnkit import distributed as ring
    from attnkit.distributed.transport import Ring
    from attnkit.functional import attention

    torch.manual_seed(rank)
    b, h, d, t = config.b, config.h, config.d, n // world
    warm = min(t, WARM_UP_TOKENS)
    q, k, v = (torch.randn(b, h, warm, d, requires_grad=True) for _ in range(3))
    sent = [0]
    exchange = Ring.exchange

    def counted(self, outgoing, incoming, what):
        sent[0] += sum(x.numel() * x.element_size() for x in outgoing)
        return exchange(self, outgoing, incoming, what)

    Ring.exchange = counted

    def step() -> None:
        if layout == "whole":
            out = attention(q, k, v, causal=True, backend="tiled")
        else:
            out = ring.ring_attention(q, k, v, causal=True, layout=layout, timeout=600)
        out.sum().backward()
        q.grad = k.grad = v.grad = None

    step()  # the kernels load, gloo and the BLAS library make their lasting buffers
    q, k, v = (torch.randn(b, h, t, d, requires_grad=True) for _ in range(3))
    before = resident_mib()  # now, not the warm-up's peak, which would hide part of the step's
    step()
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    for _ in range(config.warmups):
        step()
    wall, cpu = [], []
    sent[0] = 0
    for _ in range(config.repeats):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start)
        dist.barrier()
    return {
        "peak_mib": peak_mib,
        "wall_s": wall,
        "cpu_s": statistics.median(cpu),
        "sent_bytes": sent[0] // config.repeats,
    }


def markdown(record: dict) -> str:
    m = record["machine"]
    c = record["config"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} "
        f"(CPU features: {m['cpu_features']}); gloo on loopback, one thread per rank; "
        f"b={c['b']} h={c['h']} d={c['d']}, fp32, causal, forward + backward; median of "
        f"{c['repeats']} after {c['warmups']} warm-up(s).",
        "",
        "| N | ranks | layout | step s | vs whole | CPU s per rank | busiest / least busy "
        "| MiB sent per rank | peak MiB per rank | vs whole |",
        "|---:|---:|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    whole = {r["n"]: r for r in record["rows"] if r["layout"] == "whole"}
    for r in record["rows"]:
        w = whole[r["n"]]
        cpu = " / ".join(f"{x:.3g}" for x in r["cpu_s"])
        lines.append(
            f"| {r['n']} | {r['world']} | {r['layout']} | {r['step_s']:.3g} "
            f"| {_ratio(r['step_s'], w['step_s'])} | {cpu} | {r['balance']:.2f} "
            f"| {r['sent_mib']:.1f} | {r['peak_mib']:.0f} | {_ratio(r['peak_mib'], w['peak_mib'])} |"
        )
    return "\n".join(lines) + "\n"


def _ratio(x: float, base: float) -> str:
    return f"{x / base:.2f}" if base > 0 else "—"  # a tiny case may grow no memory at all


def write_ring(record: dict, out_dir: Path) -> dict[str, Path]:
    return write_record(record, out_dir, "ring", markdown(record))
