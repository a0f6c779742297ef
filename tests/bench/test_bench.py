"""`attnkit bench`: the whole pipeline at smoke sizes (no timing is asserted), and its parts."""

from __future__ import annotations

import io
import json

import pytest
import torch

from attnkit.backends import tiled_native
from attnkit.bench import BenchConfig, run
from attnkit.bench.measure import Result, matmul_gflops, probe_memory, time_interleaved
from attnkit.bench.peers import Case
from attnkit.bench.report import markdown, rows
from attnkit.cli import main


def test_smoke_runs_end_to_end(tmp_path, capsys):
    assert main(["bench", "--smoke", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| kernel case | implementation | median ms | vs torch-sdpa |" in out
    assert "| module case | implementation | median ms | vs torch-mha |" in out
    data = json.loads((tmp_path / "results.json").read_text())
    records = data["results"]
    impls = {r["impl"] for r in records}
    assert {"naive", "torch-sdpa", "attnkit-tiled", "torch-mha", "attnkit-mha"} <= impls
    for r in records:
        assert r["status"] == "ok" or r["status"].startswith("n/a"), r
        if r["status"] == "ok":
            assert r["median_ms"] > 0 and r["peak_mib"] is not None and r["gflops"] > 0
    for r in records:  # which_backend names what ran attnkit's cases: tiled is tiled
        if r["impl"] == "attnkit-tiled" and r["status"] == "ok":
            assert r["runs"].split()[0] == "tiled" and r["runs"].split()[1] in ("native", "loop")
            assert f"attnkit-tiled ({r['runs']})" in out
        elif not r["impl"].startswith("attnkit-") or r["group"] == "module":
            assert r["runs"] is None
    sdpa = [r for r in records if r["impl"] == "torch-sdpa" and r["status"] == "ok"]
    assert all(r["vs_baseline"] == 1.0 for r in sdpa)
    assert data["info"]["machine"]["torch"] == torch.__version__
    tiled_kernel = data["info"]["native"]["tiled.cpp"]
    assert tiled_kernel["available"] and tiled_kernel["level"] == tiled_native.KERNEL.level()
    assert tiled_kernel["origin"] in ("prebuilt", "cached", "built")
    assert (tiled_kernel["seconds"] is None) == (tiled_kernel["origin"] != "built")
    assert f"C++ kernels: tiled.cpp for {tiled_kernel['level']}, " in out
    assert (tmp_path / "results.md").read_text().startswith("Machine: ")
    assert (tmp_path / "results.png").stat().st_size > 10_000


def test_a_case_over_its_time_budget_is_reported_not_dropped():
    case = Case("naive", 64, "fp32", False, "fwd", h=1, d=8)
    result = probe_memory(case, timeout_s=0.01)
    assert result.status.startswith("timeout")


def test_a_case_that_raises_is_marked_and_leaves_the_rotation():
    ok, bad = Result(Case("a", 1, "fp32", False, "fwd")), Result(Case("b", 1, "fp32", False, "fwd"))

    def boom():
        raise RuntimeError("DefaultCPUAllocator: not enough memory")

    time_interleaved([(ok, lambda: None), (bad, boom)], repeats=3, warmups=1)
    assert len(ok.times) == 3 and not bad.times
    assert bad.status == "error: DefaultCPUAllocator: not enough memory"


def test_out_of_memory_row_in_the_report():
    case = Case("naive", 16384, "fp32", False, "fwd")
    table = rows([Result(case, status="oom")], {"fp32": (4096, 200.0)})
    text = markdown(table, {"machine": {"cpu": "x", "torch_threads": 2, "torch": "t", "cpu_capability": "c"},
                            "matmul": {"fp32": (4096, 200.0)}, "repeats": 5, "warmups": 2})  # fmt: skip
    assert "| full fp32 fwd N=16384 | naive | oom |" in text


def test_matmul_throughput_is_positive():
    size, gflops = matmul_gflops(torch.float32, max_size=256)
    assert size == 256 and gflops > 0


def test_config_presets_and_cases():
    smoke = BenchConfig.from_name("smoke")
    assert smoke.ns == (48,) and smoke.module
    cases = BenchConfig(ns=(1024,), dtypes=("fp32",), modes=("fwd",), causal=(True,)).cases()
    assert [c.impl for c in cases][:2] == ["naive", "torch-sdpa"] and all(
        c.n == 1024 for c in cases
    )


def test_bad_bench_arguments_exit_2(capsys):
    assert main(["bench", "--n", "0"]) == 2
    assert capsys.readouterr().err.strip() == "attnkit: error: --n must be >= 1, got 0"


def test_run_returns_results_for_every_case(tmp_path):
    config = BenchConfig(
        ns=(32,), dtypes=("fp32",), modes=("fwd",), causal=(False,),
        impls=("torch-sdpa", "flex-compiled"), h=1, d=8, repeats=1, warmups=0, matmul_max=256,
    )  # fmt: skip
    results, info = run(config, io.StringIO())
    assert [r.case.impl for r in results] == ["torch-sdpa", "flex-compiled"]
    assert info["matmul"]["fp32"][0] == 256


def test_decode_smoke_runs_end_to_end(tmp_path, capsys):
    assert main(["bench", "--decode", "--smoke", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| decode step | implementation | median ms | limit ms | vs limit |" in out
    record = json.loads((tmp_path / "decode.json").read_text())
    steps = record["steps"]
    assert {s["impl"] for s in steps} == {"attnkit", "torch-sdpa", "naive"}
    assert all(s["status"] == "ok" and s["median_ms"] > 0 and s["limit_ms"] > 0 for s in steps)
    for s in steps:  # which backend ran attnkit's step, as which_backend reports it
        assert (s["runs"] is None) == (s["impl"] != "attnkit")
        if s["runs"] is not None:
            assert f"attnkit ({s['runs']})" in out
    assert record["info"]["read_bandwidth_gb_s"] > 0
    fp32 = {
        (s["length"], s["h_kv"]): s
        for s in steps
        if s["impl"] == "attnkit" and s["dtype"] == "fp32"
    }
    for s in steps:  # every dtype of a length and layout timed in the same rounds as attnkit fp32
        base = fp32[s["length"], s["h_kv"]]
        assert s["read_gb_s"] == base["read_gb_s"]
        assert s["vs_fp32"] == pytest.approx(s["median_ms"] / base["median_ms"])
    memory = {row["layout"]: row["fraction"] for row in record["memory"]}
    assert memory["MHA fp32"] == 1.0 and memory["MHA bf16"] == 0.5
    assert memory["GQA 1 kv heads fp32"] == 0.5  # smoke: 2 query heads
    gen = record["generation"][0]
    assert gen["cached_tokens_per_s"] > 0 and gen["recomputed_tokens_per_s"] > 0
    low, high = gen["speedup_range"]
    assert gen["rounds"] == 3 and low <= gen["speedup"] <= high


def test_ring_smoke_runs_end_to_end(tmp_path, capsys):
    assert main(["bench", "--ring", "--smoke", "--out", str(tmp_path)]) == 0
    assert "| N | ranks | layout | step s | vs whole |" in capsys.readouterr().out
    rows = json.loads((tmp_path / "ring.json").read_text())["rows"]
    cases = [(r["world"], r["layout"]) for r in rows]
    assert cases == [(1, "whole"), (1, "contiguous"), (2, "contiguous"), (2, "zigzag")]
    for r in rows:
        assert r["step_s"] > 0 and len(r["cpu_s"]) == r["world"] and r["balance"] >= 1.0
        # each rank sends its keys and values on P - 1 steps of the forward and of the backward,
        # and their float32 gradients on P steps: smoke is b=1, h=1, d=64, N=256
        shard = 256 // r["world"] * 64 * 4 * 2  # bytes of a rank's keys and values
        sent = 0 if r["world"] == 1 else shard * (2 * (r["world"] - 1) + r["world"])
        assert r["sent_mib"] == pytest.approx(sent / 2**20)


def test_ring_bench_rejects_lengths_the_ranks_cannot_split(capsys):
    assert main(["bench", "--ring", "--smoke", "--n", "250", "--ranks", "4"]) == 2
    assert "--n 250 must split into 2 x 4 equal chunks" in capsys.readouterr().err


def test_decode_bench_rejects_kv_heads_that_do_not_divide_h(capsys):
    assert main(["bench", "--decode", "--smoke", "--h", "6", "--kv-heads", "4"]) == 2
    assert "--h (6) must be a multiple of every --kv-heads, got 4" in capsys.readouterr().err


def test_the_kernel_report_names_both_kernels_after_the_decode_bench_is_imported():
    import attnkit.bench.decode  # noqa: F401  (a submodule named like the decode backend)
    from attnkit.bench import native_kernels

    assert set(native_kernels()) == {"tiled.cpp", "decode.cpp"}
