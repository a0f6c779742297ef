"""How ``attnkit bench`` measures: peak memory of each case in a fresh subprocess (on a GPU, in this
process, by torch's allocator statistics), then the times of all cases that ran, interleaved in
this process (A B C A B C ...), median after warm-ups.

Run as ``python -m attnkit.bench.measure '<case json>' ...`` it is the memory probe: it runs each
case once and prints ``{"status", "peak_mib", "seconds"}`` as a JSON line for each.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from attnkit.bench.peers import Case, prepare

# The probe caps its address space so that running out of memory raises instead of summoning the
# kernel's OOM killer; 85% of the machine's memory.
_MEMORY_CAP = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.85)


@dataclass
class Result:
    """What is known of one case: its status ("ok", "oom", "timeout", "n/a: ...", "error: ..."),
    its peak extra memory and its timed runs (seconds)."""

    case: Case
    status: str = "ok"
    peak_mib: float | None = None
    first_call_s: float | None = None
    times: list[float] = field(default_factory=list)
    runs: str | None = None  # for attnkit's cases: the backend and path that ran

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.times) if self.times else None


def resident_mib() -> float:
    """This process's resident memory now (Linux; elsewhere its peak so far)."""
    statm = Path("/proc/self/statm")
    if statm.exists():
        return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak() -> None:
    """Count this process's peak resident memory from now on (Linux: the kernel's high-water
    mark is reset). Without it a process's peak starts at its parent's size when it forked: the
    kernel keeps that across ``exec``."""
    clear_refs = Path("/proc/self/clear_refs")
    if clear_refs.exists():
        clear_refs.write_text("5")


def peak_mib() -> float:
    """This process's peak resident memory since [`reset_peak`][attnkit.bench.measure.reset_peak]
    (Linux; elsewhere since it started)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def in_fresh_process(module: str, arguments: Sequence[str], timeout_s: float) -> list[dict]:
    """``python -m module *arguments``: the module's probe (see
    [`probe_each`][attnkit.bench.measure.probe_each]) measures each argument in turn and prints one
    JSON line for it. Returns one report per argument; those that never printed one get the
    ``status`` of what stopped the process: ``"timeout (> N s)"`` (``timeout_s`` for each
    argument), ``"oom (killed)"`` (a signal: the OOM killer, in practice) or
    ``"error: <its last line>"``."""
    command = [sys.executable, "-m", module, *arguments]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s * len(arguments)
        )
        out, returncode, err = done.stdout, done.returncode, done.stderr
    except subprocess.TimeoutExpired as expired:
        out, returncode, err = expired.stdout or "", None, ""
        out = out.decode() if isinstance(out, bytes) else out
    reports = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if returncode is None:
        stopped = f"timeout (> {timeout_s:.0f} s)"
    elif returncode < 0:
        stopped = "oom (killed)"
    else:
        stopped = "error: " + (err.strip().splitlines() or ["no output"])[-1][:160]
    return reports + [{"status": stopped}] * (len(arguments) - len(reports))


def probe_in_turn(
    module: str,
    arguments: Sequence[str],
    labels: Sequence[str],
    timeout_s: float,
    *,
    one_process: bool,
    step: Callable[[str], None],
) -> list[dict]:
    """Each argument's report from ``module``'s probe
    ([`in_fresh_process`][attnkit.bench.measure.in_fresh_process]): all in one fresh process
    (``one_process``: the smoke runs), then one ``step`` of progress for each; else a fresh
    process for each, then ``step`` with its label."""
    if one_process:
        reports = in_fresh_process(module, arguments, timeout_s)
        for _ in arguments:
            step(f"memory of {len(arguments)} cases, in one process")
        return reports
    reports = []
    for argument, label in zip(arguments, labels):
        reports += in_fresh_process(module, [argument], timeout_s)
        step(label)
    return reports


def probe_each(probe: Callable[[str], dict], arguments: Sequence[str]) -> None:
    """The probe's side of [`in_fresh_process`][attnkit.bench.measure.in_fresh_process]: one JSON
    line per argument, printed as soon as it is measured; a case that raises reports its error
    and the next one runs."""
    for argument in arguments:
        try:
            report = probe(argument)
        except Exception as err:  # this case's error, and the next cases still run
            report = {
                "status": f"error: {(str(err).splitlines() or [type(err).__name__])[0][:120]}"
            }
        print(json.dumps(report), flush=True)


def probe_memory(
    cases: Sequence[Case], timeout_s: float, *, one_process: bool = False
) -> list[Result]:
    """Run each case once in a fresh interpreter; its peak RSS growth over the set-up is its peak
    extra memory. The first call includes any compilation, so it is reported apart. A GPU case runs
    here instead: torch's allocator counts its peak exactly, and a fresh process would spend
    seconds starting the GPU.

    ``one_process`` probes every case in turn in one fresh process, seconds instead of a process
    per case: what a case leaves behind (the allocator's free lists) hides part of the next one's
    peak, so the smoke runs alone, which test the pipeline rather than the figures, use it."""
    if any(case.device != "cpu" for case in cases):
        return [_probe_gpu(case) for case in cases]
    arguments = [json.dumps(case.to_json()) for case in cases]
    groups = [arguments] if one_process else [[argument] for argument in arguments]
    reports = [r for g in groups if g for r in in_fresh_process(__name__, g, timeout_s)]
    return [
        Result(case, status=r["status"], peak_mib=r.get("peak_mib"), first_call_s=r.get("seconds"))
        for case, r in zip(cases, reports)
    ]


def _probe_gpu(case: Case) -> Result:
    """``case`` run once on its GPU: the peak of torch's allocator above what the set-up holds."""
    torch.manual_seed(0)
    try:
        run = prepare(case)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    except torch.OutOfMemoryError:
        return Result(case, status="oom")
    except RuntimeError as err:
        return Result(case, status=f"error: {str(err).splitlines()[0][:120]}")
    finally:
        torch.cuda.empty_cache()
    return Result(case, peak_mib=peak, first_call_s=seconds)


def _probe_one(case_json: str) -> dict:
    torch.manual_seed(0)
    case = Case(**json.loads(case_json))
    try:
        run = prepare(case)
        reset_peak()
        before = resident_mib()
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
        return {"status": "ok", "peak_mib": peak_mib() - before, "seconds": seconds}
    except (RuntimeError, MemoryError) as err:
        out_of_memory = isinstance(err, MemoryError) or "memory" in str(err).lower()
        status = "oom" if out_of_memory else f"error: {str(err).splitlines()[0][:120]}"
        return {"status": status, "peak_mib": None, "seconds": None}


def median_seconds(fn: Callable[[], object], repeats: int, warmups: int = 3) -> float:
    """The median wall time of ``repeats`` calls of ``fn``, after ``warmups`` untimed ones: for
    the scripts that time one thing at a time."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_interleaved(
    runs: Sequence[tuple[Result, Callable[[], object]]],
    repeats: int,
    warmups: int,
    on_step: Callable[[], None] = lambda: None,
    before: Callable[[], object] | None = None,
) -> None:
    """Warm every case up, then time them in turns, ``repeats`` rounds; appends to ``Result.times``.
    ``before``, if given, runs untimed before each call (to empty the CPU caches, say). A case that
    raises is marked with the error and leaves the rotation."""
    active = list(runs)
    for round_ in range(warmups + repeats):
        for result, run in list(active):
            if before is not None:
                before()
            start = time.perf_counter()
            try:
                run()
            except (RuntimeError, MemoryError) as err:
                result.status = f"error: {str(err).splitlines()[0][:120]}"
                result.times.clear()
                active.remove((result, run))
                continue
            if round_ >= warmups:
                result.times.append(time.perf_counter() - start)
            on_step()


def matmul_gflops(
    dtype: torch.dtype, max_size: int = 4096, budget_s: float = 2.0, device: str = "cpu"
) -> tuple[int, float]:
    """This machine's matmul throughput in ``dtype``: ``size^3`` products, ``size`` doubled up to
    ``max_size`` while one product takes under ``budget_s`` (half-precision products without
    hardware support can be ~400x slower than float32). Returns ``(size, GFLOP/s)``, median of 3."""
    size, best = 256, (256, 0.0)
    wait = torch.cuda.synchronize if device != "cpu" else lambda: None
    while size <= max_size:
        a = torch.randn(size, size, dtype=dtype, device=device)
        start = time.perf_counter()
        a @ a
        wait()
        first = time.perf_counter() - start
        timings = []
        for _ in range(3):
            start = time.perf_counter()
            a @ a
            wait()
            timings.append(time.perf_counter() - start)
        best = (size, 2 * size**3 / statistics.median(timings) / 1e9)
        if first * 8 > budget_s:  # the next size takes 8x longer
            break
        size *= 2
    return best


def copy_gbps(device: str, nbytes: int = 2**31, repeats: int = 10) -> float:
    """The memory bandwidth of ``device`` in GB/s, by one device-to-device copy of ``nbytes``
    (bytes read plus bytes written, per second; median of ``repeats``): the bound that a kernel
    reading its inputs once is measured against."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        timings.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(timings) / 1e9


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_AS, (_MEMORY_CAP, _MEMORY_CAP))
    probe_each(_probe_one, sys.argv[1:])
