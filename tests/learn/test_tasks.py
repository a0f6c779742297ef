"""The tasks' data: the copy task's repeated segment, the text's tokenizer, split and entropy,
and the probes."""

from __future__ import annotations

import math
import re

import pytest
import torch

from attnkit.learn.tasks import (
    MIN_SEGMENT,
    CharTokenizer,
    TextData,
    copy_batch,
    make_task,
    read_text,
    repeated_probes,
)


def segment_of(tokens: torch.Tensor, copied: torch.Tensor) -> tuple[int, int, int]:
    """``(first, second, n)``: where the copy's two occurrences start, and its length."""
    where = copied.nonzero().flatten().tolist()
    second, n = where[0] - 1, len(where) + 1
    matches = [
        f
        for f in range(second - n + 1)
        if torch.equal(tokens[f : f + n], tokens[second : second + n])
    ]
    return matches[0], second, n


def test_each_copy_sequence_repeats_one_segment_once_at_varying_places():
    generator = torch.Generator().manual_seed(0)
    tokens, copied = copy_batch(200, 33, 64, generator)
    assert tokens.shape == copied.shape == (200, 33)
    assert tokens.min() >= 0 and tokens.max() < 64
    found = [segment_of(tokens[i], copied[i]) for i in range(200)]
    for (first, second, n), row in zip(found, copied):
        assert MIN_SEGMENT <= n <= 33 // 2
        assert first + n <= second  # the occurrences do not overlap
        assert row.sum() == n - 1 and row[second + 1 : second + n].all()  # all but the first token
    lengths = {n for _, _, n in found}
    offsets = {second - first for first, second, _ in found}
    assert len(lengths) >= 8 and len(offsets) >= 10  # no fixed length or offset predicts the copy
    assert len({first for first, _, _ in found}) >= 10


def test_copy_batches_follow_their_generator():
    a = copy_batch(4, 20, 64, torch.Generator().manual_seed(5))
    b = copy_batch(4, 20, 64, torch.Generator().manual_seed(5))
    c = copy_batch(4, 20, 64, torch.Generator().manual_seed(6))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_the_copy_task_needs_room_for_two_segments():
    with pytest.raises(ValueError, match="--context >= 8, got 5"):
        copy_batch(1, 6, 64, torch.Generator())


def test_repeated_probes_are_distinct_tokens_written_twice():
    probes = repeated_probes(5, 10, 64, torch.Generator().manual_seed(1))
    assert probes.shape == (5, 20)
    assert torch.equal(probes[:, :10], probes[:, 10:])
    assert all(len(set(row[:10].tolist())) == 10 for row in probes)


def test_the_tokenizer_round_trips_characters():
    tokenizer = CharTokenizer.of("hello, world")
    assert tokenizer.vocab_size == len(set("hello, world"))
    assert "".join(tokenizer.decode(tokenizer.encode("low, hello"))) == "low, hello"


def test_python_ships_the_default_text():
    text = read_text(None)
    assert len(text) > 100_000 and "statement" in text


def test_the_text_split_keeps_a_held_out_tenth_and_its_unigram_entropy():
    text = "ab" * 300 + "abcd" * 50
    data = TextData.of(text, 16)
    assert len(data.train) + len(data.held_out) == len(text)
    assert len(data.held_out) == len(text) // 10
    counts = torch.bincount(data.train, minlength=4).float()
    p = counts[counts > 0] / counts.sum()
    assert data.unigram_entropy() == pytest.approx(-(p * p.log()).sum().item())
    assert 0 < data.unigram_entropy() <= math.log(4)


def test_a_text_shorter_than_two_contexts_is_refused():
    with pytest.raises(ValueError, match=r"too short for --context 64"):
        TextData.of("x" * 100, 64)


@pytest.mark.parametrize(
    "content, message",
    [(None, "no such file"), ("", "the file is empty"), ("  \n", "the file is empty")],
)
def test_a_missing_or_empty_file_is_named(tmp_path, content, message):
    path = tmp_path / "t.txt"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=re.escape(f"--text {path}: {message}")):
        read_text(path)


def test_tasks_hold_probes_of_the_context_and_a_labelled_sequence_to_draw(tmp_path):
    copy = make_task("copy", None, 16, seed=1)
    assert copy.probes.shape == (16, 17) and copy.repeated.shape == (16, 16)
    assert copy.shown.shape == (1, 16) and len(copy.labels) == 16
    assert torch.equal(copy.shown[0, :8], copy.shown[0, 8:16])
    longer = make_task("copy", None, 40, seed=1)
    assert longer.shown.shape == (1, 40) and len(longer.labels) == 16
    path = tmp_path / "t.txt"
    path.write_text("the cat sat on the mat\n" * 20)
    text = make_task("text", path, 16, seed=1)
    assert text.vocab_size == len(set("the cat sat on the mat\n"))
    assert "␣" in text.labels or "↵" in text.labels  # spaces made visible
    tokens, copied = text.batch(3, torch.Generator())
    assert tokens.shape == (3, 17) and copied is None
