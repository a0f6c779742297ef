"""Heatmap tables, PNG plots and the HTML head view: contents, escaping, and the CLI around them."""

from __future__ import annotations

import json
import re

import pytest
import torch

from attnkit import simple_self_attention
from attnkit.cli import main
from attnkit.textbook import JOURNEY_EMBEDDINGS, JOURNEY_TOKENS
from attnkit.views import head_view_html, heatmap_table

EVIL = "</script><script>alert(1)</script><b>&amp;"


def page_data(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S)
    return json.loads(match.group(1))


def test_heatmap_table_shades_every_cell_and_escapes_labels():
    weights = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    table = heatmap_table(weights, ["<i>", "b"], ["x", "&"], "a <caption>")
    assert table.count("<td") == 4
    assert "rgba(31,119,180,0.750)" in table and ">0.75</td>" in table
    assert "&lt;i&gt;" in table and "<i>" not in table and "&amp;" in table
    assert "a &lt;caption&gt;" in table


def test_attention_result_renders_its_weights_in_jupyter():
    result = simple_self_attention(torch.tensor(JOURNEY_EMBEDDINGS))
    table = result._repr_html_()
    assert table.count("<td") == 36
    assert f">{result.weights[1, 1].item():.2f}</td>" in table  # journey -> journey, 0.24


def test_head_view_carries_the_weights_and_escapes_every_token():
    tokens = ["[CLS]", EVIL, "ok"]
    weights = torch.softmax(torch.randn(2, 3, 3, 3), dim=-1)
    page = head_view_html(tokens, weights, f"title {EVIL}")
    assert page.count("<script") == 2  # the data block and the page's own script: nothing injected
    assert "alert(1)</script>" not in page and "<b>" not in page
    data = page_data(page)
    assert data["tokens"] == tokens and data["heads"] == 3
    assert data["layers"] == ["layer 0", "layer 1"]
    torch.testing.assert_close(torch.tensor(data["weights"]), weights, atol=1e-5, rtol=0)
    assert "http" not in page.replace("http://www.w3.org/2000/svg", "")  # nothing from a network


def test_explain_html_for_the_chapter_example(tmp_path, capsys):
    out = tmp_path / "journey.html"
    assert main(["explain", "--html", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    data = page_data(out.read_text())
    assert data["tokens"] == list(JOURNEY_TOKENS)
    expected = simple_self_attention(torch.tensor(JOURNEY_EMBEDDINGS)).weights
    torch.testing.assert_close(torch.tensor(data["weights"][0][0]), expected, atol=1e-5, rtol=0)


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
