"""The files of a run, in a new or empty folder: ``heads.json``, ``learn.html`` and, with the
'plots' extra (matplotlib), ``loss.png`` and ``heads.png``. Without matplotlib the pictures are
left out, with a note saying so, and the rest is written."""

from __future__ import annotations

import json
from pathlib import Path

from attnkit.learn.page import learn_page
from attnkit.learn.record import LearnResult


def check_out(out: str | Path) -> Path:
    """``out`` as a folder to write into, before any training: new, or existing and empty. A new
    one (and its parents) is created now, and a file is written into it and removed again, so
    that a folder that cannot be written fails at once, not after the training.

    Raises:
        ValueError: ``out`` is a file, a folder that holds files, or cannot be created or written.
    """
    folder = Path(out)
    if folder.exists():
        if not folder.is_dir():
            raise ValueError(f"--out {out}: is a file; give a new or empty folder")
        if any(folder.iterdir()):
            raise ValueError(f"--out {out}: the folder is not empty; give a new or empty folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".attnkit-write-check"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise ValueError(f"--out {out}: cannot write there ({error.strerror or error})") from None
    return folder


def write_outputs(result: LearnResult, folder: str | Path) -> tuple[list[Path], list[str]]:
    """Write the run's files into ``folder``; returns the files written and notes (what was left
    out, and why)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    heads = folder / "heads.json"
    heads.write_text(json.dumps(result.heads_json(), indent=1) + "\n", encoding="utf-8")
    page = folder / "learn.html"
    page.write_text(learn_page(result), encoding="utf-8")
    written, notes = [heads, page], []
    try:
        from attnkit.learn.pictures import plot_heads, plot_loss

        written.append(plot_loss(result, folder / "loss.png"))
        written.append(plot_heads(result, folder / "heads.png"))
    except ModuleNotFoundError as err:
        if err.name != "matplotlib" and "matplotlib" not in str(err):
            raise
        notes.append(
            "no pictures (loss.png, heads.png): they need matplotlib, "
            "pip install 'attnkit[plots]'; heads.json and learn.html are written"
        )
    return written, notes
