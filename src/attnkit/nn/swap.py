"""``swap(model)``: every ``torch.nn.MultiheadAttention`` inside a model runs on attnkit.

Each one becomes an [`attnkit.nn.MultiheadAttention`][attnkit.nn.multihead.MultiheadAttention]
holding the same parameter objects (an optimizer made before keeps working), on the same device,
in the same dtype and mode; nothing else in the model changes. In eval, torch's
``TransformerEncoderLayer`` and ``TransformerEncoder`` take a fused path of their own
(``torch._transformer_encoder_layer_fwd``, nested tensors) that never calls their attention
module: around a swapped model's encoder layers that path is turned off, so attnkit runs in every
mode. (torch's switch for it, ``torch.backends.mha.set_fastpath_enabled``, is process-wide: it is
off while such a layer runs, and back as it was after.)
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from attnkit.nn.multihead import MultiheadAttention

__all__ = ["swap"]

_ENCODERS = (nn.TransformerEncoderLayer, nn.TransformerEncoder)


def swap(model: nn.Module) -> nn.Module:
    """Replace, in place, every ``torch.nn.MultiheadAttention`` inside ``model`` (``model`` itself
    too) by attnkit's, and return the model.

    Example:
        >>> import torch
        >>> layer = torch.nn.TransformerEncoderLayer(64, 4, batch_first=True)
        >>> layer = swap(layer)
        >>> type(layer.self_attn).__module__
        'attnkit.nn.multihead'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if type(model) is nn.MultiheadAttention:
        return _ours(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.MultiheadAttention:
                setattr(parent, name, _ours(child))
        if isinstance(parent, _ENCODERS) and not getattr(parent, "_attnkit_no_fast_path", False):
            parent.register_forward_pre_hook(_fast_path_off)
            parent.register_forward_hook(_fast_path_back, always_call=True)
            parent._attnkit_no_fast_path = True
    return model


def _ours(module: nn.MultiheadAttention) -> MultiheadAttention:
    """``module`` as attnkit's class: a shallow copy, which shares its parameters and buffers."""
    ours = copy.copy(module)
    ours.__class__ = MultiheadAttention
    return ours


def _fast_path_off(module: nn.Module, args) -> None:
    """Before an encoder layer runs: torch's fused path off, the previous setting kept."""
    module._attnkit_fast_path_was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)


def _fast_path_back(module: nn.Module, args, output) -> None:
    """After it ran (or raised): the setting as it was."""
    torch.backends.mha.set_fastpath_enabled(module.__dict__.pop("_attnkit_fast_path_was", True))
