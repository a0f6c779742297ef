"""``attnkit memory``, run in-process: a preset's table and totals beside plain MHA, a
config.json, the plot, and bad input in one line with exit status 2."""

from __future__ import annotations

import json

from attnkit.cli import main


def test_a_preset_prints_each_kind_of_layer_and_the_totals(capsys):
    assert main(["memory", "--preset", "qwen3-next-80b-a3b", "--lengths", "4096", "131072"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("qwen3-next-80b-a3b: 48 layers")
    assert "12  softmax, every token" in out and "36  linear (a fixed state)" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("4,096", "131"))]
    assert [row[0] for row in rows] == ["4,096", "131,072"]
    assert rows[1][1:3] == ["3.07", "GiB"] and rows[1][3:5] == ["96.00", "GiB"]  # as MHA: 96 GiB


def test_a_config_json_and_a_plot(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "tiny", "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 1,
                                  "hidden_size": 64}))  # fmt: skip
    plot = tmp_path / "memory.png"
    argv = ["memory", "--config", str(config), "--lengths", "1024", "--plot", str(plot)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tiny: 2 layers" in out and "1,024" in out and "0.250" in out  # 1 of 4 heads kept
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert main(["memory", "--config", str(bad)]) == 2
    assert "must hold a JSON object" in capsys.readouterr().err
    assert main(["memory", "--preset", "gpt2", "--lengths", "0"]) == 2
    assert "--lengths must be >= 1, got 0" in capsys.readouterr().err
    assert main(["memory", "--preset", "gpt2", "--plot", str(tmp_path / "x.svg")]) == 2
    assert ".png" in capsys.readouterr().err
