"""What the GPT learns from: English text read character by character, or the copy task.

- **text**: the help topics that ship inside CPython's standard library (``pydoc_data.topics``,
  about 0.5 MB of English on every Python), or a UTF-8 file of your own. The tokenizer is the
  text's characters: token ``i`` is the ``i``-th distinct character in sorted order, nothing to
  download. The last tenth of the text is held out: the probes come from it.
- **copy**: random tokens in which one segment is written twice. The segment's length and both of
  its positions vary from sequence to sequence, so no fixed offset predicts the copy: only finding
  where the current token occurred before, and reading the token that followed it there, does.
  That is what an induction head does.

Shapes: ``b`` batch, ``t`` tokens (``context_length``).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

HELD_OUT = 0.1  # the share of the text kept for the probes
COPY_VOCAB = 64  # tokens of the copy task: ln 64 = 4.16 nats for an unpredictable one
MIN_SEGMENT = 4  # the shortest repeated segment of the copy task


@dataclass(frozen=True)
class CharTokenizer:
    """Each distinct character of a text is one token."""

    chars: tuple[str, ...]

    @classmethod
    def of(cls, text: str) -> CharTokenizer:
        return cls(tuple(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> Tensor:
        index = {c: i for i, c in enumerate(self.chars)}
        return torch.tensor([index[c] for c in text], dtype=torch.long)

    def decode(self, ids: Tensor | list[int]) -> list[str]:
        """One string per token."""
        return [self.chars[i] for i in (ids.tolist() if isinstance(ids, Tensor) else ids)]


def read_text(path: str | Path | None) -> str:
    """The file's text (UTF-8), or CPython's help topics when ``path`` is None."""
    if path is None:
        from pydoc_data.topics import topics

        return "\n\n".join(topics[name] for name in sorted(topics))
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"--text {path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"--text {path}: is a directory, not a text file") from None
    except UnicodeDecodeError as err:
        raise ValueError(
            f"--text {path}: not UTF-8 text ({err.reason} at byte {err.start})"
        ) from None
    if not text.strip():
        raise ValueError(f"--text {path}: the file is empty")
    return text


@dataclass(frozen=True)
class TextData:
    """A text split into training tokens and held-out tokens."""

    tokenizer: CharTokenizer
    train: Tensor  # (n_train,)
    held_out: Tensor  # (n_held_out,)

    @classmethod
    def of(cls, text: str, context_length: int) -> TextData:
        tokenizer = CharTokenizer.of(text)
        ids = tokenizer.encode(text)
        split = len(ids) - max(context_length + 1, int(len(ids) * HELD_OUT))
        if split < context_length + 1:
            raise ValueError(
                f"the text has {len(ids)} characters: too short for --context {context_length} "
                f"(it needs at least {2 * (context_length + 1)}, half of them held out)"
            )
        return cls(tokenizer, ids[:split], ids[split:])

    def unigram_entropy(self) -> float:
        """The entropy of the training text's characters, in nats: the loss of a model that knows
        each character's frequency and nothing else."""
        counts = Counter(self.train.tolist())
        n = len(self.train)
        return -sum(c / n * math.log(c / n) for c in counts.values())

    def batch(self, batch_size: int, context_length: int, generator: torch.Generator) -> Tensor:
        """``(b, t + 1)`` windows of the training text at random places."""
        return _windows(self.train, batch_size, context_length + 1, generator)

    def probes(self, count: int, context_length: int, generator: torch.Generator) -> Tensor:
        """``(count, t)`` windows of the held-out text."""
        return _windows(self.held_out, count, context_length, generator)


def _windows(ids: Tensor, count: int, length: int, generator: torch.Generator) -> Tensor:
    starts = torch.randint(0, len(ids) - length + 1, (count,), generator=generator)
    return torch.stack([ids[s : s + length] for s in starts.tolist()])  # (count, length)


def copy_batch(
    batch_size: int, length: int, vocab_size: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Random tokens with one segment written twice, its length and positions random.

    Returns:
        ``tokens`` ``(b, length)`` and ``copied`` ``(b, length)``, True at the tokens of the second
        occurrence that its first one predicts: all of it but its first token (what comes after
        a random token is not predictable, even inside a copy).
    """
    if length < 2 * MIN_SEGMENT + 1:
        raise ValueError(f"the copy task needs --context >= {2 * MIN_SEGMENT}, got {length - 1}")
    tokens = torch.randint(0, vocab_size, (batch_size, length), generator=generator)
    copied = torch.zeros(batch_size, length, dtype=torch.bool)
    longest = length // 2  # room for both occurrences
    for row in range(batch_size):
        n = _randint(MIN_SEGMENT, max(MIN_SEGMENT, longest), generator)
        first = _randint(0, length - 2 * n, generator)
        second = _randint(first + n, length - n, generator)
        tokens[row, second : second + n] = tokens[row, first : first + n]
        copied[row, second + 1 : second + n] = True
    return tokens, copied


def _randint(low: int, high: int, generator: torch.Generator) -> int:
    """A uniform int in ``[low, high]``."""
    return int(torch.randint(low, high + 1, (1,), generator=generator))


def repeated_probes(count: int, half: int, vocab_size: int, generator: torch.Generator) -> Tensor:
    """``(count, 2 * half)``: ``half`` distinct random tokens, then the same again: the sequences
    on which an induction head's score is read."""
    if half > vocab_size:
        raise ValueError(f"{half} distinct tokens asked of a vocabulary of {vocab_size}")
    firsts = torch.stack(
        [torch.randperm(vocab_size, generator=generator)[:half] for _ in range(count)]
    )
    return torch.cat([firsts, firsts], dim=1)  # (count, half) -> (count, 2 * half)


PROBES = 16  # held-out sequences that each snapshot reads the heads on
SHOWN = 16  # tokens of the sequence drawn in the pictures (the copy task: 8, twice)


@dataclass(frozen=True)
class Task:
    """A task's data: training batches on demand, and fixed held-out probes.

    ``probes`` ``(p, t + 1)``: held-out sequences (the first ``t`` tokens are read, each next
    token scored); ``repeated`` ``(p, 2n)``: random tokens written twice, for the induction score;
    ``shown`` ``(1, t)``: a sequence whose first ``len(labels)`` tokens the pictures draw.
    """

    name: str
    vocab_size: int
    context_length: int
    probes: Tensor
    repeated: Tensor
    shown: Tensor
    labels: tuple[str, ...]
    text: TextData | None = None

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor | None]:
        """``(b, t + 1)`` training tokens and, for the copy task, which ones are copies."""
        if self.text is not None:
            return self.text.batch(batch_size, self.context_length, generator), None
        return copy_batch(batch_size, self.context_length + 1, self.vocab_size, generator)

    def unigram_entropy(self) -> float | None:
        return None if self.text is None else self.text.unigram_entropy()


def make_task(name: str, text_path: str | Path | None, context_length: int, seed: int) -> Task:
    """The task ``"text"`` (of ``text_path``, or CPython's help topics) or ``"copy"``."""
    probes = torch.Generator().manual_seed(seed + 2)  # apart from the weights' and the batches'
    if name == "copy":
        vocab_size = COPY_VOCAB
        tokens, _ = copy_batch(PROBES, context_length + 1, vocab_size, probes)
        drawn = repeated_probes(1, min(SHOWN // 2, context_length // 2), vocab_size, probes)
        rest = torch.randint(0, vocab_size, (1, context_length - drawn.shape[1]), generator=probes)
        shown = torch.cat([drawn, rest], dim=1)  # 8 tokens twice, then random ones: (1, t)
        labels = tuple(str(i) for i in drawn[0].tolist())
        text = None
    else:
        text = TextData.of(read_text(text_path), context_length)
        vocab_size = text.tokenizer.vocab_size
        tokens = text.probes(PROBES, context_length + 1, probes)
        shown = text.probes(1, context_length, probes)
        labels = tuple(_visible(c) for c in text.tokenizer.decode(shown[0, :SHOWN]))
    half = min(context_length // 2, vocab_size)
    repeated = repeated_probes(PROBES, half, vocab_size, probes)
    return Task(name, vocab_size, context_length, tokens, repeated, shown, labels, text)


def _visible(char: str) -> str:
    """A character as a label: spaces and line breaks made visible."""
    return {" ": "␣", "\n": "↵", "\t": "⇥"}.get(char, char)
