"""Shared fixtures: a fixed seed for every test and a quick hypothesis profile."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

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


@pytest.fixture(scope="session")
def golden() -> dict:
    """The textbook's worked examples (a copy of shared/golden/textbook.json, checked below)."""
    return json.loads((DATA / "textbook.json").read_text())
