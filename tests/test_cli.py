"""The attnkit command, run in-process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attnkit.cli import main


def test_explain_default_is_the_chapter_example(capsys):
    assert main(["explain"]) == 0
    out = capsys.readouterr().out
    assert "Query 'journey'" in out
    assert "0.4419  0.6515  0.5683" in out


def test_explain_query_and_normalize(capsys):
    assert main(["explain", "--query", "step", "--normalize", "sum"]) == 0
    out = capsys.readouterr().out
    assert "Query 'step' (position 5)" in out and "score / sum of scores" in out
    assert main(["explain", "--query-index", "0", "--causal"]) == 0
    out = capsys.readouterr().out
    assert "Query 'Your' (position 0)" in out and "causal" in out


def test_explain_own_text_with_embeddings_file(tmp_path, capsys):
    path = tmp_path / "emb.json"
    path.write_text(json.dumps({"hello": [1.0, 0.0], "world": [0.0, 1.0]}))
    assert main(["explain", "--text", "hello world", "--embeddings", str(path)]) == 0
    assert "Query 'world' (position 1)" in capsys.readouterr().out


def test_explain_random_embeddings(capsys):
    assert main(["explain", "--text", "a b c", "--dim", "5", "--seed", "1"]) == 0
    assert "(3 tokens, 5 dims)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["explain", "--query", "nope"], "query token 'nope' is not in the text"),
        (["explain", "--query-index", "9"], r"--query-index must be in [0, 5], got 9"),
        (["explain", "--text", "   "], "the text is empty"),
        (["explain", "--text", "a", "--embeddings", "/no/such/file.json"], "cannot read embeddings file"),
        (["explain", "--dim", "3"], "--dim gives random embeddings for --text; add --text"),
        (["explain", "--text", "a", "--dim", "0"], "--dim must be between 1 and 4096"),
        (["explain", "--text", "a", "--dim", "10000000000"], "got 10000000000"),  # was 1.8 GB
        (["explain", "--normalize", "max"], "argument --normalize: invalid choice: 'max'"),
        (["explain", "--bogus"], "unrecognized arguments: --bogus"),
        ([], "the following arguments are required: COMMAND"),
    ],
)  # fmt: skip
def test_bad_input_prints_one_line_and_exits_2(argv, message, capsys):
    try:
        status = main(argv)
    except SystemExit as exit_:
        status = exit_.code
    captured = capsys.readouterr()
    assert status == 2
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnkit: error: ")
    assert message in lines[0]


def test_bad_embeddings_file_content(tmp_path, capsys):
    path = tmp_path / "emb.json"
    path.write_text('{"a": [1, 2], "b": [3]}')
    assert main(["explain", "--text", "a b", "--embeddings", str(path)]) == 2
    assert "unequal lengths" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"a": [NaN, 1], "b": [1, 2]}', "not a finite float32 number"),
        ('{"a": [Infinity, 1], "b": [1, 2]}', "not a finite float32 number"),
        ('{"a": [1e39, 1], "b": [1, 2]}', "not a finite float32 number"),  # overflows float32
        ('{"a": [1' + "0" * 400 + ', 1], "b": [1, 2]}', "not a finite float32 number"),
        ('{"a": [1e30, 1], "b": [1, 2]}', "dot products overflow float32"),
    ],
)
def test_embeddings_that_would_give_nan_tables_are_refused(tmp_path, capsys, content, message):
    path = tmp_path / "emb.json"
    path.write_text(content)
    assert main(["explain", "--embeddings", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err and "nan" not in captured.err


def test_console_script_runs_without_traceback():
    done = subprocess.run(
        [sys.executable, "-m", "attnkit.cli", "explain", "--query", "nope"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_version_is_the_installed_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"attnkit {version('attnkit')}\n"


def test_build_reports_what_is_built_for_which_cpu_and_where(capsys):
    from attnkit import _build, _cpu

    assert main(["build"]) == 0  # `make test` built them: nothing to do but report
    out = capsys.readouterr().out.splitlines()
    assert _cpu.describe() in out[0] and f"the {_cpu.build_level()} build" in out[0]
    assert str(_build.extensions_folder()) in out[0]
    rows = {line.split()[0]: line for line in out[1:]}
    assert set(rows) == set(_build.KERNELS)
    for kernel, row in rows.items():
        path = Path(row.split()[-1])
        assert path.exists() and path.name.startswith(f"attnkit_{kernel}_")
        assert any(said in row for said in ("already built", "built now", "prebuilt in the wheel"))


def test_build_check_builds_nothing_and_says_what_is_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    assert main(["build", "--check"]) == 1
    out = capsys.readouterr().out
    assert out.count("not built yet") == 2 and str(tmp_path / "extensions") in out
    assert not (tmp_path / "extensions").exists()


def test_a_build_that_fails_exits_1_naming_the_cause(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setenv("CXX", "/nowhere/c++")
    assert main(["build", "--force"]) == 1
    out = capsys.readouterr().out
    assert out.count("could not be built") == 2
    assert out.count("no C++ compiler: '/nowhere/c++' is not on PATH") == 2
    assert "runs PyTorch operations instead" in out.splitlines()[-1]


def test_build_takes_force_or_check_not_both(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["build", "--force", "--check"])
    assert stopped.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("timeout", ["0", "-1", "inf"])
def test_bench_refuses_a_timeout_that_is_not_a_positive_number(timeout, capsys):
    assert main(["bench", "--smoke", "--timeout", timeout]) == 2
    assert "--timeout must be a positive number of seconds" in capsys.readouterr().err


def test_bench_checks_its_output_folder_before_any_work(tmp_path, capsys):
    missing = tmp_path / "no" / "such" / "folder"
    assert main(["bench", "--smoke", "--out", str(missing)]) == 2
    assert f"{tmp_path / 'no' / 'such'} is not a directory" in capsys.readouterr().err
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert main(["bench", "--smoke", "--out", str(a_file)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
