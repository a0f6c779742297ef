"""``attnkit bench --ring`` (attnkit.bench.ring) at smoke sizes: no timing is asserted."""

from __future__ import annotations

import json

import pytest

from attnkit.cli import main


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
