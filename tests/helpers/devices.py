"""The devices and backend paths a test runs on: the CUDA case of a device parameter, a path of
a backend forced, and what which_backend then reports."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from attnkit import force
from attnkit.tiled import plans as tiled_plans

CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ],
)
"""The CUDA case of a test that takes a device: marked ``gpu`` (``make test-gpu`` runs those)."""


@contextlib.contextmanager
def forced_path(path: str) -> Iterator[str]:
    """The backend's name in ``path`` (``"tiled"``, or ``"tiled:loop"`` and the other paths of
    attnkit.force, or ``"sdpa:blind"`` for force.blind), with that path forced inside:
    every path is checked on any CPU."""
    name, _, inside = path.partition(":")
    if inside == "blind":  # the backend as on a GPU: no look at the data from Python
        context = force.blind()
    else:
        context = force.forced(path) if inside else contextlib.nullcontext()
    with context:
        yield name


def expected_products(path: str) -> tuple[str, str]:
    """``(path, products)`` that which_backend reports for bf16 inputs on a forced ``path`` (one of
    the half-precision ones), on this CPU's build."""
    if path == "tiled:half-loop":
        return "loop", "bfloat16"
    if path == "tiled:portable":
        return "native", "bf16-portable"
    built = "avx512_bf16" if tiled_plans.KERNEL.has_avx512_bf16() else "portable"
    return "native", f"bf16-{built}"
