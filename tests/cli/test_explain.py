"""``attnkit explain``, run in-process: the chapter's example, your own text and embeddings, and
the inputs it refuses."""

from __future__ import annotations

import json

import pytest
import torch

from attnkit import simple_self_attention
from attnkit.cli import main
from attnkit.textbook import JOURNEY_EMBEDDINGS, JOURNEY_TOKENS
from helpers.pages import page_data


def test_explain_default_is_the_chapter_example(capsys):
    assert main(["explain"]) == 0
    out = capsys.readouterr().out
    assert "Query 'journey'" in out
    assert "0.4419  0.6515  0.5683" in out


def test_explain_query_and_normalize(capsys):
    assert main(["explain", "--query", "step", "--normalize", "sum"]) == 0
    out = capsys.readouterr().out
    assert "Query 'step' (position 5)" in out and "score / sum of scores" in out
    assert main(["explain", "--query-index", "0", "--causal"]) == 0
    out = capsys.readouterr().out
    assert "Query 'Your' (position 0)" in out and "causal" in out


def test_explain_own_text_with_embeddings_file(tmp_path, capsys):
    path = tmp_path / "emb.json"
    path.write_text(json.dumps({"hello": [1.0, 0.0], "world": [0.0, 1.0]}))
    assert main(["explain", "--text", "hello world", "--embeddings", str(path)]) == 0
    assert "Query 'world' (position 1)" in capsys.readouterr().out


def test_explain_random_embeddings(capsys):
    assert main(["explain", "--text", "a b c", "--dim", "5", "--seed", "1"]) == 0
    assert "(3 tokens, 5 dims)" in capsys.readouterr().out


def test_bad_embeddings_file_content(tmp_path, capsys):
    path = tmp_path / "emb.json"
    path.write_text('{"a": [1, 2], "b": [3]}')
    assert main(["explain", "--text", "a b", "--embeddings", str(path)]) == 2
    assert "unequal lengths" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"a": [NaN, 1], "b": [1, 2]}', "not a finite float32 number"),
        ('{"a": [Infinity, 1], "b": [1, 2]}', "not a finite float32 number"),
        ('{"a": [1e39, 1], "b": [1, 2]}', "not a finite float32 number"),  # overflows float32
        ('{"a": [1' + "0" * 400 + ', 1], "b": [1, 2]}', "not a finite float32 number"),
        ('{"a": [1e30, 1], "b": [1, 2]}', "dot products overflow float32"),
    ],
)
def test_embeddings_that_would_give_nan_tables_are_refused(tmp_path, capsys, content, message):
    path = tmp_path / "emb.json"
    path.write_text(content)
    assert main(["explain", "--embeddings", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err and "nan" not in captured.err


def test_explain_html_for_the_chapter_example(tmp_path, capsys):
    out = tmp_path / "journey.html"
    assert main(["explain", "--html", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    data = page_data(out.read_text())
    assert data["tokens"] == list(JOURNEY_TOKENS)
    expected = simple_self_attention(torch.tensor(JOURNEY_EMBEDDINGS)).weights
    torch.testing.assert_close(torch.tensor(data["weights"][0][0]), expected, atol=1e-5, rtol=0)
