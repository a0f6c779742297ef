"""The plain-text walkthrough and its example sources."""

from __future__ import annotations

import json

import pytest
import torch

from attnkit.explain import Example, explain, format_table


def test_journey_walkthrough_prints_the_chapter_numbers():
    text = explain(Example.journey())
    for number in ("0.9544", "1.4950", "0.1385", "0.2379", "0.4419", "0.6515", "0.5683"):
        assert number in text
    assert "Query 'journey' (position 1)" in text
    assert "sum              1.0000" in text
    assert "All weights (6 x 6)" in text and "All context vectors (6 x 3)" in text


def test_random_embeddings_are_seeded_and_shared_by_repeated_tokens():
    a = Example.random("the cat saw the dog", dim=4, seed=7)
    assert a.tokens == ("the", "cat", "saw", "the", "dog")
    assert torch.equal(a.embeddings[0], a.embeddings[3])
    assert torch.equal(a.embeddings, Example.random("the cat saw the dog", 4, 7).embeddings)
    assert not torch.equal(a.embeddings, Example.random("the cat saw the dog", 4, 8).embeddings)


def test_embeddings_from_json(tmp_path):
    path = tmp_path / "emb.json"
    path.write_text(json.dumps({"a": [1, 0], "b": [0, 1]}))
    example = Example.from_json(path, "b a b")
    assert example.tokens == ("b", "a", "b")
    assert example.embeddings.tolist() == [[0, 1], [1, 0], [0, 1]]
    assert Example.from_json(path).tokens == ("a", "b")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "must hold a JSON object mapping each token"),
        ('{"a": [1, 2], "b": [1]}', r"unequal lengths \[1, 2\]"),
        ('{"a": []}', "non-empty list of numbers"),
        ('{"a": ["x"]}', "non-empty list of numbers"),
    ],
)
def test_bad_embeddings_files(tmp_path, content, message):
    path = tmp_path / "emb.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        Example.from_json(path, "a")


def test_missing_file_and_unknown_token(tmp_path):
    with pytest.raises(ValueError, match="cannot read embeddings file"):
        Example.from_json(tmp_path / "nope.json", "a")
    path = tmp_path / "emb.json"
    path.write_text('{"a": [1.0]}')
    with pytest.raises(ValueError, match="token 'zebra' has no embedding in"):
        Example.from_json(path, "a zebra")
    with pytest.raises(ValueError, match="query token 'b' is not in the text"):
        Example.from_json(path, "a").index_of("b")


def test_format_table_aligns_columns():
    table = format_table(["name", "x"], [["a", "1.0"], ["bbb", "22.0"]])
    assert table.splitlines() == ["name     x", "----  ----", "a      1.0", "bbb   22.0"]


def test_wide_embeddings_are_cut():
    text = explain(Example.random("a b", dim=20, seed=0), query_index=0)
    assert "x8  ..." in text and "x9" not in text
