"""``attnkit bench --decode``: decoding, where speed is the memory bus's.

Three measurements, in one run:

- **step**: one query over a key/value cache of ``length`` positions, ``b x h`` query heads over
  ``h_kv`` key/value heads (MHA and GQA), attnkit next to torch SDPA and the naive formula on the same
  [`KVCache`][attnkit.cache.KVCache] views, every dtype of one length and layout timed in the same
  interleaved rounds (so that "bf16 vs fp32" is a ratio of one run), each call after reading a
  256 MiB buffer that empties the CPU caches (as the other layers of a model do between two steps
  of one layer; without it, whichever implementation runs second finds a small cache still in L3).
  The **limit** is the bytes of K and V one step must read divided by the read bandwidth of
  ``x.sum()`` over a 1 GiB float32 tensor, timed in the same interleaved rounds (on a shared
  machine the bandwidth drifts by a third between runs).
- **cache memory**: bytes of each cache layout (GQA, sliding window, bf16) against the full fp32 MHA
  cache.
- **generation**: tokens per second for ``new_tokens`` tokens after prompts of each length, through a
  [`MultiHeadAttention`][attnkit.modules.multihead.MultiHeadAttention] layer of width ``h * d``, cached (one step per token) and
  recomputed (the full causal forward over the prompt and every token so far, per token; timed on
  ``recompute_samples`` evenly spaced steps, which stand for the rest), in ``generation_rounds``
  interleaved rounds: the speed-up is the median of the rounds' ratios.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass
from itertools import product
from pathlib import Path
from typing import ClassVar, TextIO

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit import KVCache, MultiHeadAttention, attention
from attnkit._progress import Progress
from attnkit.bench.measure import Result, time_interleaved
from attnkit.bench.peers import Case, path_of
from attnkit.bench.report import machine, write_record
from attnkit.functional import which_backend

STEP_IMPLS = ("attnkit", "torch-sdpa", "naive")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class DecodeConfig:
    lengths: tuple[int, ...] = (1024, 8192, 32768)
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    kv_heads: tuple[int, ...] = (12, 4)  # MHA, then GQA
    b: int = 1
    h: int = 12
    d: int = 64
    window: int = 1024  # the sliding-window cache of the memory table
    prompts: tuple[int, ...] = (1024, 8192)
    new_tokens: int = 256
    recompute_samples: int = 32
    generation_rounds: int = 8
    bandwidth_bytes: int = 2**30
    repeats: int = 40
    warmups: int = 3

    PRESETS: ClassVar[dict[str, dict]] = {
        "smoke": {
            "lengths": (600,),  # past the decode kernel's threshold, so that it runs
            "dtypes": ("fp32", "bf16"),
            "kv_heads": (2, 1),
            "h": 2,
            "d": 16,
            "window": 64,
            "prompts": (40,),
            "new_tokens": 6,
            "recompute_samples": 3,
            "generation_rounds": 3,
            "bandwidth_bytes": 2**24,
            "repeats": 2,
            "warmups": 1,
        },
    }

    @classmethod
    def from_name(cls, name: str, **overrides) -> DecodeConfig:
        return cls(**{**cls.PRESETS[name], **overrides})


def _naive_step(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The textbook formula: GQA by repeating the key/value heads, the weights materialised."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    weights = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1)
    return weights @ v


def _step_calls(config: DecodeConfig, length: int, dtype: str, h_kv: int) -> dict:
    """The three implementations of one decoding step over the same full cache."""
    cache = KVCache(config.b, h_kv, length, config.d, dtype=DTYPES[dtype])
    shape = (config.b, h_kv, length, config.d)
    k, v = cache.update(torch.randn(shape).to(cache.dtype), torch.randn(shape).to(cache.dtype))
    q = torch.randn(config.b, config.h, 1, config.d).to(cache.dtype)
    gqa = h_kv != config.h
    calls = {
        "attnkit": lambda: attention(q, k, v, causal=True),
        "torch-sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa),
        "naive": lambda: _naive_step(q, k, v),
    }
    choice = which_backend(q, k, v, causal=True)
    return {"calls": calls, "bytes": k.nbytes + v.nbytes, "runs": path_of(choice)}


def _memory_rows(config: DecodeConfig) -> list[dict]:
    n = max(config.lengths)
    layouts = {
        "MHA fp32": {"num_kv_heads": config.h},
        f"GQA {min(config.kv_heads)} kv heads fp32": {"num_kv_heads": min(config.kv_heads)},
        f"MHA fp32, window {config.window}, max_chunk 1": {
            "num_kv_heads": config.h,
            "window": config.window,
            "max_chunk": 1,
        },
        "MHA bf16": {"num_kv_heads": config.h, "dtype": torch.bfloat16},
    }
    rows = []
    for name, kwargs in layouts.items():
        cache = KVCache(config.b, max_len=n, head_dim=config.d, **kwargs)
        rows.append({"layout": name, "max_len": n, "bytes": cache.keys.nbytes * 2})
        del cache
    full = rows[0]["bytes"]
    for row in rows:
        row["fraction"] = row["bytes"] / full
    return rows


def _generation(config: DecodeConfig, prompt: int, progress: Progress) -> dict:
    """Tokens per second after ``prompt`` tokens, cached vs recomputed, in interleaved rounds.

    Each round times a whole cached generation of ``new_tokens`` steps (after an untimed prefill)
    and then ``recompute_samples / rounds`` recomputations at evenly spaced steps, each round its
    own steps; the speed-up is the median over rounds of the two per-token times' ratio. A first
    round is a warm-up.
    """
    e = config.h * config.d
    module = MultiHeadAttention(e, e, None, 0.0, config.h, causal=True).eval()
    total = prompt + config.new_tokens
    x = torch.randn(config.b, total, e)
    cache = KVCache(config.b, config.h, total, config.d)
    rounds = config.generation_rounds
    per_round = max(1, config.recompute_samples // rounds)
    spacing = torch.linspace(0, config.new_tokens - 1, per_round * rounds).round().long().tolist()

    def cached_step_s() -> float:
        cache.reset()
        module(x[:, :prompt], cache=cache)
        start = time.perf_counter()
        for i in range(prompt, total):
            module(x[:, i : i + 1], cache=cache)
        return (time.perf_counter() - start) / config.new_tokens

    def recomputed_step_s(steps: list[int]) -> float:
        times = []
        for i in steps:
            start = time.perf_counter()
            module(x[:, : prompt + i + 1])[:, -1]
            times.append(time.perf_counter() - start)
        return statistics.mean(times)

    cached, recomputed = [], []
    with torch.no_grad():
        cached_step_s(), recomputed_step_s(spacing[:1])  # warm-up
        for r in range(rounds):
            cached.append(cached_step_s())
            recomputed.append(recomputed_step_s(spacing[r::rounds]))
            progress.step(f"generation after {prompt}: round {r + 1} of {rounds}")
    ratios = [rec / c for rec, c in zip(recomputed, cached, strict=True)]
    return {
        "prompt": prompt,
        "new_tokens": config.new_tokens,
        "rounds": rounds,
        "cached_tokens_per_s": 1 / statistics.median(cached),
        "recomputed_tokens_per_s": 1 / statistics.median(recomputed),
        "recompute_samples": per_round * rounds,
        "speedup": statistics.median(ratios),
        "speedup_range": [min(ratios), max(ratios)],
    }


def run_decode(config: DecodeConfig, progress_stream: TextIO | None = None) -> dict:
    """Every measurement of the module docstring; returns the JSON-ready record."""
    rounds = config.warmups + config.repeats
    calls_per_round = len(config.dtypes) * len(STEP_IMPLS) + 1  # and the bandwidth probe
    progress = Progress(
        len(config.lengths) * len(config.kv_heads) * calls_per_round * rounds
        + config.generation_rounds * len(config.prompts),
        progress_stream or sys.stderr,
    )
    big = torch.randn(config.bandwidth_bytes // 4)  # float32: x.sum() reads it once
    scratch = torch.ones(min(config.bandwidth_bytes, 2**28) // 4)  # read between calls

    def flush() -> None:
        scratch.sum()

    steps, bandwidths = [], []
    for length, h_kv in product(config.lengths, config.kv_heads):
        # Every dtype in the same interleaved rounds: "vs attnkit fp32" is a ratio of one run.
        setups = {dtype: _step_calls(config, length, dtype, h_kv) for dtype in config.dtypes}
        runs = []
        for dtype, setup in setups.items():
            for impl, call in setup["calls"].items():
                case = Case(impl, length, dtype, True, "decode", f"h_kv={h_kv}", "decode", config.b)
                runs.append((Result(case), call))
        bandwidth_case = Case("read-bandwidth", length, "fp32", True, "decode", "", "decode", 1)
        runs.append((Result(bandwidth_case), big.sum))
        time_interleaved(runs, config.repeats, config.warmups, progress.step, before=flush)
        bandwidth = big.nbytes / runs.pop()[0].median_s
        bandwidths.append(bandwidth)
        results = {(r.case.dtype, r.case.impl): r for r, _ in runs}
        fp32 = results["fp32", "attnkit"].median_s if "fp32" in setups else None
        for (dtype, impl), result in results.items():
            t, sdpa = result.median_s, results[dtype, "torch-sdpa"].median_s
            limit_s = setups[dtype]["bytes"] / bandwidth
            steps.append(
                {
                    "length": length,
                    "dtype": dtype,
                    "h": config.h,
                    "h_kv": h_kv,
                    "impl": impl,
                    "runs": setups[dtype]["runs"] if impl == "attnkit" else None,
                    "status": result.status,
                    "read_gb_s": bandwidth / 1e9,
                    "median_ms": t * 1e3 if t else None,
                    "limit_ms": limit_s * 1e3,
                    "vs_limit": t / limit_s if t else None,
                    "vs_sdpa": t / sdpa if t and sdpa else None,
                    "vs_fp32": t / fp32 if t and fp32 else None,
                }
            )
        del setups, runs

    generation = [_generation(config, prompt, progress) for prompt in config.prompts]
    return {
        "info": {
            "machine": machine(),
            "read_bandwidth_gb_s": statistics.median(bandwidths) / 1e9,
            "bandwidth_bytes": config.bandwidth_bytes,
            "repeats": config.repeats,
            "warmups": config.warmups,
            "date": time.strftime("%Y-%m-%d"),
            "config": {k: v for k, v in asdict(config).items() if k != "PRESETS"},
        },
        "steps": steps,
        "memory": _memory_rows(config),
        "generation": generation,
    }


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


def markdown(record: dict) -> str:
    info = record["info"]
    m = info["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['torch_threads']} torch threads, torch {m['torch']} "
        f"({m['cpu_capability']}; CPU features: {m.get('cpu_features', 'not recorded')}); "
        f"median of {info['repeats']} interleaved runs after "
        f"{info['warmups']} warm-ups. The limit: bytes of K and V / the read bandwidth of x.sum() "
        f"over {info['bandwidth_bytes'] / 2**30:g} GiB fp32, timed in the same rounds as the steps "
        f"(median {info['read_bandwidth_gb_s']:.1f} GB/s). Each length and layout times every "
        "dtype in one set of interleaved rounds.",
        "",
        "| decode step | implementation | median ms | limit ms | vs limit | vs torch-sdpa "
        "| vs attnkit fp32 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for s in record["steps"]:
        kind = "MHA" if s["h_kv"] == s["h"] else f"GQA {s['h']}/{s['h_kv']}"
        time_ms = _fmt(s["median_ms"], ".2f") if s["status"] == "ok" else s["status"]
        impl = s["impl"] if s.get("runs") is None else f"{s['impl']} ({s['runs']})"
        lines.append(
            f"| {s['length']} keys {s['dtype']} {kind} | {impl} | {time_ms} "
            f"| {s['limit_ms']:.2f} | {_fmt(s['vs_limit'], '.2f')} | {_fmt(s['vs_sdpa'], '.2f')} "
            f"| {_fmt(s['vs_fp32'], '.2f')} |"
        )
    lines += [
        "",
        "| cache layout | max_len | MiB | of the full MHA cache |",
        "|---|---:|---:|---:|",
    ]
    for row in record["memory"]:
        lines.append(
            f"| {row['layout']} | {row['max_len']} | {row['bytes'] / 2**20:.1f} "
            f"| {row['fraction']:.4f} |"
        )
    lines += [
        "",
        "| generation | cached tokens/s | recomputed tokens/s | speed-up (median of rounds) "
        "| rounds' range |",
        "|---|---:|---:|---:|---:|",
    ]
    for g in record["generation"]:
        low, high = g["speedup_range"]
        lines.append(
            f"| {g['new_tokens']} tokens after {g['prompt']} ({g['rounds']} rounds; recomputed: "
            f"{g['recompute_samples']} steps timed) | {g['cached_tokens_per_s']:.0f} "
            f"| {g['recomputed_tokens_per_s']:.1f} | {g['speedup']:.0f}x | {low:.0f}–{high:.0f}x |"
        )
    return "\n".join(lines) + "\n"


def write_decode(record: dict, out_dir: Path) -> dict[str, Path]:
    return write_record(record, out_dir, "decode", markdown(record))
