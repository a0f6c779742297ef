"""attnkit.bench.report: the rows and the markdown table of a run's results."""

from __future__ import annotations

import pytest

from attnkit.bench.measure import Result
from attnkit.bench.peers import Case
from attnkit.bench.report import markdown, rows


def test_out_of_memory_row_in_the_report():
    case = Case("naive", 16384, "fp32", False, "fwd")
    table = rows([Result(case, status="oom")], {"fp32": (4096, 200.0)})
    text = markdown(table, {"machine": {"cpu": "x", "torch_threads": 2, "torch": "t", "cpu_capability": "c"},
                            "matmul": {"fp32": (4096, 200.0)}, "repeats": 5, "warmups": 2})  # fmt: skip
    assert "| full fp32 fwd N=16384 | naive | oom |" in text


def test_each_row_is_timed_against_its_groups_baseline_and_the_naive_path():
    def timed(impl, *seconds):
        return Result(Case(impl, 1024, "fp32", True, "fwd", h=2, d=16), times=list(seconds))

    results = [
        timed("naive", 0.4, 0.5, 0.9),
        timed("torch-sdpa", 0.2, 0.1, 0.3),
        timed("attnkit-tiled", 0.05, 0.1),
        Result(Case("flex-compiled", 1024, "fp32", True, "fwd", h=2, d=16), status="timeout"),
    ]
    table = {r["impl"]: r for r in rows(results, {"fp32": (4096, 100.0)})}
    assert table["torch-sdpa"]["vs_baseline"] == 1.0
    assert table["naive"]["vs_baseline"] == pytest.approx(2.5)  # medians 0.5 and 0.2
    assert table["attnkit-tiled"]["vs_naive"] == pytest.approx(0.075 / 0.5)
    assert table["attnkit-tiled"]["median_ms"] == pytest.approx(75.0)
    flops = results[2].case.flops
    assert table["attnkit-tiled"]["gflops"] == pytest.approx(flops / 0.075 / 1e9)
    assert table["attnkit-tiled"]["pct_matmul"] == pytest.approx(flops / 0.075 / 1e9)  # of 100
    timeout = table["flex-compiled"]
    assert timeout["status"] == "timeout" and timeout["median_ms"] is None
    assert timeout["vs_baseline"] is None and timeout["gflops"] is None
    info = {"machine": {"cpu": "x", "torch_threads": 2, "torch": "t", "cpu_capability": "c"},
            "matmul": {"fp32": (4096, 100.0)}, "repeats": 3, "warmups": 1}  # fmt: skip
    text = markdown(list(table.values()), info)
    assert text.startswith("Machine: x, 2 threads, torch t (c; CPU features: not recorded)")
    assert "| causal fp32 fwd N=1024 | torch-sdpa | 200.0 | 1.00 | 0.40 |" in text
    assert "| causal fp32 fwd N=1024 | flex-compiled | timeout | — | — | — |" in text
