"""What every backend takes and returns: one signature, so backends are interchangeable functions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor

from attnkit.masks import Masks


@dataclass(frozen=True)
class Request:
    """Everything asked of a backend besides ``q``, ``k`` and ``v``, already checked.

    Attributes:
        masks: which keys each query may see (causal and window folded into ``masks.window``).
        scale: multiplies ``q . k``.
        softcap: if set, scores become ``softcap * tanh(score / softcap)``.
        alibi_slopes: ``(h,)``; if set, scores get ``-slope * |p(i) - j|``.
        dropout_p: dropout on the attention weights (0 disables it).
        return_lse: also return the log-sum-exp of the scores, ``(b, h, t)``.
        return_weights: also return the softmax weights before dropout, ``(b, h, t, s)``.
    """

    masks: Masks
    scale: float
    softcap: float | None = None
    alibi_slopes: Tensor | None = None
    dropout_p: float = 0.0
    return_lse: bool = False
    return_weights: bool = False

    @property
    def options(self) -> frozenset[str]:
        """The options in use, named as the arguments of :func:`attnkit.functional.attention`."""
        used = {
            "attn_mask": self.masks.attn_mask is not None,
            "attn_mask_grad": self.masks.attn_mask is not None
            and self.masks.attn_mask.requires_grad,
            "key_mask": self.masks.key_mask is not None,
            "window": self.masks.window not in (None, (-1, 0)),
            "causal": self.masks.window is not None and self.masks.window[1] == 0,
            "softcap": self.softcap is not None,
            "alibi_slopes": self.alibi_slopes is not None,
            "dropout_p": self.dropout_p > 0,
            "return_lse": self.return_lse,
            "return_weights": self.return_weights,
        }
        return frozenset(name for name, on in used.items() if on)


class AttentionOutput(NamedTuple):
    """``out`` ``(b, h, t, d_v)``; ``lse`` ``(b, h, t)`` and ``weights`` ``(b, h, t, s)`` if asked."""

    out: Tensor
    lse: Tensor | None = None
    weights: Tensor | None = None


BackendFn = Callable[[Tensor, Tensor, Tensor, Request], AttentionOutput]
# Why a backend cannot run these tensors (device, dtype, sizes), or None if it can.
RefusesFn = Callable[[Request, Tensor, Tensor, Tensor], str | None]


@dataclass(frozen=True)
class Backend:
    """A backend function and the options it computes exactly."""

    name: str
    fn: BackendFn
    supports: frozenset[str]
    refuses: RefusesFn | None = None
