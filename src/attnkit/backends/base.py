"""What every backend takes and returns: one signature, so backends are interchangeable functions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from attnkit.masks import Masks
from attnkit.mods import ScoreMod


class Request(NamedTuple):
    """Everything asked of a backend besides ``q``, ``k`` and ``v``, already checked (a NamedTuple:
    built on every call, in half the time of a frozen dataclass).

    Attributes:
        masks: which keys each query may see (causal and window folded into ``masks.window``).
        scale: multiplies ``q . k``.
        softcap: if set, scores become ``softcap * tanh(score / softcap)``.
        alibi_slopes: ``(h,)``; if set, scores get ``-slope * |p(i) - j|``.
        dropout_p: dropout on the attention weights (0 disables it).
        return_lse: also return the log-sum-exp of the scores, ``(b, h, t)``.
        return_weights: also return the softmax weights before dropout, ``(b, h, t, s)``.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx)``, applied after ``scale``, ``softcap``
            and ALiBi, before the masks (see [`attnkit.mods`][attnkit.mods]).
        block_mask: a torch ``BlockMask`` of ``(t, s)``: the blocks it lists, its ``mask_mod``
            applied in its partial blocks.
        mod_tensors: the tensors ``score_mod`` reads that require grad (gradients reach them).
    """

    masks: Masks
    scale: float
    softcap: float | None = None
    alibi_slopes: Tensor | None = None
    dropout_p: float = 0.0
    return_lse: bool = False
    return_weights: bool = False
    score_mod: ScoreMod | None = None
    block_mask: BlockMask | None = None
    mod_tensors: tuple[Tensor, ...] = ()

    @property
    def options(self) -> frozenset[str]:
        """The options in use, named as the arguments of [`attnkit.functional.attention`][attnkit.functional.attention]."""
        window, key_mask, attn_mask = self.masks.window, self.masks.key_mask, self.masks.attn_mask
        used = []
        if attn_mask is not None:
            used.append("attn_mask")
            if attn_mask.requires_grad:
                used.append("attn_mask_grad")
        if key_mask is not None:
            used.append("key_mask")
        if window is not None:
            if window != (-1, 0):
                used.append("window")
            if window[1] == 0:
                used.append("causal")
        if self.masks.shift != 0:
            used.append("shift")
        if self.softcap is not None:
            used.append("softcap")
        if self.alibi_slopes is not None:
            used.append("alibi_slopes")
        if self.dropout_p > 0:
            used.append("dropout_p")
        if self.return_lse:
            used.append("return_lse")
        if self.return_weights:
            used.append("return_weights")
        if self.score_mod is not None:
            used.append("score_mod")
        if self.block_mask is not None:
            used.append("block_mask")
        return frozenset(used)


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


def forward_ad_active() -> bool:
    """Whether forward-mode AD may reach this call: inside ``torch.autograd.forward_ad.dual_level``,
    ``torch.func.jvp`` or ``jacfwd`` (both set a forward-AD level). Backends without a jvp rule are
    then refused, before they would fail inside torch."""
    return torch.autograd.forward_ad._current_level >= 0


def wants_grad(*tensors: Tensor | None) -> bool:
    """Whether autograd will record this call: grad mode is on and some tensor requires grad."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def gradient_levels(*tensors: Tensor | None) -> int:
    """How many reverse-mode gradients will be taken through this call: the ``torch.func``
    gradient transforms (``grad``, ``vjp``, ``jacrev``) that enclose it, plus one where ordinary
    autograd records the tensors beneath them (``torch.autograd.grad`` around ``torch.func.grad``).
    From 2, a backward must itself be differentiable; from 1, a custom backward must compose with
    the transforms' levels. Outside any transform: 0 (ordinary autograd is seen elsewhere)."""
    if not torch._C._are_functorch_transforms_active():
        return 0
    from torch._C._functorch import TransformType, get_unwrapped, is_functorch_wrapped_tensor
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    levels = sum(i.key() == TransformType.Grad for i in retrieve_all_functorch_interpreters())
    for x in tensors:
        while x is not None and is_functorch_wrapped_tensor(x):
            x = get_unwrapped(x)
        if x is not None and x.requires_grad and torch.is_grad_enabled():
            return levels + 1
    return levels
