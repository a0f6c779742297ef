"""pytest plugin: the Gated DeltaNet layers of Qwen3-Next, Qwen3.5 and Qwen3.5-MoE run on attnkit.

``-p attnkit_linear`` (with this folder on ``PYTHONPATH``) calls
[`attnkit.hf.linear.use_gated_delta_rule`] when pytest starts, before any test module is imported:
transformers' ``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule`` and
``causal_conv1d_fn`` in those models' modeling modules are attnkit's, in every model the tests build
and for the tests that import the functions by name. It undoes it when pytest ends.

attnkit's ``gated_delta_rule``, as `attnkit.hf.linear` calls it, is counted (peer_count.py); a
session that never calls it fails.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import peer_count

import attnkit.hf.linear

pytest_terminal_summary = peer_count.pytest_terminal_summary
pytest_sessionfinish = peer_count.pytest_sessionfinish

_CALLS = peer_count.counter(
    "attnkit.gated_delta_rule",
    "torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule (qwen3_next, qwen3_5, qwen3_5_moe)",
)
_UNDO: list[Callable[[], None]] = []


def pytest_configure(config: Any) -> None:
    real = attnkit.hf.linear.gated_delta_rule
    attnkit.hf.linear.gated_delta_rule = _CALLS.wrap(real)
    _UNDO.append(lambda: setattr(attnkit.hf.linear, "gated_delta_rule", real))
    _UNDO.append(attnkit.hf.linear.use_gated_delta_rule())


def pytest_unconfigure(config: Any) -> None:
    while _UNDO:
        _UNDO.pop()()
