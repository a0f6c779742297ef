"""`attnkit explain --model minilm`: what a real head attends to, and its one-line errors."""

from __future__ import annotations

import pytest
import torch

from attnkit.cli import main
from attnkit.explain import head_summary
from attnkit.models import load_minilm
from helpers.pages import page_data

TEXT = "The animal didn't cross the street because it was too tired"


@pytest.fixture(scope="module")
def encoding():
    return load_minilm().encode(TEXT)


def test_every_query_row_lists_its_heaviest_keys(capsys, encoding):
    assert (
        main(["explain", "--model", "minilm", "--text", TEXT, "--layer", "2", "--head", "5"]) == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("all-MiniLM-L6-v2: layer 2 of 0..5, head 5 of 0..11, 15 tokens")
    weights = encoding.attentions[2, 5]
    for i, token in enumerate(encoding.tokens):
        row = next(line for line in out.splitlines() if line.startswith(f"{i} {token} "))
        cells = [c.strip() for c in row.split("  ") if c.strip()]
        best = int(weights[i].argmax())
        assert cells[1] == f"{encoding.tokens[best]} {weights[i, best]:.3f}"
        assert len(cells) == 4  # the query, then its top 3


def test_query_shows_its_whole_row_in_order(capsys, encoding):
    assert main(["explain", "--model", "minilm", "--text", TEXT, "--query", "it"]) == 0
    out = capsys.readouterr().out
    assert "Where 10 'it' attends" in out
    assert "layer 5 of 0..5, head 0 of 0..11" in out  # defaults: the last layer, head 0
    lines = out.splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("key ")) + 2
    rows = [line.split() for line in lines[start : start + 15]]
    values = [float(row[2]) for row in rows]
    assert values == sorted(values, reverse=True)
    assert abs(sum(values) - 1.0) < 0.01
    weights = encoding.attentions[5, 0, 10]
    for row in rows:
        assert float(row[2]) == pytest.approx(weights[int(row[0])].item(), abs=5e-4)


def test_head_summary_counts(encoding):
    summary = head_summary(encoding.attentions[0], encoding.tokens)
    assert len(summary) == 12
    for s in summary:
        assert 0.0 <= s["entropy_bits"] <= s["uniform_bits"] + 1e-9
        assert 0.0 <= s["to_cls"] <= 1.0 and 0.0 <= s["to_sep"] <= 1.0
        assert s["max_weight"] <= 1.0
    first = encoding.attentions[0, 0].double()
    assert summary[0]["to_itself"] == pytest.approx(first.diagonal().mean().item())


@pytest.mark.parametrize(
    "args,message",
    [
        (["--text", "   "], "text is empty"),
        (["--layer", "6"], "--layer must be in 0..5, got 6"),
        (["--head", "12"], "--head must be in 0..11, got 12"),
        (["--head", "-1"], "--head must be in 0..11, got -1"),
        (["--query", "zebra"], "--query 'zebra' is not a token of the text"),
        (["--dim", "4"], "--dim does not apply to --model"),
        (["--causal"], "--causal and --normalize do not apply to --model"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert main(["explain", "--model", "minilm", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_layer_without_model(capsys):
    assert main(["explain", "--layer", "1"]) == 2
    assert "--layer needs --model" in capsys.readouterr().err


def test_model_plots_one_head_or_a_layer_grid_and_writes_the_html_view(tmp_path, encoding):
    import matplotlib.image

    for args, name in ((["--head", "3"], "head.png"), (["--all-heads"], "grid.png")):
        out = tmp_path / name
        assert main(["plot", "--model", "minilm", "--text", TEXT, *args, "-o", str(out)]) == 0
        assert matplotlib.image.imread(out).std() > 0.05
    out = tmp_path / "view.html"
    assert main(["explain", "--model", "minilm", "--text", TEXT, "--html", str(out)]) == 0
    data = page_data(out.read_text())
    assert data["tokens"] == encoding.tokens and data["title"] == f"all-MiniLM-L6-v2: {TEXT}"
    torch.testing.assert_close(
        torch.tensor(data["weights"]), encoding.attentions, atol=1e-4, rtol=0
    )


def test_encoding_renders_in_jupyter(encoding):
    table = encoding._repr_html_()
    assert table.count("<td") == 15 * 15 and "[CLS]" in table and "mean of 12 heads" in table


def test_plot_model_errors(capsys):
    assert main(["plot", "--model", "minilm", "--head", "12", "-o", "x.png"]) == 2
    assert "--head must be in 0..11, got 12" in capsys.readouterr().err
