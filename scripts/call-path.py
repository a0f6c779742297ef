"""How many attnkit functions, in how many files, one call enters (issue 44's measure): counted
with ``sys.setprofile`` after a warm-up call. Usage: ``python scripts/call-path.py [--list]``."""

from __future__ import annotations

import itertools
import sys
from collections import Counter

import torch

import attnkit
from attnkit import MultiHeadAttention, attention

ROOT = attnkit.__file__.rsplit("/", 1)[0]


def entered(fn) -> list[tuple[str, str]]:
    """The (file, function) of each attnkit Python function ``fn()`` enters, in order."""
    seen = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(ROOT):
            seen.append((frame.f_code.co_filename[len(ROOT) + 1 :], frame.f_code.co_qualname))

    fn()  # the warm-up
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def report(name: str, fn, show: bool) -> None:
    calls = entered(fn)
    files = [f for f, _ in calls]
    switches = sum(a != b for a, b in itertools.pairwise(files))
    print(f"{name}: {len(calls)} functions in {len(set(files))} files, {switches} switches")
    if show:
        for (f, q), n in Counter(calls).items():
            print(f"  {n:3d}  {f}: {q}")


def main() -> None:
    show = "--list" in sys.argv
    torch.manual_seed(0)
    mha = MultiHeadAttention(256, 256, 128, 0.0, 8).to(torch.bfloat16).train()
    x = torch.randn(2, 128, 256, dtype=torch.bfloat16)
    report(
        "bf16 training forward of MultiHeadAttention (2 x 128 x 256, 8 heads)", lambda: mha(x), show
    )
    q = torch.randn(1, 4, 32, 32)
    report("small attention() call (1, 4, 32, 32) fp32", lambda: attention(q, q, q), show)


if __name__ == "__main__":
    main()
