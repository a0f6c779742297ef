"""The benchmark's outputs: a JSON record, a Markdown table and a PNG plot, plus the machine."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections import defaultdict
from pathlib import Path

import torch

from attnkit.bench.flex_cases import OWN_MASK
from attnkit.bench.measure import Result
from attnkit.kernels import cpu

BASELINES = {"kernel": "torch-sdpa", "module": "torch-mha"}


def _kernel_line(item: tuple[str, dict]) -> str:
    name, kernel = item
    if not kernel["available"]:
        return f"{name} unavailable ({kernel['why']})"
    origin = {
        "prebuilt": "prebuilt in the wheel",
        "cached": "built earlier",
        "built": f"built in {kernel['seconds'] or 0:.0f} s",
    }.get(kernel.get("origin"), "loaded")
    return f"{name} for {kernel.get('level')}, {origin}"


def machine(device: str = "cpu") -> dict:
    """The facts a reader needs to compare a table with their own machine (and its GPU, for a
    run on one)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_features": cpu.describe(),
        "python": platform.python_version(),
        **(gpu() if device != "cpu" else {}),
    }


def gpu() -> dict:
    """The GPU of this process, its driver and torch's CUDA."""
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "unknown"
    return {"gpu": torch.cuda.get_device_name(), "driver": driver, "cuda": torch.version.cuda}


def _by_key(results: list[Result]) -> dict[tuple, dict[str, Result]]:
    rows: dict[tuple, dict[str, Result]] = defaultdict(dict)
    for r in results:
        rows[r.case.key()][r.case.impl] = r
    return rows


def rows(results: list[Result], matmul: dict[str, tuple[int, float]]) -> list[dict]:
    """One flat record per result, with its ratios to the baseline peer and to the naive path."""
    table = []
    for key, by_impl in _by_key(results).items():
        group = key[0]
        baseline = by_impl.get(BASELINES[group])
        naive = by_impl.get("naive")
        for r in by_impl.values():
            t = r.median_s
            gflops = r.case.flops / t / 1e9 if t else None
            peak = matmul.get(r.case.dtype, (0, 0.0))[1]
            table.append(
                {
                    **r.case.to_json(),
                    "status": r.status,
                    "median_ms": t * 1e3 if t else None,
                    "first_call_ms": r.first_call_s * 1e3 if r.first_call_s else None,
                    "vs_baseline": t / baseline.median_s
                    if t and baseline and baseline.median_s
                    else None,
                    "vs_naive": t / naive.median_s if t and naive and naive.median_s else None,
                    "gflops": gflops,
                    "pct_matmul": 100 * gflops / peak if gflops and peak else None,
                    "peak_mib": r.peak_mib,
                    "runs": r.runs,
                }
            )
    return table


def _impl(record: dict) -> str:
    """The implementation, and for attnkit's the backend and path that ran (``auto → tiled native``)."""
    runs = record.get("runs")
    return record["impl"] if runs is None else f"{record['impl']} ({runs})"


def _fmt(value: float | None, pattern: str) -> str:
    return "—" if value is None else format(value, pattern)


def markdown(records: list[dict], info: dict) -> str:
    """A table per group, one line per measurement; ratios < 1 are faster than the peer."""
    m = info["machine"]
    where = f"GPU: {m['gpu']} (driver {m['driver']}, CUDA {m['cuda']}); " if "gpu" in m else ""
    lines = [
        f"{where}Machine: {m['cpu']}, {m['torch_threads']} threads, torch {m['torch']} "
        f"({m['cpu_capability']}; CPU features: {m.get('cpu_features', 'not recorded')}); matmul peak in this run: "
        + ", ".join(f"{dt} {g:.0f} GFLOP/s ({n}^3)" for dt, (n, g) in info["matmul"].items())
        + f"; median of {info['repeats']} interleaved runs after {info['warmups']} warm-ups.",
        "",
    ]
    if info.get("native"):
        lines += [f"C++ kernels: {'; '.join(map(_kernel_line, info['native'].items()))}.", ""]
    for group, baseline in BASELINES.items():
        mine = [r for r in records if r["group"] == group]
        if not mine:
            continue
        lines += [
            f"| {group} case | implementation | median ms | vs {baseline} | vs naive | GFLOP/s | % matmul | peak MiB |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in mine:
            mask = "causal" if r["causal"] else "full"
            if r["variant"] in OWN_MASK:
                mask = "mask"  # its own: the variant's name says which
            case = f"{mask} {r['dtype']} {r['mode']} N={r['n']}"
            if r["variant"] != "plain":
                case = f"{r['variant']} {case}"
            timing = _fmt(r["median_ms"], ".1f") if r["status"] == "ok" else r["status"]
            lines.append(
                f"| {case} | {_impl(r)} | {timing} | {_fmt(r['vs_baseline'], '.2f')} | "
                f"{_fmt(r['vs_naive'], '.2f')} | {_fmt(r['gflops'], '.0f')} | "
                f"{_fmt(r['pct_matmul'], '.0f')} | {_fmt(r['peak_mib'], '.0f')} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> bool:
    """Median time against N, one panel per (dtype, mode, causal), one line per implementation.
    Returns False (and writes nothing) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    kernel = [r for r in records if r["group"] == "kernel" and r["variant"] == "plain"]
    panels = sorted({(r["dtype"], r["mode"], r["causal"]) for r in kernel})
    if not panels:
        return False
    cols = min(4, len(panels))
    grid_rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(grid_rows, cols, figsize=(4.5 * cols, 4 * grid_rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    impls = sorted({r["impl"] for r in kernel})
    colors = {impl: f"C{i}" for i, impl in enumerate(impls)}  # one colour per peer in every panel
    for ax, (dtype, mode, causal) in zip(axes.flat, panels):
        lines = defaultdict(list)
        for r in kernel:
            if (r["dtype"], r["mode"], r["causal"]) == (dtype, mode, causal) and r["median_ms"]:
                lines[r["impl"]].append((r["n"], r["median_ms"]))
        for impl, points in sorted(lines.items()):
            ns, ms = zip(*sorted(points))
            ax.plot(ns, ms, marker="o", label=impl, color=colors[impl])
        ax.set(xscale="log", yscale="log", xlabel="N", ylabel="median ms")
        ax.set_title(f"{dtype} {mode} {'causal' if causal else 'full'}")
        ax.grid(True, which="both", alpha=0.3)
    handles = [plt.Line2D([], [], color=colors[i], marker="o", label=i) for i in impls]
    fig.legend(handles=handles, loc="lower center", ncols=len(impls), fontsize="small")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(results: list[Result], info: dict, out_dir: Path) -> dict[str, Path]:
    """Write results.json, results.md and (with matplotlib) results.png; returns what was written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records = rows(results, info["matmul"])
    written = {"json": out_dir / "results.json", "markdown": out_dir / "results.md"}
    written["json"].write_text(json.dumps({"info": info, "results": records}, indent=1))
    written["markdown"].write_text(markdown(records, info))
    if plot(records, out_dir / "results.png"):
        written["png"] = out_dir / "results.png"
    return written


def write_record(record: dict, out_dir: Path, stem: str, text: str) -> dict[str, Path]:
    """A bench's record as ``stem.json`` and its table, ``text``, as ``stem.md`` in ``out_dir``
    (made if need be); returns what was written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {"json": out_dir / f"{stem}.json", "markdown": out_dir / f"{stem}.md"}
    written["json"].write_text(json.dumps(record, indent=1))
    written["markdown"].write_text(text)
    return written
