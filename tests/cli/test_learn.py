"""``attnkit learn``, run in-process on tiny settings: its files, its closing lines, its progress
bar, and one line with exit status 2 for bad input."""

from __future__ import annotations

import json
import re

import pytest

from attnkit.cli import main

TINY = ["--steps", "5", "--layers", "2", "--heads", "2", "--dim", "16", "--context", "16"]


def test_copy_writes_its_files_and_names_what_the_heads_did(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["learn", "--task", "copy", *TINY, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert (out / "heads.json").exists() and (out / "learn.html").exists()
    data = json.loads((out / "heads.json").read_text())
    assert data["task"] == "copy" and data["steps"][-1] == 5 and len(data["heads"]) == 4
    lines = captured.out.splitlines()
    assert lines[0].startswith("wrote ") and "heads.json" in lines[0]
    assert "on the copied tokens" in lines[-1] and "tokens/s" in lines[-1]
    assert "tokens/s" in captured.err and "s left" in captured.err  # the progress bar


def test_the_same_seed_writes_the_same_heads_json(tmp_path, capsys):
    for name in ("a", "b"):
        assert (
            main(["learn", "--task", "copy", *TINY, "--seed", "7", "--out", str(tmp_path / name)])
            == 0
        )
    capsys.readouterr()
    assert (tmp_path / "a" / "heads.json").read_text() == (
        tmp_path / "b" / "heads.json"
    ).read_text()


def test_text_from_a_file_with_the_attention_only_model(tmp_path, capsys):
    path = tmp_path / "t.txt"
    path.write_text("a quick brown fox jumps over the lazy dog\n" * 10)
    assert main(["learn", "--text", str(path), "--attention-only", *TINY]) == 0
    out = capsys.readouterr().out
    assert "character frequencies alone" in out and "wrote" not in out  # no --out, no files


@pytest.mark.parametrize(
    "args, message",
    [
        (["--text", "missing.txt"], "--text missing.txt: no such file"),
        (["--text", "empty.txt"], "--text empty.txt: the file is empty"),
        (["--text", "short.txt", "--context", "64"], "too short for --context 64"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--heads", "3"], r"dim \(64\) must be divisible by heads \(3\)"),
        (["--task", "copy", "--text", "short.txt"], "--text is for --task text"),
        (["--task", "copy", "--context", "4"], "--context must be >= 8 for --task copy, got 4"),
        # the bound said is the real one: --context 1 is refused for text too
        (["--context", "0"], "--context must be >= 2 for --task text, got 0"),
        (["--context", "1"], "--context must be >= 2 for --task text, got 1"),
        (["--context", "100000"], r"--context must be <= 1008 with 2 layers of 4 heads, got 1000"),
        (["--out", "full"], "--out full: the folder is not empty"),
        (["--out", "/proc/nope"], "--out /proc/nope: cannot write there"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--task", "poems"], "invalid choice: 'poems'"),
    ],
)
def test_bad_input_is_one_line_and_status_2(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("just a few words")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    try:
        status = main(["learn", *args])
    except SystemExit as exit:  # argparse's own errors (an unknown choice)
        status = exit.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith("attnkit: error:") and err.count("\n") == 1
    assert re.search(message, err), err


@pytest.mark.parametrize("task, context", [("text", 2), ("copy", 8)])
def test_the_shortest_context_said_is_taken(task, context, tmp_path, capsys):
    path = tmp_path / "t.txt"
    path.write_text("a quick brown fox jumps over the lazy dog\n" * 10)
    text = ["--text", str(path)] if task == "text" else []
    args = ["--steps", "2", "--layers", "2", "--heads", "2", "--dim", "16"]
    assert main(["learn", "--task", task, *text, *args, "--context", str(context)]) == 0
    assert "tokens/s" in capsys.readouterr().out


def test_help_says_the_threads_and_the_longest_context(capsys):
    from attnkit.learn.settings import max_context

    with pytest.raises(SystemExit):
        main(["learn", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "--threads" in said and "default 1" in said
    assert f"{max_context(2, 4)} with 2 layers of 4 heads" in said


def test_threads_reach_the_training(monkeypatch, capsys):
    import torch

    from attnkit.learn import train

    seen = []
    real = train.train
    monkeypatch.setattr(train, "train", lambda *a: seen.append(torch.get_num_threads()) or real(*a))
    before = torch.get_num_threads()
    assert main(["learn", "--task", "copy", *TINY, "--threads", "2"]) == 0
    assert main(["learn", "--task", "copy", *TINY]) == 0
    capsys.readouterr()
    assert seen == [2, 1] and torch.get_num_threads() == before
