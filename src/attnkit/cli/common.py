"""What the commands share: the checks of an output path and of counts, and a model's encoding."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from attnkit.textbook import JOURNEY_TOKENS


def check_output(path: str, suffix: str) -> Path:
    """Fail before any work when ``path`` cannot be written."""
    target = Path(path)
    if target.suffix.lower() != suffix:
        raise ValueError(f"{path}: the output must be a {suffix} file")
    check_folder(target.parent, path)
    if target.exists() and not os.access(target, os.W_OK):
        raise ValueError(f"cannot write {path}: permission denied")
    return target


def check_folder(folder: Path, given: str) -> Path:
    """Fail before any work when the existing folder ``folder`` cannot take new files."""
    resolved = folder.resolve()
    if not resolved.is_dir():
        raise ValueError(f"cannot write {given}: {resolved} is not a directory")
    if not os.access(resolved, os.W_OK):
        raise ValueError(f"cannot write {given}: permission denied")
    return resolved


def check_counts(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    for name in names:
        values = getattr(args, name)
        for value in values if isinstance(values, list) else [values]:
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def model_encoding(args: argparse.Namespace):
    from attnkit.models import load_minilm

    text = " ".join(JOURNEY_TOKENS) if args.text is None else args.text
    return load_minilm().encode(text)
