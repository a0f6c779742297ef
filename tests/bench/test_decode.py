"""``attnkit bench --decode`` (attnkit.bench.decode) at smoke sizes: no timing is asserted."""

from __future__ import annotations

import json

import pytest

from attnkit.cli import main


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
