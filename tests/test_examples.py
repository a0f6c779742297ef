"""The scripts in examples/ run and do what they say."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"


def test_decode_example_generates_the_same_tokens_with_and_without_the_cache(capsys, monkeypatch):
    argv = ["decode.py", "--prompt", "24", "--new", "6", "--layers", "2", "--width", "32"]
    monkeypatch.setattr("sys.argv", argv)
    runpy.run_path(str(EXAMPLES / "decode.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "6 tokens after a 24-token prompt, 2 blocks:" in out
    assert "same tokens: True" in out
    assert "with a KV cache:" in out and "recomputing:" in out


@pytest.mark.parametrize("bad", [["--heads", "3"]])
def test_decode_example_rejects_bad_sizes(bad, monkeypatch):
    monkeypatch.setattr("sys.argv", ["decode.py", "--width", "32", *bad])
    with pytest.raises(ValueError, match=r"d_out .* num_heads"):
        runpy.run_path(str(EXAMPLES / "decode.py"), run_name="__main__")
