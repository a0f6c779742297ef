"""Heatmap tables and the HTML head view: their contents and escaping (the commands that write
them: tests/cli/)."""

from __future__ import annotations

import torch

from attnkit import simple_self_attention
from attnkit.textbook import JOURNEY_EMBEDDINGS
from attnkit.views import head_view_html, heatmap_table
from helpers.pages import page_data

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


def test_heatmaps_write_values_where_they_fit_and_scale_colours_to_the_data():
    """As the book's figures: each weight in its cell, the colours from the smallest to the
    largest weight shown (the chapter's weights are all below 0.25: on a 0-1 scale, all pale)."""
    import pytest

    pytest.importorskip("matplotlib")
    from attnkit.views import draw_heatmap, pyplot

    plt = pyplot()
    weights = simple_self_attention(torch.tensor(JOURNEY_EMBEDDINGS)).weights  # (6, 6)
    fig, (small, large) = plt.subplots(1, 2, figsize=(10, 5))
    image = draw_heatmap(small, weights, [str(i) for i in range(6)], "six tokens")
    assert image.get_clim() == pytest.approx((weights.min().item(), weights.max().item()))
    texts = [t.get_text() for t in small.texts]
    assert texts == [f"{w:.2f}" for w in weights.flatten().tolist()]
    many = torch.softmax(torch.randn(60, 60), dim=-1)
    draw_heatmap(large, many, [str(i) for i in range(60)], "60 tokens", labels=False)
    assert len(large.texts) == 0  # 60 cells across do not fit their values
    causal = simple_self_attention(torch.tensor(JOURNEY_EMBEDDINGS), causal=True).weights
    draw_heatmap(small, causal, [str(i) for i in range(6)], "causal", high=0.5)
    assert len(small.texts) == 36 + 21  # the masked cells (exact zeros) left blank
    assert small.images[-1].get_clim()[1] == 0.5
    plt.close(fig)


def test_heatmap_table_scales_its_shades_to_the_largest_weight():
    table = heatmap_table(torch.tensor([[0.1, 0.4]]), ["q"], ["a", "b"], "c")
    assert "rgba(31,119,180,1.000)" in table and "rgba(31,119,180,0.250)" in table
