"""attnkit.bench: `attnkit bench`'s whole pipeline at smoke sizes (no timing is asserted), its
configurations, and the kernels it reports. Its parts: tests/bench/test_*.py."""

from __future__ import annotations

import io
import json

import torch

from attnkit.bench import BenchConfig, run
from attnkit.cli import main
from attnkit.tiled import plans as tiled_plans


def test_smoke_runs_end_to_end(tmp_path, capsys):
    # fp32 alone: the docs test runs the smoke preset's bf16 kernel and module cases (the
    # benchmarking guide's `--dtypes bf16 ... --module`), each case a fresh process
    assert main(["bench", "--smoke", "--dtypes", "fp32", "--out", str(tmp_path)]) == 0
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
    assert tiled_kernel["available"] and tiled_kernel["level"] == tiled_plans.KERNEL.level()
    assert tiled_kernel["origin"] in ("prebuilt", "cached", "built")
    assert (tiled_kernel["seconds"] is None) == (tiled_kernel["origin"] != "built")
    assert f"C++ kernels: tiled.cpp for {tiled_kernel['level']}, " in out
    assert (tmp_path / "results.md").read_text().startswith("Machine: ")
    assert (tmp_path / "results.png").stat().st_size > 10_000


def test_config_presets_and_cases():
    smoke = BenchConfig.from_name("smoke")
    assert smoke.ns == (48,) and smoke.module
    cases = BenchConfig(ns=(1024,), dtypes=("fp32",), modes=("fwd",), causal=(True,)).cases()
    assert [c.impl for c in cases][:2] == ["naive", "torch-sdpa"] and all(
        c.n == 1024 for c in cases
    )


def test_run_returns_results_for_every_case(tmp_path):
    config = BenchConfig(
        ns=(32,), dtypes=("fp32",), modes=("fwd",), causal=(False,),
        impls=("torch-sdpa", "flex-compiled"), h=1, d=8, repeats=1, warmups=0, matmul_max=256,
    )  # fmt: skip
    results, info = run(config, io.StringIO())
    assert [r.case.impl for r in results] == ["torch-sdpa", "flex-compiled"]
    assert info["matmul"]["fp32"][0] == 256


def test_the_kernel_report_names_both_kernels_after_the_decode_bench_is_imported():
    import attnkit.bench.decode  # noqa: F401  (a submodule named like the decode backend)
    from attnkit.bench import native_kernels

    assert set(native_kernels()) == {"tiled.cpp", "decode.cpp"}
