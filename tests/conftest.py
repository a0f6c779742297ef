"""Shared fixtures: a fixed seed for every test and a quick hypothesis profile."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from attnkit import force
from attnkit.kernels import cpu as _cpu
from helpers.devices import CUDA, forced_path

# Small example counts keep `make test` quick on a 2-core machine; ATTNKIT_HYPOTHESIS=thorough for more.
settings.register_profile(
    "quick", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=400, deadline=None)
settings.load_profile(os.environ.get("ATTNKIT_HYPOTHESIS", "quick"))

DATA = Path(__file__).parent / "data"


@pytest.fixture(params=["cpu", CUDA])
def device(request) -> torch.device:
    """The device a test's tensors live on: the CPU always, a CUDA device where one is present."""
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _small_tiles() -> Iterator[None]:
    """Tiny tiles, so that the tests' small shapes span many blocks of the tiled kernel, with
    lengths that do not divide the block sizes (the production sizes are 256 and 512), and many
    tiles of a score_mod's bias: 2 key blocks when b * h = 8 (tile_bytes // (4 b h rows))."""
    with force.blocks(5, 7, tile_bytes=4 * 8 * 5 * 14):
        yield


@pytest.fixture
def tiled_blocks() -> Iterator[Callable[..., None]]:
    """``tiled_blocks(block_q, block_k, tile_bytes=None)``: the tiled backend's sizes for the
    rest of the test (`attnkit.force.blocks`)."""
    with contextlib.ExitStack() as stack:
        yield lambda *sizes, **named: stack.enter_context(force.blocks(*sizes, **named))


@pytest.fixture
def every_extension(monkeypatch):
    """A CPU that has every extension attnkit knows (the probe's cache is emptied before and after),
    so that the narrowing tests check something on any CPU."""
    _cpu.features_of.cache_clear()
    monkeypatch.setattr(_cpu, "detected", lambda: _cpu.KNOWN)
    yield
    _cpu.features_of.cache_clear()


@pytest.fixture
def pytorch_loop():
    """The tiled backend without its C++ kernel: the PyTorch loop of tiled/loop.py runs."""
    with force.forced("tiled:loop"):
        yield


@pytest.fixture
def forcing() -> Iterator:
    """``forcing(path) -> backend name``: ``path`` forced until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda path: stack.enter_context(forced_path(path))


@pytest.fixture
def backend(request, forcing) -> str:
    """The backend to name, from a parameter that may name a path inside one (see forced_path),
    so that every path is checked on any CPU."""
    return forcing(request.param)


@pytest.fixture(scope="session")
def golden() -> dict:
    """The textbook's worked examples (a copy of shared/golden/textbook.json, checked below)."""
    return json.loads((DATA / "textbook.json").read_text())
