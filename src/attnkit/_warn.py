"""Warnings that point at the user's code, not at the attnkit line that noticed the problem."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

_INSIDE = (str(Path(__file__).parent), str(Path(torch.__file__).parent))


def _inside(filename: str) -> bool:
    """Whether a frame belongs to attnkit or torch (whose nn.Module.__call__ runs attnkit's
    modules), or to Python's own machinery (``<frozen importlib...>``)."""
    return filename.startswith(("<", *_INSIDE))


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message)`` attributed to the first frame outside attnkit and torch, so that
    the one line Python shows under the message is the user's call."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and _inside(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
