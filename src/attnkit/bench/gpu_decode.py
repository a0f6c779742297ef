"""``attnkit bench --decode --device cuda``: one decoding step over a long KV cache on a GPU, against
the GPU's memory bandwidth.

A step reads the whole cache once and does little arithmetic on it, so its bound is the memory
bus: the report gives the bytes of keys and values read per second, beside a device-to-device copy
measured in the same run (bytes read and written per second), for attnkit and torch's SDPA.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from attnkit.bench.measure import copy_gbps
from attnkit.bench.peers import path_of
from attnkit.bench.report import machine, write_record
from attnkit.cache import KVCache
from attnkit.functional import attention, which_backend


@dataclass(frozen=True)
class GPUDecodeConfig:
    """One step of ``b`` rows, ``h`` query heads over ``kv_heads`` cached heads of ``d``, a cache of
    ``length`` bf16 tokens (GQA when ``h > kv_heads``)."""

    b: int = 8
    h: int = 32
    kv_heads: int = 8
    d: int = 128
    length: int = 32768
    repeats: int = 50
    warmups: int = 5
    device: str = "cuda"


def _median_s(fn, repeats: int, warmups: int) -> float:
    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        timings.append(time.perf_counter() - start)
    return statistics.median(timings)


def run_gpu_decode(config: GPUDecodeConfig) -> dict:
    """The step's time and bandwidth for attnkit (a full :class:`KVCache`, ``causal=True`` and the
    cache's record of its keys, as a decoding module calls it; a step's look at its one new key is
    left out, with the cache's update), attnkit without the record (reading the keys for its rule)
    and torch SDPA on the same tensors, and the copy bandwidth."""
    dtype = torch.bfloat16
    cache = KVCache(
        config.b, config.kv_heads, config.length, config.d, dtype=dtype, device=config.device
    )
    shape = (config.b, config.kv_heads, config.length, config.d)
    k, v = cache.update(
        torch.randn(shape, dtype=dtype, device=config.device),
        torch.randn(shape, dtype=dtype, device=config.device),
    )
    q = torch.randn(config.b, config.h, 1, config.d, dtype=dtype, device=config.device)
    gqa = config.h != config.kv_heads
    calls = {  # attnkit with the cache's record of its keys, as a decoding module passes it
        "attnkit": lambda: attention(q, k, v, causal=True, nonfinite_keys=cache.nonfinite_keys()),
        "attnkit, keys read": lambda: attention(q, k, v, causal=True),  # what the record spares
        "torch-sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa),
    }
    read = k.nbytes + v.nbytes
    copy = copy_gbps(config.device)
    rows = []
    with torch.inference_mode():
        for impl, fn in calls.items():
            seconds = _median_s(fn, config.repeats, config.warmups)
            gbps = read / seconds / 1e9
            rows.append(
                {"impl": impl, "ms": seconds * 1e3, "gbps": gbps, "pct_copy": 100 * gbps / copy}
            )
        runs = path_of(which_backend(q, k, v, causal=True))
    return {
        "config": asdict(config),
        "machine": machine(config.device),
        "bytes_read": read,
        "copy_gbps": copy,
        "runs": runs,
        "rows": rows,
        "date": time.strftime("%Y-%m-%d"),
    }


def markdown(record: dict) -> str:
    c, m = record["config"], record["machine"]
    lines = [
        f"GPU: {m['gpu']} (driver {m['driver']}, CUDA {m['cuda']}), torch {m['torch']}. "
        f"One decoding step, b={c['b']}, {c['h']} query heads over {c['kv_heads']} cached heads "
        f"of {c['d']}, {c['length']} bf16 tokens ({record['bytes_read'] / 2**20:.0f} MiB of keys "
        f"and values); a device-to-device copy moved {record['copy_gbps']:.0f} GB/s (read + "
        f"written); median of {c['repeats']} after {c['warmups']} warm-ups.",
        "",
        "| implementation | ms | K and V read, GB/s | % of the copy's |",
        "|---|---:|---:|---:|",
    ]
    for row in record["rows"]:
        impl = row["impl"].replace("attnkit", f"attnkit ({record['runs']})")
        lines.append(f"| {impl} | {row['ms']:.3f} | {row['gbps']:.0f} | {row['pct_copy']:.0f} |")
    return "\n".join(lines) + "\n"


def write_gpu_decode(record: dict, out_dir: Path) -> dict[str, Path]:
    return write_record(record, out_dir, "decode", markdown(record))
