"""Heatmap tables and the HTML head view: their contents and escaping (the commands that write
them: tests/cli/)."""

from __future__ import annotations

import torch

from attnkit import simple_self_attention
from attnkit.textbook import JOURNEY_EMBEDDINGS
from attnkit.views import head_view_html, heatmap_table
from pages import page_data

EVIL = "</script><script>alert(1)</script><b>&amp;"


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
