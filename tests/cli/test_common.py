"""What every command shares: bad input is one line and exit status 2, ``--version``, the
console script; and the checks of attnkit.cli.common."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from attnkit.cli import main
from attnkit.cli.common import check_counts, check_folder, check_output


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


def test_an_output_must_have_the_commands_suffix_and_a_folder_to_go_in(tmp_path):
    target = tmp_path / "Attention.PNG"
    assert check_output(str(target), ".png") == target  # the suffix in any case
    with pytest.raises(ValueError, match=r"x\.html: the output must be a \.png file"):
        check_output("x.html", ".png")
    missing = tmp_path / "no" / "x.png"
    with pytest.raises(ValueError, match=rf"cannot write {missing}: {missing.parent} is not a"):
        check_output(str(missing), ".png")
    assert not missing.parent.exists()  # checked, nothing made


def test_a_folder_must_exist_be_a_folder_and_be_writable(tmp_path):
    assert check_folder(tmp_path / "." / "", "out") == tmp_path.resolve()
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ValueError, match=r"cannot write out: .*file is not a directory"):
        check_folder(a_file, "out")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="cannot write out: permission denied"):
            check_folder(locked, "out")
        read_only = tmp_path / "read-only.png"
        read_only.write_text("")
        read_only.chmod(0o400)
        with pytest.raises(ValueError, match="permission denied"):
            check_output(str(read_only), ".png")


def test_counts_must_be_at_least_one_each_value_of_a_list_too():
    args = argparse.Namespace(n=[128, 256], repeats=3, warmups=None, kv_heads=[2])
    check_counts(args, ("n", "repeats", "warmups", "kv_heads"))  # None: not given
    args.n = [128, 0]
    with pytest.raises(ValueError, match=r"--n must be >= 1, got 0"):
        check_counts(args, ("n",))
    args.kv_heads = -2
    with pytest.raises(ValueError, match=r"--kv-heads must be >= 1, got -2"):
        check_counts(args, ("kv_heads",))
