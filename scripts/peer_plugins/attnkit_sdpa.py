"""pytest plugin: ``torch.nn.functional.scaled_dot_product_attention`` is attnkit's for the session.

``-p attnkit_sdpa`` (with this folder on ``PYTHONPATH``) sets the name in ``torch.nn.functional``
to [`attnkit.nn.functional.scaled_dot_product_attention`] before any test module is imported, so
the tests' ``F.scaled_dot_product_attention(...)``, their ``from torch.nn.functional import
scaled_dot_product_attention`` and torch's own ``F.multi_head_attention_forward`` (which looks the
name up in that module) all call attnkit.

attnkit's SDPA backend calls torch's SDPA itself. attnkit is imported, and called once, before the
name is replaced, so that a backend which captures torch's function when it is imported captures
torch's own; one that looks the name up at call time would find this replacement and recurse:
the counter's ``reentered`` counts such calls, and the plugin says so at start-up.

Tests that script a caller of SDPA (torch's layers) fail with attnkit's function in torch's place,
counted or not: TorchScript compiles no Python function with keyword-only arguments, which torch's
signature has (docs/bench/peer-suites.md lists them).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import peer_count
import torch
import torch.nn.functional as F

# attnkit first, and one call through it, before torch's name is replaced (see above)
import attnkit
import attnkit.nn.functional

pytest_terminal_summary = peer_count.pytest_terminal_summary
pytest_sessionfinish = peer_count.pytest_sessionfinish

_TORCH_SDPA = F.scaled_dot_product_attention
_COUNTER = peer_count.counter(
    "attnkit.nn.functional.scaled_dot_product_attention",
    "torch.nn.functional.scaled_dot_product_attention",
)


def _probe() -> None:
    """One small call through the replacement: warns if attnkit re-enters it (recursion)."""
    q = torch.randn(1, 2, 4, 8)
    with contextlib.suppress(RecursionError):
        F.scaled_dot_product_attention(q, q, q)
    if _COUNTER.reentered:
        warnings.warn(
            "attnkit's scaled_dot_product_attention calls torch's through the replaced name: "
            "calls that pick attnkit's SDPA backend recurse",
            stacklevel=1,
        )
        print("attnkit_sdpa: attnkit re-enters the replaced torch.nn.functional name (recursion)")
    _COUNTER.reset()


def pytest_configure(config: Any) -> None:
    q = torch.randn(1, 2, 4, 8)
    attnkit.nn.functional.scaled_dot_product_attention(
        q, q, q
    )  # imports whatever it imports lazily
    F.scaled_dot_product_attention = _COUNTER.wrap(
        attnkit.nn.functional.scaled_dot_product_attention
    )
    _probe()


def pytest_unconfigure(config: Any) -> None:
    F.scaled_dot_product_attention = _TORCH_SDPA
