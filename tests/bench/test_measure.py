"""attnkit.bench.measure: a case over its time budget, a case that raises, the matmul rate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnkit.bench.measure import (
    Result,
    matmul_gflops,
    median_seconds,
    probe_memory,
    time_interleaved,
)
from attnkit.bench.peers import Case


def test_a_case_over_its_time_budget_is_reported_not_dropped():
    case = Case("naive", 64, "fp32", False, "fwd", h=1, d=8)
    [result] = probe_memory([case], timeout_s=0.01)
    assert result.status.startswith("timeout")


def test_a_case_that_raises_is_marked_and_leaves_the_rotation():
    ok, bad = Result(Case("a", 1, "fp32", False, "fwd")), Result(Case("b", 1, "fp32", False, "fwd"))

    def boom():
        raise RuntimeError("DefaultCPUAllocator: not enough memory")

    time_interleaved([(ok, lambda: None), (bad, boom)], repeats=3, warmups=1)
    assert len(ok.times) == 3 and not bad.times
    assert bad.status == "error: DefaultCPUAllocator: not enough memory"


def test_matmul_throughput_is_positive():
    size, gflops = matmul_gflops(torch.float32, max_size=256)
    assert size == 256 and gflops > 0


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's /proc only")
def test_the_peak_counts_from_its_reset_not_from_what_came_before():
    from attnkit.bench.measure import peak_mib, reset_peak, resident_mib

    big = torch.ones(64 * 2**20)  # 256 MiB, touched, then freed
    del big
    reset_peak()
    before = resident_mib()
    assert peak_mib() - before < 64
    small = torch.ones(16 * 2**20)  # 64 MiB
    assert peak_mib() - before >= 60
    del small


def test_one_process_probes_every_case_in_turn_and_reports_each():
    cases = [Case(impl, 16, "fp32", False, "fwd", h=1, d=8) for impl in ("naive", "torch-sdpa")]
    results = probe_memory(cases, timeout_s=120, one_process=True)
    assert [r.case for r in results] == cases
    assert all(r.status == "ok" and r.peak_mib is not None and r.first_call_s > 0 for r in results)


def test_a_case_that_raises_reports_its_error_and_the_next_one_runs():
    from attnkit.bench.measure import in_fresh_process

    case = json.dumps(Case("naive", 16, "fp32", False, "fwd", h=1, d=8).to_json())
    reports = in_fresh_process("attnkit.bench.measure", ["not json", case], timeout_s=120)
    assert reports[0]["status"].startswith("error: Expecting value")
    assert reports[1]["status"] == "ok" and reports[1]["peak_mib"] is not None


def test_a_process_stopped_early_marks_the_cases_it_did_not_report():
    from attnkit.bench.measure import in_fresh_process

    case = json.dumps(Case("naive", 16, "fp32", False, "fwd", h=1, d=8).to_json())
    reports = in_fresh_process("attnkit.bench.measure", [case, case], timeout_s=0.01)
    assert [r["status"] for r in reports] == ["timeout (> 0 s)"] * 2


def test_the_median_time_counts_the_timed_calls_only():
    calls = []
    seconds = median_seconds(lambda: calls.append(1), repeats=5, warmups=2)
    assert len(calls) == 7 and 0 <= seconds < 1
