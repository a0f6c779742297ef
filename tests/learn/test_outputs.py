"""The files of a run: heads.json, the page (self-contained, escaped), the pictures or a note
without matplotlib; and the folder they go to."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from attnkit.learn import learn, write_outputs
from attnkit.learn.outputs import check_out
from attnkit.learn.page import learn_page
from helpers.pages import page_data

TINY = {"steps": 4, "layers": 2, "heads": 2, "dim": 16, "context": 16}
EVIL = "</script><script>alert(1)</script><b>&amp; "


@pytest.fixture(scope="module")
def evil_run(tmp_path_factory):
    """A text run on a text that tries to inject markup into the page."""
    path = tmp_path_factory.mktemp("text") / "evil.txt"
    path.write_text(EVIL * 30)
    return learn("text", text=path, **TINY, progress=False)


def test_the_files_are_written_with_pictures(evil_run, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    written, notes = write_outputs(evil_run, tmp_path / "run")
    assert notes == []
    assert sorted(p.name for p in written) == ["heads.json", "heads.png", "learn.html", "loss.png"]
    data = json.loads((tmp_path / "run" / "heads.json").read_text())
    assert data == json.loads(json.dumps(evil_run.heads_json()))
    for name in ("loss.png", "heads.png"):
        pixels = matplotlib.image.imread(tmp_path / "run" / name)
        assert pixels.std() > 0.02, name  # not a blank picture


def test_without_matplotlib_the_rest_is_written_and_a_note_says_why(
    evil_run, tmp_path, monkeypatch
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    monkeypatch.delitem(sys.modules, "attnkit.learn.pictures", raising=False)
    written, notes = write_outputs(evil_run, tmp_path)
    assert sorted(p.name for p in written) == ["heads.json", "learn.html"]
    assert len(notes) == 1 and "need matplotlib" in notes[0] and "attnkit[plots]" in notes[0]


def test_the_page_is_self_contained_and_escapes_every_text(evil_run):
    page = learn_page(evil_run)
    assert page.count("<script") == 2  # the data block and the page's own script
    assert "alert(1)</script>" not in page and "<b>" not in page
    assert "http" not in page.replace("http://www.w3.org/2000/svg", "")  # nothing from a network
    assert "<link" not in page and "src=" not in page
    data = page_data(page)
    assert "".join(data["labels"]).replace("␣", " ") in EVIL * 2
    assert set(data["labels"]) & {"<", ">", "&"}  # the dangerous characters are there, as data
    weights = torch.tensor(data["weights"])
    torch.testing.assert_close(weights, evil_run.weights, atol=5e-4, rtol=0)
    assert data["snapshot_steps"] == evil_run.snapshot_steps
    assert list(data["scores"]) == ["previous_token", "first_token", "self", "induction"]


def test_out_is_a_new_or_empty_folder(tmp_path):
    assert check_out(tmp_path) == tmp_path  # empty
    assert check_out(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    (tmp_path / "x").write_text("")
    with pytest.raises(ValueError, match="the folder is not empty"):
        check_out(tmp_path)
    with pytest.raises(ValueError, match="is a file"):
        check_out(tmp_path / "x")
    with pytest.raises(ValueError, match="--out /proc/nope: cannot write there"):
        check_out("/proc/nope")  # a folder whose parent exists but takes no new folders


def test_learn_refuses_a_non_empty_out_before_training(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        learn("copy", **TINY, out=tmp_path, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
