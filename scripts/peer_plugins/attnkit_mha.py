"""pytest plugin: ``torch.nn.MultiheadAttention`` is attnkit's for the whole session.

``-p attnkit_mha`` (with this folder on ``PYTHONPATH``) replaces the class under every name torch
code reaches it by before any test module is imported: ``torch.nn``, ``torch.nn.modules``,
``torch.nn.modules.activation`` (tests write ``torch.nn.modules.activation.MultiheadAttention``)
and ``torch.nn.modules.transformer`` (so that ``nn.TransformerEncoderLayer``,
``nn.TransformerDecoderLayer`` and ``nn.Transformer`` build attnkit's layer too). A test module's
``from torch.nn import MultiheadAttention`` then gets attnkit's class as well.

Every call of an attnkit layer is counted (peer_count.py): the count sits on the class's
``__call__``, not on ``forward``, so that ``torch.jit.script`` compiles attnkit's own ``forward``
and a test that scripts the layer meets attnkit's code, not this plugin's. A session that never
calls the layer fails. Torch's own fused paths that use the layer's weights without calling it
(the native ``TransformerEncoderLayer`` fast path) are not attnkit's and are not counted.
"""

from __future__ import annotations

from typing import Any

import peer_count
import torch
import torch.nn.modules.activation
import torch.nn.modules.transformer

# attnkit first: its class subclasses torch's, which must still be torch's own when it is defined
import attnkit.nn

pytest_terminal_summary = peer_count.pytest_terminal_summary
pytest_sessionfinish = peer_count.pytest_sessionfinish

_PLACES = (torch.nn, torch.nn.modules, torch.nn.modules.activation, torch.nn.modules.transformer)
_TORCH_CLASS = torch.nn.MultiheadAttention
_COUNTER = peer_count.counter("attnkit.nn.MultiheadAttention", "torch.nn.MultiheadAttention")


def _counted_call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return _COUNTER.call(torch.nn.Module.__call__, self, *args, **kwargs)


def pytest_configure(config: Any) -> None:
    attnkit.nn.MultiheadAttention.__call__ = _counted_call
    for module in _PLACES:
        module.MultiheadAttention = attnkit.nn.MultiheadAttention


def pytest_unconfigure(config: Any) -> None:
    for module in _PLACES:
        module.MultiheadAttention = _TORCH_CLASS
    del attnkit.nn.MultiheadAttention.__call__
