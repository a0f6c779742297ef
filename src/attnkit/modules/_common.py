"""Helpers shared by the modules: input checks at the module boundary and head reshapes.

Shapes: ``b`` batch, ``t`` tokens, ``h`` heads, ``d`` head dim, ``e = h * d`` embed dim.
"""

from __future__ import annotations

from torch import Tensor

from attnkit import _checks


def as_batched(
    x: Tensor, name: str, features: int, features_name: str, like: Tensor
) -> tuple[Tensor, bool]:
    """Check a ``(b, t, e)`` or unbatched ``(t, e)`` input against the layer's width and its
    parameter ``like`` (dtype, device); return it as ``(b, t, e)`` and whether it was unbatched
    (the output is then squeezed back, as torch's own modules do)."""
    if (  # the common case, in one expression; any other input goes through the checks below
        isinstance(x, Tensor)
        and x.dim() == 3
        and x.shape[-1] == features
        and x.dtype == like.dtype
        and x.device == like.device
        and x.is_floating_point()
    ):
        return x, False
    _checks.check_tensor(x, name)
    _checks.check_rank(x, name, (2, 3), "(batch, tokens, features) or (tokens, features)")
    _checks.check_floating(x, name)
    _checks.check_features(x, name, features, features_name)
    _checks.check_matches_parameters(x, name, like)
    return (x.unsqueeze(0), True) if x.dim() == 2 else (x, False)


def split_heads(x: Tensor, num_heads: int) -> Tensor:
    """``(b, t, h * d) -> (b, h, t, d)``."""
    b, t, e = x.shape
    return x.view(b, t, num_heads, e // num_heads).transpose(1, 2)  # (b, t, h, d) -> (b, h, t, d)


def merge_heads(x: Tensor) -> Tensor:
    """``(b, h, t, d) -> (b, t, h * d)``, the heads side by side."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)  # (b, h, t, d) -> (b, t, h, d) -> (b, t, e)


def module_window(window: int | None, causal: bool) -> tuple[int, int] | None:
    """A module's ``window=W``: the last ``W`` positions (itself included) when causal, else ``W``
    positions centred on itself; as ``(left, right)`` for [`attnkit.functional.attention`][attnkit.functional.attention]."""
    if window is None:
        return None
    _checks.check_positive_int(window, "window")
    return (window - 1, 0) if causal else (window // 2, (window - 1) // 2)


def module_softcap(softcap: float | None) -> float | None:
    return None if softcap is None else _checks.check_positive_number(softcap, "softcap")


def unbatch(result: Tensor | tuple[Tensor, ...], unbatched: bool) -> Tensor | tuple[Tensor, ...]:
    """Squeeze the batch dim back off a module's output (and weights) for an unbatched input."""
    if not unbatched:
        return result
    if isinstance(result, Tensor):
        return result.squeeze(0)
    return tuple(r.squeeze(0) for r in result)
