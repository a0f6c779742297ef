"""``attnkit bench``: attnkit side by side with its peers, in one run on this machine.

Each case first runs once in a fresh subprocess, which measures its peak memory (and finds the
cases that run out of memory or time: they are reported as such, not dropped). Then, per row of the
report (same N, dtype, mask and mode), the implementations are timed interleaved in this process and
compared as ratios. See ``shared/BENCHMARKING.md`` for why.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from itertools import product
from typing import ClassVar, TextIO

from attnkit._progress import Progress
from attnkit.backends import decode as decode_backend
from attnkit.bench.flex_cases import FLEX_VARIANTS
from attnkit.bench.flex_cases import supported as mods_supported
from attnkit.bench.measure import Result, matmul_gflops, probe_memory, time_interleaved
from attnkit.bench.peers import KERNEL_IMPLS, MODULE_IMPLS, Case, prepare, runs, supported
from attnkit.bench.report import machine, write
from attnkit.tiled import plans


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. ``ns`` are sequence lengths; the module cases use ``module_b`` x
    ``module_n`` tokens of width ``h * d`` (768 by default, as in GPT-2 small)."""

    ns: tuple[int, ...] = (1024, 4096, 16384)
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    modes: tuple[str, ...] = ("fwd", "fwd+bwd")
    causal: tuple[bool, ...] = (False, True)
    impls: tuple[str, ...] = KERNEL_IMPLS
    variants: tuple[str, ...] = ("plain",)
    b: int = 1
    h: int = 12
    d: int = 64
    module: bool = False  # add the module cases (projections included)
    module_b: int = 8
    module_n: int = 1024
    repeats: int = 5  # timed runs per case, interleaved; the median is reported
    warmups: int = 2
    timeout_s: float = 600.0  # per case, for its memory probe; longer counts as "timeout"
    one_process: bool = False  # probe every case's memory in one process (rough; the smoke run)
    slow_s: float = 60.0  # a case whose single run takes longer is timed once, not repeated
    matmul_max: int = 4096  # the largest size^3 product that measures the matmul throughput
    device: str = "cpu"  # or "cuda"

    PRESETS: ClassVar[dict[str, dict]] = {
        # tiny shapes that exercise every path in seconds (the test suite runs it)
        "smoke": {
            "ns": (48,),
            "dtypes": ("fp32", "bf16"),
            "modes": ("fwd+bwd",),  # the forward alone: tests/bench/test_bench.py runs it
            "causal": (True,),
            "impls": tuple(i for i in KERNEL_IMPLS if i != "flex-compiled"),  # compiles for ~10 s
            "h": 2,
            "d": 16,
            "module": True,
            "module_b": 2,
            "module_n": 32,
            "variants": ("plain",),  # the modifiers: the benchmarking guide's example runs them
            "repeats": 1,
            "warmups": 1,
            "matmul_max": 512,
            "one_process": True,
        },
        # a lent GPU: SDPA's shapes of the goals (b=4, h=16, d=128, bf16), attnkit's choice beside
        "gpu": {
            "ns": (4096, 16384),
            "dtypes": ("bf16",),
            "impls": ("torch-sdpa", "flex-compiled", "attnkit-auto"),
            "b": 4,
            "h": 16,
            "d": 128,
            "matmul_max": 8192,
            "device": "cuda",
        },
    }

    @classmethod
    def from_name(cls, name: str, **overrides) -> BenchConfig:
        return cls(**{**cls.PRESETS[name], **overrides})

    def cases(self) -> list[Case]:
        shape = {"b": self.b, "h": self.h, "d": self.d, "device": self.device}
        cases = []
        for variant, n, dtype, causal, mode, impl in product(
            self.variants, self.ns, self.dtypes, self.causal, self.modes, self.impls
        ):
            if variant in FLEX_VARIANTS:
                if not causal or mods_supported(impl, variant):
                    continue  # causal cases (prefix-LM: its own mask), the peers that apply
            elif impl == "attnkit-builtin" or (
                variant not in ("plain", "sinks") and impl in ("attnkit-auto", "torch-sdpa-math")
            ):
                continue  # the modifier rows compare naive, SDPA (dense mask), flex and tiled
            cases.append(Case(impl, n, dtype, causal, mode, variant, **shape))
        if self.module:
            module_shape = {"b": self.module_b, "h": self.h, "d": self.d, "device": self.device}
            for dtype, causal, impl in product(self.dtypes, self.causal, MODULE_IMPLS):
                cases.append(
                    Case(impl, self.module_n, dtype, causal, "fwd", group="module", **module_shape)
                )
        return cases


def native_kernels() -> dict[str, dict]:
    """attnkit's C++ kernels, each loaded (built first if need be): its CPU level, where the
    build came from (``prebuilt``, ``cached``, ``built``), how long a build took, and why a kernel
    is unavailable (the tiled backend then runs its PyTorch loop)."""
    report = {}
    for kernel in (plans.KERNEL, decode_backend.KERNEL):
        usable, reason = kernel.available()
        report[kernel.source] = {
            "available": usable,
            "level": kernel.level() if usable else None,
            "origin": kernel.origin,
            "seconds": kernel.build_seconds,
            "why": reason,
        }
    return report


def run(config: BenchConfig, progress_stream: TextIO | None = None) -> tuple[list[Result], dict]:
    """Probe every case's memory, then time the cases of each report row interleaved."""
    cases = config.cases()
    stream = progress_stream or sys.stderr
    # built here, once: no probe or timing below includes a build (none runs on a GPU)
    native = native_kernels() if config.device == "cpu" else {}
    progress = Progress(len(cases) * (1 + config.warmups + config.repeats), stream)

    reasons = [supported(case) for case in cases]
    measured = [case for case, reason in zip(cases, reasons) if not reason]
    if config.one_process:
        probed = iter(probe_memory(measured, config.timeout_s, one_process=True))
        progress.done = len(cases) - 1
        progress.step(f"memory of {len(measured)} cases, in one process")
    else:
        probed = (r for case in measured for r in probe_memory([case], config.timeout_s))
    results: list[Result] = []
    for case, reason in zip(cases, reasons):
        result = Result(case, status=reason) if reason else next(probed)
        result.runs = None if reason else runs(case)
        results.append(result)
        if not config.one_process:
            progress.step(f"memory {case.label} N={case.n} {case.dtype} {case.mode}")

    rows: dict[tuple, list[Result]] = defaultdict(list)
    for result in results:
        rows[result.case.key()].append(result)
    for row in rows.values():
        runnable = []
        for result in row:
            rounds = config.warmups + config.repeats
            if result.status != "ok":
                progress.done += rounds
            elif result.first_call_s is not None and result.first_call_s > config.slow_s:
                result.times.append(result.first_call_s)  # too slow to repeat: its one run
                result.status = "ok"
                progress.done += rounds
            else:
                runnable.append((result, prepare(result.case)))
        time_interleaved(runnable, config.repeats, config.warmups, progress.step)
    progress.done = progress.total - 1
    progress.step("done")

    matmul = {
        dtype: matmul_gflops(
            Case("", 0, dtype, False, "").torch_dtype, config.matmul_max, device=config.device
        )
        for dtype in config.dtypes
    }
    info = {
        "machine": machine(config.device),
        "matmul": matmul,
        "repeats": config.repeats,
        "warmups": config.warmups,
        "native": native,
        "date": time.strftime("%Y-%m-%d"),
    }
    return results, info


__all__ = ["BenchConfig", "Progress", "Result", "run", "write"]
