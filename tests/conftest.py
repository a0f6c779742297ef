"""Shared fixtures: a fixed seed for every test and a quick hypothesis profile."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from attnkit.backends import tiled

# Small example counts keep `make test` quick on a 2-core machine; ATTNKIT_HYPOTHESIS=thorough for more.
settings.register_profile(
    "quick", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=400, deadline=None)
settings.load_profile(os.environ.get("ATTNKIT_HYPOTHESIS", "quick"))

DATA = Path(__file__).parent / "data"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny tiles, so that the tests' small shapes span many blocks of the tiled kernel, with
    lengths that do not divide the block sizes (the production sizes are 256 and 512)."""
    monkeypatch.setattr(tiled, "BLOCK_Q", 5)
    monkeypatch.setattr(tiled, "BLOCK_K", 7)


@pytest.fixture
def pytorch_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiled backend without its C++ kernel: the PyTorch loop of tiled_loop.py runs."""
    monkeypatch.setattr(tiled, "_native_kernel", lambda device, dtype: None)


@pytest.fixture
def backend(request, monkeypatch) -> str:
    """The backend to name, from a parameter that may name a path inside one: "tiled:loop" forces
    the tiled backend's PyTorch loop, "tiled:half" its half-precision products (those of CPUs
    with AVX512-BF16 or AMX), so that every path is checked on any CPU."""
    name = request.param
    if name == "tiled:loop":
        monkeypatch.setattr(tiled, "_native_kernel", lambda device, dtype: None)
    elif name == "tiled:half":
        monkeypatch.setattr(tiled, "_fast_half_matmul", lambda dtype, device: True)
    return name.split(":")[0]


@pytest.fixture(scope="session")
def golden() -> dict:
    """The textbook's worked examples (a copy of shared/golden/textbook.json, checked below)."""
    return json.loads((DATA / "textbook.json").read_text())
