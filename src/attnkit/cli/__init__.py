"""The ``attnkit`` command: one file per subcommand (``explain``, ``plot``, ``learn``, ``build``,
``bench``, ``memory``).

``attnkit explain`` walks through attention on the chapter's example or on your own text;
``attnkit learn`` trains a small GPT and watches its heads specialise;
``attnkit build`` builds the C++ kernels for this CPU ahead of use;
``attnkit memory`` says how much a model's cache holds. Bad input prints one line,
``attnkit: error: ...``, and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from attnkit import __version__
from attnkit.cli import bench, build, explain, learn, memory, plot


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
    for command in (explain, plot, learn, build, bench, memory):
        command.add(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (0 ok, 2 bad input)."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, OSError, ImportError) as err:
        print(f"attnkit: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
