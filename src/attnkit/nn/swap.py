"""``swap(model)``: every ``torch.nn.MultiheadAttention`` inside a model runs on attnkit.

Each one becomes an [`attnkit.nn.MultiheadAttention`][attnkit.nn.multihead.MultiheadAttention]
in place: the same object (its class changed), so its parameters, buffers, hooks, device, dtype
and mode stay, and an optimizer made before keeps working; nothing else in the model changes.
A subclass of ``nn.MultiheadAttention`` is left as it is, with a warning: its own methods may
rely on torch's ``forward``. In eval, torch's
``TransformerEncoderLayer`` and ``TransformerEncoder`` take a fused path of their own
(``torch._transformer_encoder_layer_fwd``, nested tensors) that never calls their attention
module: around a swapped model's encoder layers that path is turned off, so attnkit runs in every
mode. (torch's switch for it, ``torch.backends.mha.set_fastpath_enabled``, is process-wide: it is
off while such a layer runs, and back as it was after.)
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from attnkit.nn.multihead import MultiheadAttention

__all__ = ["swap"]

_ENCODERS = (nn.TransformerEncoderLayer, nn.TransformerEncoder)


def swap(model: nn.Module) -> nn.Module:
    """Make every ``torch.nn.MultiheadAttention`` inside ``model`` (``model`` itself too)
    attnkit's, in place, and return ``model``.

    Example:
        >>> import torch
        >>> layer = torch.nn.TransformerEncoderLayer(64, 4, batch_first=True)
        >>> layer = swap(layer)
        >>> type(layer.self_attn).__module__
        'attnkit.nn.multihead'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for module in model.modules():
        if type(module) is nn.MultiheadAttention:
            module.__class__ = MultiheadAttention  # a subclass that adds no state: safe to switch
        elif isinstance(module, nn.MultiheadAttention) and not isinstance(
            module, MultiheadAttention
        ):
            warnings.warn(
                f"swap left {type(module).__qualname__}, a subclass of torch.nn."
                "MultiheadAttention, as it is: its own methods may rely on torch's forward",
                UserWarning,
                stacklevel=2,
            )
    for parent in model.modules():
        if isinstance(parent, _ENCODERS) and not getattr(parent, "_attnkit_no_fast_path", False):
            parent.register_forward_pre_hook(_fast_path_off)
            parent.register_forward_hook(_fast_path_back, always_call=True)
            parent._attnkit_no_fast_path = True
    return model


def _fast_path_off(module: nn.Module, args) -> None:
    """Before an encoder layer runs: torch's fused path off, the previous setting kept."""
    module._attnkit_fast_path_was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)


def _fast_path_back(module: nn.Module, args, output) -> None:
    """After it ran (or raised): the setting as it was."""
    torch.backends.mha.set_fastpath_enabled(module.__dict__.pop("_attnkit_fast_path_was", True))
