"""The notebooks in examples/notebooks run from top to bottom; their own cells assert the chapter's
numbers where they print them. The notebook that trains a GPT runs a short training here
(``ATTNKIT_NOTEBOOK_STEPS``); its full run is `attnkit learn`'s benchmark (docs/bench)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.outer  # out of `make test-fast`

nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

NOTEBOOKS = sorted((Path(__file__).parents[1] / "examples" / "notebooks").glob("*.ipynb"))


def test_there_is_a_notebook_per_step_of_the_chapter():
    names = [p.stem for p in NOTEBOOKS]
    for topic in ("simplified", "trainable", "causal", "multi_head", "real_model", "learn"):
        assert any(topic in name for name in names), topic


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNKIT_NOTEBOOK_STEPS", "100")  # seconds, not the full minute of training
    book = nbformat.read(path, as_version=4)
    NotebookClient(
        book, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for cell in book.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("text/html" in o.get("data", {}) for o in outputs)  # a result shown as a table
