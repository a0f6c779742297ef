"""``attnkit plot`` (and ``explain --html``), run in-process: a picture, and the outputs and
options it refuses in one line."""

from __future__ import annotations

import pytest

from attnkit.cli import main


def test_plot_of_the_chapter_example_is_a_picture(tmp_path):
    import matplotlib.image

    out = tmp_path / "journey.png"
    assert main(["plot", "-o", str(out)]) == 0
    pixels = matplotlib.image.imread(out)
    assert pixels.shape[0] > 200 and pixels.std() > 0.05  # not blank


@pytest.mark.parametrize(
    "args,message",
    [
        (["plot", "-o", "/nonexistent/x.png"], "cannot write /nonexistent/x.png: /nonexistent is"),
        (["plot", "-o", "x.jpg"], "x.jpg: the output must be a .png file"),
        (["plot", "-o", "x.png", "--layer", "1"], "--layer, --head and --all-heads need --model"),
        (["plot", "-o", "x.png", "--text", "hi"], "--text needs --model"),
        (["explain", "--html", "/nonexistent/x.html"], "cannot write /nonexistent/x.html"),
    ],
)
def test_bad_outputs_and_options_are_one_line_and_exit_2(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_unwritable_folder(tmp_path, capsys):
    folder = tmp_path / "locked"
    folder.mkdir(mode=0o500)
    try:
        import os

        if os.access(folder, os.W_OK):  # root writes anywhere
            pytest.skip("this user can write to a read-only folder (root)")
        assert main(["plot", "-o", str(folder / "x.png")]) == 2
        assert "permission denied" in capsys.readouterr().err
    finally:
        folder.chmod(0o700)


def test_the_causal_example_is_another_picture(tmp_path, capsys):
    import matplotlib.image

    full, causal = tmp_path / "full.png", tmp_path / "causal.png"
    assert main(["plot", "-o", str(full)]) == 0
    assert main(["plot", "--causal", "-o", str(causal)]) == 0
    assert capsys.readouterr().out == f"wrote {full}\nwrote {causal}\n"
    a, b = matplotlib.image.imread(full), matplotlib.image.imread(causal)
    assert a.shape != b.shape or not (a == b).all()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--head", "1"], "--layer, --head and --all-heads need --model"),
        (["--all-heads"], "--layer, --head and --all-heads need --model"),
        (["--model", "minilm", "--causal"], "--causal does not apply to --model"),
    ],
)
def test_options_of_the_other_source_are_refused_before_any_work(args, message, tmp_path, capsys):
    out = tmp_path / "x.png"
    assert main(["plot", "-o", str(out), *args]) == 2
    assert capsys.readouterr().err == f"attnkit: error: {message}\n"
    assert not out.exists()
