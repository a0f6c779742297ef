"""``attnkit bench --hf`` (attnkit.bench.hf) at smoke sizes: no timing is asserted."""

from __future__ import annotations

import json

import pytest

from attnkit.cli import main

pytest.importorskip("transformers")


def test_hf_smoke_runs_every_implementation_of_its_cases(tmp_path, capsys):
    assert main(["bench", "--hf", "--smoke", "--out", str(tmp_path)]) == 0
    assert "| case | attention | time s | vs first | peak MiB |" in capsys.readouterr().out
    rows = json.loads((tmp_path / "hf.json").read_text())["rows"]
    assert [(r["case"], r["impl"]) for r in rows] == [
        ("gemma2 fp32", "eager"),
        ("gemma2 fp32", "attnkit"),
        ("gemma2 fp32", "none"),
        ("llama generate fp32", "sdpa"),
        ("llama generate fp32", "attnkit"),
    ]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["median_s"] > 0 and r["peak_mib"] is not None


def test_hf_takes_no_other_bench_mode(tmp_path, capsys):
    assert main(["bench", "--hf", "--ring", "--out", str(tmp_path)]) == 2
    assert "give one of --decode, --ring, --hf and --torch-nn" in capsys.readouterr().err
