"""Plain-text walkthroughs of attention, as the chapter presents it: the query's scores, its weights,
its context vector, then the whole weight and context matrices.

Everything here formats what :func:`attnkit.simple_self_attention` computes; nothing is recomputed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from attnkit.textbook import (
    JOURNEY_EMBEDDINGS,
    JOURNEY_TOKENS,
    Normalize,
    simple_self_attention,
)

MAX_COLUMNS = 8  # wider embeddings are cut to their first columns in the tables


@dataclass(frozen=True)
class Example:
    """Tokens and one embedding row per token, ``(t, e)``."""

    tokens: tuple[str, ...]
    embeddings: Tensor

    @classmethod
    def journey(cls) -> Example:
        """The chapter's example, "Your journey starts with one step"."""
        return cls(JOURNEY_TOKENS, torch.tensor(JOURNEY_EMBEDDINGS))

    @classmethod
    def random(cls, text: str, dim: int, seed: int) -> Example:
        """Whitespace tokens with random embeddings in [0, 1); a repeated token keeps its vector."""
        tokens = _split(text)
        if dim < 1:
            raise ValueError(f"--dim must be >= 1, got {dim}")
        vocab = list(dict.fromkeys(tokens))
        generator = torch.Generator().manual_seed(seed)
        table = torch.rand(len(vocab), dim, generator=generator)
        return cls(tokens, table[[vocab.index(tok) for tok in tokens]])

    @classmethod
    def from_json(cls, path: str | Path, text: str | None = None) -> Example:
        """Embeddings from a JSON object ``{token: [numbers]}``; tokens from ``text`` (split on
        whitespace), or the file's own tokens in order when ``text`` is None."""
        path = Path(path)
        try:
            table = json.loads(path.read_text(encoding="utf-8"))
        except OSError as err:
            raise ValueError(f"cannot read embeddings file {path}: {err.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"embeddings file {path} is not valid JSON: {err}") from None
        valid = (
            isinstance(table, dict)
            and table
            and all(
                isinstance(vec, list)
                and vec
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vec)
                for vec in table.values()
            )
        )
        if not valid:
            raise ValueError(
                f"embeddings file {path} must hold a JSON object mapping each token to a "
                "non-empty list of numbers"
            )
        widths = {len(vec) for vec in table.values()}
        if len(widths) > 1:
            raise ValueError(
                f"embeddings in {path} have unequal lengths {sorted(widths)}; all must be equal"
            )
        tokens = tuple(table) if text is None else _split(text)
        missing = [tok for tok in tokens if tok not in table]
        if missing:
            raise ValueError(f"token {missing[0]!r} has no embedding in {path}")
        return cls(tokens, torch.tensor([table[tok] for tok in tokens], dtype=torch.float32))

    def index_of(self, token: str) -> int:
        """Position of the first occurrence of ``token``."""
        if token not in self.tokens:
            raise ValueError(f"query token {token!r} is not in the text {list(self.tokens)}")
        return self.tokens.index(token)


def _split(text: str) -> tuple[str, ...]:
    tokens = tuple(text.split())
    if not tokens:
        raise ValueError("the text is empty: give at least one token")
    return tokens


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell; the first column left-aligned, the others right."""
    cells = [list(header), *map(list, rows)]
    widths = [max(len(row[c]) for row in cells) for c in range(len(header))]

    def line(row: list[str]) -> str:
        first, *rest = row
        parts = [first.ljust(widths[0])] + [c.rjust(w) for c, w in zip(rest, widths[1:])]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *map(line, cells[1:])])


def _numbers(values: Tensor) -> list[str]:
    shown = [f"{x:.4f}" for x in values[:MAX_COLUMNS].tolist()]
    return [*shown, "..."] if values.numel() > MAX_COLUMNS else shown


def _dims(width: int) -> list[str]:
    shown = [f"x{i + 1}" for i in range(min(width, MAX_COLUMNS))]
    return [*shown, "..."] if width > MAX_COLUMNS else shown


def explain(
    example: Example,
    *,
    query_index: int = 1,
    normalize: Normalize = "softmax",
    causal: bool = False,
) -> str:
    """Walk through simplified self-attention for one query, then for every token.

    Args:
        example: the tokens and their embeddings.
        query_index: the position of the query token.
        normalize: ``"softmax"`` or ``"sum"``.
        causal: mask the tokens after each query.

    Returns:
        The walkthrough as text, one table per step.
    """
    tokens, x = example.tokens, example.embeddings
    if not 0 <= query_index < len(tokens):
        raise ValueError(f"--query-index must be in [0, {len(tokens) - 1}], got {query_index}")
    result = simple_self_attention(x, normalize=normalize, causal=causal)
    query = tokens[query_index]
    scores, weights = result.scores[query_index], result.weights[query_index]
    how = "softmax" if normalize == "softmax" else "score / sum of scores"
    mask_note = " (causal: later tokens masked)" if causal else ""
    sections = [
        (
            f"Tokens and their embeddings ({len(tokens)} tokens, {x.shape[1]} dims)",
            format_table(
                ["token", *_dims(x.shape[1])], [[t, *_numbers(r)] for t, r in zip(tokens, x)]
            ),
        ),
        (
            f"Query {query!r} (position {query_index}): scores, dot product with every token, "
            f"and weights, {how}{mask_note}",
            format_table(
                ["token", "score", "weight"],
                [
                    [t, f"{s:.4f}", f"{w:.4f}"]
                    for t, s, w in zip(tokens, scores.tolist(), weights.tolist())
                ]
                + [["sum", "", f"{weights.sum().item():.4f}"]],
            ),
        ),
        (
            f"Context vector for {query!r}: the weighted sum of the embeddings",
            format_table(
                ["", *_dims(x.shape[1])], [[query, *_numbers(result.context[query_index])]]
            ),
        ),
        (
            f"All weights ({len(tokens)} x {len(tokens)}): row = query, column = key",
            format_table(
                ["query \\ key", *tokens],
                [
                    [t, *(f"{w:.4f}" for w in row)]
                    for t, row in zip(tokens, result.weights.tolist())
                ],
            ),
        ),
        (
            f"All context vectors ({len(tokens)} x {x.shape[1]})",
            format_table(
                ["token", *_dims(x.shape[1])],
                [[t, *_numbers(r)] for t, r in zip(tokens, result.context)],
            ),
        ),
    ]
    return "\n\n".join(f"{title}\n\n{table}" for title, table in sections) + "\n"
