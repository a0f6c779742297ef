"""Plain-text walkthroughs of attention, as the chapter presents it: the query's scores, its weights,
its context vector, then the whole weight and context matrices.

Everything here formats what [`attnkit.simple_self_attention`][attnkit.textbook.simple_self_attention] computes; nothing is recomputed.
[`explain_model`][attnkit.explain.explain_model] does the same for a real model's weights ([`attnkit.models`][attnkit.models]): where each
token of one head attends, and a summary of every head of a layer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attnkit.textbook import (
    JOURNEY_EMBEDDINGS,
    JOURNEY_TOKENS,
    Normalize,
    simple_self_attention,
)

if TYPE_CHECKING:
    from attnkit.models import Encoding

MAX_COLUMNS = 8  # wider embeddings are cut to their first columns in the tables
MAX_DIM = 4096  # random embeddings wider than this serve no walkthrough, and cost memory


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
        if not 1 <= dim <= MAX_DIM:
            raise ValueError(
                f"--dim must be between 1 and {MAX_DIM} (a walkthrough to read), got {dim}"
            )
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
        for token, vec in table.items():
            if not all(_fits_float32(x) for x in vec):
                raise ValueError(
                    f"the embedding of {token!r} in {path} holds a value that is not a finite "
                    f"float32 number (NaN, Infinity, or beyond ±{_FLOAT32_MAX:.4g})"
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


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _fits_float32(x: float) -> bool:
    try:
        return abs(float(x)) <= _FLOAT32_MAX  # False for NaN; OverflowError for a huge int
    except OverflowError:
        return False


def _split(text: str) -> tuple[str, ...]:
    tokens = tuple(text.split())
    if not tokens:
        raise ValueError("the text is empty: give at least one token")
    return tokens


def format_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], left: frozenset[int] = frozenset({0})
) -> str:
    """Columns padded to their widest cell; the columns in ``left`` left-aligned, the others right."""
    cells = [list(header), *map(list, rows)]
    widths = [max(len(row[c]) for row in cells) for c in range(len(header))]

    def line(row: list[str]) -> str:
        parts = [
            cell.ljust(w) if c in left else cell.rjust(w)
            for c, (cell, w) in enumerate(zip(row, widths))
        ]
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
    if not torch.isfinite(result.scores).all():
        raise ValueError(
            f"the embeddings' dot products overflow float32 (largest |value| "
            f"{x.abs().max().item():.3g}): scale the embeddings down"
        )
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


def head_summary(attentions: Tensor, tokens: Sequence[str]) -> list[dict[str, float]]:
    """Per head of one layer's weights ``(h, t, t)``: the mean entropy of its rows in bits, the mean
    weight on ``[CLS]``, on ``[SEP]`` and on the query itself, and its largest weight."""
    t = attentions.shape[-1]
    rows = attentions.double()
    entropy = -(rows * torch.log2(rows.clamp_min(1e-30))).sum(dim=-1).mean(dim=-1)  # (h,)
    special = {
        name: rows[..., [i for i, tok in enumerate(tokens) if tok == name]].sum(-1).mean(-1)
        for name in ("[CLS]", "[SEP]")
    }
    itself = rows.diagonal(dim1=-2, dim2=-1).mean(dim=-1)
    return [
        {
            "entropy_bits": entropy[i].item(),
            "to_cls": special["[CLS]"][i].item(),
            "to_sep": special["[SEP]"][i].item(),
            "to_itself": itself[i].item(),
            "max_weight": rows[i].max().item(),
            "uniform_bits": math.log2(t),
        }
        for i in range(rows.shape[0])
    ]


def layer_and_head(encoding: Encoding, layer: int | None, head: int) -> int:
    """Check ``layer`` (None: the last) and ``head`` against the model; returns the layer.

    Raises:
        ValueError: either is out of range, naming the option as the CLI spells it.
    """
    num_layers, num_heads = encoding.attentions.shape[:2]
    layer = num_layers - 1 if layer is None else layer
    for value, label, count in ((layer, "layer", num_layers), (head, "head", num_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
            raise ValueError(f"--{label} must be in 0..{count - 1}, got {value}")
    return layer


def explain_model(
    encoding: Encoding,
    *,
    layer: int | None = None,
    head: int = 0,
    query: str | None = None,
    top: int = 3,
    name: str = "all-MiniLM-L6-v2",
) -> str:
    """What one head of a real model attends to: for each query token the ``top`` keys with the
    largest weights (or, for ``query``, its whole row, heaviest first); then a summary of every
    head of the layer.

    ``layer`` and ``head`` count from 0; ``layer`` defaults to the last.

    Raises:
        ValueError: ``layer`` or ``head`` out of range, or ``query`` not among the tokens.
    """
    num_layers, num_heads, t, _ = encoding.attentions.shape
    layer = layer_and_head(encoding, layer, head)
    tokens = encoding.tokens
    weights = encoding.attentions[layer, head]  # (t, t): query rows, key columns
    if query is not None and query not in tokens:
        raise ValueError(f"--query {query!r} is not a token of the text; its tokens: {tokens}")
    lines = [
        f"{name}: layer {layer} of 0..{num_layers - 1}, head {head} of 0..{num_heads - 1}, "
        f"{t} tokens",
        "",
    ]
    if query is not None:  # one query: its whole row, heaviest first, with a bar per weight
        i = tokens.index(query)
        lines += [f"Where {i} {query!r} attends (this head; the weights sum to 1):", ""]
        order = torch.argsort(weights[i], descending=True).tolist()
        rows = [
            [f"{j} {tokens[j]}", f"{weights[i, j]:.3f}", "#" * round(40 * weights[i, j].item())]
            for j in order
        ]
        header, left = ["key", "weight", ""], frozenset({0, 2})
    else:
        top = min(top, t)
        lines += ["Where each query token attends most (this head; each row sums to 1):", ""]
        rows = []
        for i in range(t):
            best = torch.topk(weights[i], top)
            pairs = zip(best.values.tolist(), best.indices.tolist())
            rows.append([f"{i} {tokens[i]}", *[f"{tokens[j]} {w:.3f}" for w, j in pairs]])
        header, left = ["query", *[f"#{r + 1}" for r in range(top)]], frozenset({0})
    lines += [format_table(header, rows, left), "", f"Every head of layer {layer}:", ""]
    summary = head_summary(encoding.attentions[layer], tokens)
    rows = [
        [
            str(i),
            f"{s['entropy_bits']:.2f}",
            f"{s['to_cls']:.3f}",
            f"{s['to_sep']:.3f}",
            f"{s['to_itself']:.3f}",
            f"{s['max_weight']:.3f}",
        ]
        for i, s in enumerate(summary)
    ]
    header = ["head", "entropy (bits)", "to [CLS]", "to [SEP]", "to itself", "max weight"]
    lines += [
        format_table(header, rows),
        "",
        f"Entropy: 0 bits is one key, {math.log2(t):.2f} bits spreads evenly over all {t}; the "
        "'to' columns are mean weights over the queries.",
    ]
    return "\n".join(lines) + "\n"
