"""The ``attnkit`` command.

``attnkit explain`` walks through attention on the chapter's example or on your own text. Bad input
prints one line, ``attnkit: error: ...``, and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from attnkit import __version__
from attnkit.explain import Example, explain


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (no usage dump), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"attnkit: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="attnkit",
        description="Attention mechanisms on PyTorch: see them work, step by step.",
    )
    parser.add_argument("--version", action="version", version=f"attnkit {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    ex = commands.add_parser(
        "explain",
        help="walk through self-attention: scores, weights, context",
        description=(
            "Walk through simplified self-attention (scores = x x^T, weights = softmax, "
            "context = weights x) on the chapter's example 'Your journey starts with one step', "
            "or on your own text."
        ),
    )
    ex.add_argument("--text", help="your own text, split on whitespace")
    source = ex.add_mutually_exclusive_group()
    source.add_argument(
        "--embeddings", metavar="FILE.json", help="JSON object mapping each token to its vector"
    )
    source.add_argument(
        "--dim", type=int, help="width of the random embeddings for --text (default 3)"
    )
    ex.add_argument("--seed", type=int, default=123, help="seed of the random embeddings")
    query = ex.add_mutually_exclusive_group()
    query.add_argument("--query", metavar="TOKEN", help="the query token (its first occurrence)")
    query.add_argument("--query-index", type=int, metavar="I", help="the query's position")
    ex.add_argument("--normalize", choices=["softmax", "sum"], default="softmax")
    ex.add_argument("--causal", action="store_true", help="each token sees only earlier ones")
    ex.set_defaults(run=_run_explain)
    return parser


def _run_explain(args: argparse.Namespace) -> int:
    if args.embeddings is not None:
        example = Example.from_json(args.embeddings, args.text)
    elif args.text is not None:
        example = Example.random(args.text, 3 if args.dim is None else args.dim, args.seed)
    elif args.dim is not None:
        raise ValueError("--dim gives random embeddings for --text; add --text")
    else:
        example = Example.journey()

    if args.query is not None:
        query_index = example.index_of(args.query)
    elif args.query_index is not None:
        query_index = args.query_index
    else:
        query_index = min(1, len(example.tokens) - 1)  # the chapter's query is the second token
    print(
        explain(example, query_index=query_index, normalize=args.normalize, causal=args.causal),
        end="",
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (0 ok, 2 bad input)."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, OSError) as err:
        print(f"attnkit: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
