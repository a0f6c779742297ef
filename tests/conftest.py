"""Shared fixtures: a fixed seed for every test and a quick hypothesis profile."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from attnkit import _cpu
from attnkit.backends import tiled, tiled_native

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
    lengths that do not divide the block sizes (the production sizes are 256 and 512), and many
    tiles of a score_mod's bias."""
    monkeypatch.setattr(tiled, "BLOCK_Q", 5)
    monkeypatch.setattr(tiled, "BLOCK_K", 7)
    # a score_mod's bias in tiles of 2 key blocks when b * h = 8 (TILE_BYTES // (4 b h rows))
    monkeypatch.setattr(tiled_native, "TILE_BYTES", 4 * 8 * 5 * 14)


@pytest.fixture
def every_extension(monkeypatch):
    """A CPU that has every extension attnkit knows (the probe's cache is emptied before and after),
    so that the narrowing tests check something on any CPU."""
    _cpu._features.cache_clear()
    monkeypatch.setattr(_cpu, "_detected", lambda: _cpu.KNOWN)
    yield
    _cpu._features.cache_clear()


@pytest.fixture
def pytorch_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiled backend without its C++ kernel: the PyTorch loop of tiled_loop.py runs."""
    monkeypatch.setattr(tiled, "_native_kernel", lambda device, dtype: None)


def force_path(monkeypatch: pytest.MonkeyPatch, path: str) -> str:
    """Force a path inside a backend, whatever the CPU, and return the backend's name.

    ``"tiled:loop"``: the tiled backend's PyTorch loop. ``"tiled:half"``: half-precision block
    products, as on CPUs with AVX512-BF16 or AMX: bf16 ones in the C++ kernel, with AVX512-BF16
    where its build has it, else by its portable version of the pair products, which every CPU
    runs (slowly). ``"tiled:portable"``: always the portable version. ``"tiled:half-loop"``:
    half-precision products in the loop."""
    name, _, inside = path.partition(":")
    if inside in ("loop", "half-loop"):
        monkeypatch.setattr(tiled, "_native_kernel", lambda device, dtype: None)
    if inside in ("half", "half-loop", "portable"):
        monkeypatch.setattr(tiled, "_fast_half_matmul", lambda dtype, device: True)
    if inside == "half":
        monkeypatch.setattr(tiled_native, "pair_products", _built_route)
    if inside == "portable":
        monkeypatch.setattr(tiled_native, "pair_products", lambda kernel: "portable")
    return name


def _built_route(kernel) -> str:
    return "avx512_bf16" if kernel.has_avx512_bf16() else "portable"


def expected_products(path: str) -> tuple[str, str]:
    """``(path, products)`` that which_backend reports for bf16 inputs on a forced ``path`` (one of
    force_path's half-precision ones), on this CPU's build."""
    if path == "tiled:half-loop":
        return "loop", "bfloat16"
    if path == "tiled:portable":
        return "native", "bf16-portable"
    return "native", f"bf16-{_built_route(tiled_native.KERNEL.load())}"


@pytest.fixture
def backend(request, monkeypatch) -> str:
    """The backend to name, from a parameter that may name a path inside one (see force_path),
    so that every path is checked on any CPU."""
    return force_path(monkeypatch, request.param)


@pytest.fixture(scope="session")
def golden() -> dict:
    """The textbook's worked examples (a copy of shared/golden/textbook.json, checked below)."""
    return json.loads((DATA / "textbook.json").read_text())
