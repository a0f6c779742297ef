"""pytest plugin: transformers' ``"sdpa"`` attention (and mask) entries are attnkit's.

``-p attnkit_hf`` (with this folder on ``PYTHONPATH``) registers
[`attnkit.hf.attention_function`] in transformers' ``AttentionInterface`` and
[`attnkit.hf.masks.mask_builder`] in its ``AttentionMaskInterface`` under each name of
``$ATTNKIT_HF_ENTRIES`` (comma-separated, default ``sdpa``), the way [`attnkit.hf.register`] does
for its own name, before any test module is imported. Every model that asks the interface for
``"sdpa"`` (the default implementation of a model built from a config) then runs attnkit.

``ATTNKIT_HF_ENTRIES=sdpa,eager`` also replaces ``"eager"``, for the families whose tests run
``eager`` because ``sdpa`` cannot (Gemma 2's soft-capping, GPT-OSS's sinks); transformers' models
take ``"eager"`` from the interface when it holds one. Tests that compare eager with sdpa then
compare attnkit with itself: run that family once per setting and say which.

Both functions are counted (peer_count.py); a session that calls neither fails.
"""

from __future__ import annotations

import os
from typing import Any

import peer_count
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import attnkit.hf
import attnkit.hf.masks

pytest_terminal_summary = peer_count.pytest_terminal_summary
pytest_sessionfinish = peer_count.pytest_sessionfinish

_ENTRIES = [name for name in os.environ.get("ATTNKIT_HF_ENTRIES", "sdpa").split(",") if name]
_ATTENTION = peer_count.counter(
    "attnkit.hf.attention_function", "AttentionInterface[" + ",".join(_ENTRIES) + "]"
)
_MASKS = peer_count.counter(
    "attnkit.hf.masks.mask_builder", "AttentionMaskInterface[" + ",".join(_ENTRIES) + "]"
)
_SAVED: dict[tuple[type, str], Any] = {}


def pytest_configure(config: Any) -> None:
    attention = _ATTENTION.wrap(attnkit.hf.attention_function)
    masks = _MASKS.wrap(attnkit.hf.masks.mask_builder)
    for interface, function in ((AttentionInterface, attention), (AttentionMaskInterface, masks)):
        for name in _ENTRIES:
            _SAVED[interface, name] = interface._global_mapping.get(name)
            interface.register(name, function)


def pytest_unconfigure(config: Any) -> None:
    for (interface, name), function in _SAVED.items():
        if function is None:
            interface._global_mapping.pop(name, None)
        else:
            interface.register(name, function)
