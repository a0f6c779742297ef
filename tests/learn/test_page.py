"""The run's page: what its loss chart and its notes are given (the browser test draws them)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from attnkit.learn import learn
from attnkit.learn.page import learn_page, loss_caption
from helpers.pages import page_data

TINY = {"steps": 6, "layers": 2, "heads": 2, "dim": 16, "context": 16}


@pytest.fixture(scope="module")
def copy_run():
    return learn("copy", **TINY, progress=False)


def test_the_chart_gets_the_copied_and_other_tokens_loss(copy_run):
    data = page_data(learn_page(copy_run))
    assert data["loss_repeated"] == copy_run.loss_repeated
    assert data["loss_others"] == copy_run.loss_others
    assert len(data["loss_repeated"]) == len(data["steps"]) == len(data["loss"])


def test_the_text_tasks_chart_has_one_training_curve(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("the cat sat on the mat. " * 40)
    data = page_data(learn_page(learn("text", text=path, **TINY, progress=False)))
    assert data["loss_repeated"] is None and data["loss_others"] is None
    assert "copied" not in data["caption"]


def test_the_caption_gives_the_loss_at_the_end_and_the_lowest_apart(copy_run):
    """The loss at the end is the last point, not the lowest one."""
    run = replace(copy_run, loss=[*copy_run.loss[:-2], 2.5, 3.25])  # the lowest before the end
    caption = loss_caption(run)
    assert "3.250 at the end (the lowest 2.500)" in caption
    assert f"at the end {run.loss_repeated[-1]:.3f} on the copied tokens" in caption
    assert page_data(learn_page(run))["caption"] == caption


def test_the_page_says_where_the_scores_were_read(copy_run):
    note = page_data(learn_page(copy_run))["scores_note"]
    assert "16 held-out probes" in note and "not over the one sequence drawn" in note
