"""One call of [`attnkit.functional.attention`][attnkit.functional.attention] as data: the
checked [`Call`][attnkit.call.Call] that every backend takes, the
[`AttentionOutput`][attnkit.call.AttentionOutput] it returns, and the autograd state around it
(whether gradients are recorded, at how many levels, whether forward-mode AD is on).

[`attention`][attnkit.functional.attention] checks its arguments once and makes a ``Call``;
nothing after it checks the call again.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from attnkit.masks import Masks
from attnkit.mods import MaskMod, ScoreMod


class Options(NamedTuple):
    """The keywords of [`attention`][attnkit.functional.attention] that are not tensors, each
    once, with its default: the call's options as the caller gave them, before any check
    ([`checked_call`][attnkit.functional.checked_call] checks them into a
    [`Call`][attnkit.call.Call]). ``which_backend`` and ``checked_call`` take them as
    ``attention`` does.

    Attributes:
        causal: key ``j`` is visible to query ``i`` iff ``j <= i + s - t`` (bottom-right aligned).
        window: ``(left, right)`` positions around ``p(i)`` that a query sees; -1 is unbounded.
        softcap: caps scores smoothly to ``(-softcap, softcap)``.
        scale: multiplies ``q . k``; None for ``1 / sqrt(d)``.
        dropout_p: dropout probability on the weights.
        return_lse: also return the log-sum-exp of the scores.
        return_weights: also return the weights: True before dropout, ``"dropped"`` after it.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool``, a shorthand for a block mask.
        backend: ``"auto"`` or a backend's name.
    """

    causal: bool = False
    window: tuple[int, int] | None = None
    softcap: float | None = None
    scale: float | None = None
    dropout_p: float = 0.0
    return_lse: bool = False
    return_weights: bool | str = False
    score_mod: ScoreMod | None = None
    mask_mod: MaskMod | None = None
    backend: str = "auto"


TENSOR_KEYWORDS = (
    "attn_mask",
    "key_mask",
    "alibi_slopes",
    "sinks",
    "block_mask",
    "nonfinite_keys",
    "indices",
)
"""The keywords of ``attention`` that are tensors (or hold them): they join the ``Call`` itself."""

DEFAULT_OPTIONS = Options()


class Call(NamedTuple):
    """One call of [`attnkit.functional.attention`][attnkit.functional.attention], checked (a
    NamedTuple: made on every call, in half the time of a frozen dataclass). Made by
    [`call_of`][attnkit.call.call_of]; parts of it are replaced, never checked again.

    Attributes:
        q: ``(b, h, t, d)`` queries.
        k: ``(b, h_kv, s, d)`` keys.
        v: ``(b, h_kv, s, d_v)`` values.
        masks: which keys each query may see (causal and window folded into ``masks.window``).
        scale: multiplies ``q . k``.
        softcap: if set, scores become ``softcap * tanh(score / softcap)``.
        alibi_slopes: ``(h,)``; if set, scores get ``-slope * |p(i) - j|``.
        sinks: ``(h,)`` learned logits, one per query head, that join every query's softmax
            denominator and bring no value ([`attnkit.rules.sinks`][attnkit.rules.sinks]).
        dropout_p: dropout on the attention weights (0 disables it).
        return_lse: also return the log-sum-exp of the scores, ``(b, h, t)``.
        return_weights: also return the softmax weights, ``(b, h, t, s)``: True before dropout,
            ``"dropped"`` after it.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx)``, applied after ``scale``, ``softcap``
            and ALiBi, before the masks (see [`attnkit.mods`][attnkit.mods]).
        block_mask: a torch ``BlockMask`` of ``(t, s)``: the blocks it lists, its ``mask_mod``
            applied in its partial blocks.
        indices: ``(b, 1 or h_kv, t, n)`` int32 or int64: the keys each query may attend to
            (top-k sparse attention), -1 for an unused slot; None for every key.
        mod_tensors: the tensors ``score_mod`` reads that require grad (gradients reach them).
        mod_adds: whether ``score_mod`` [adds to the score][attnkit.mods.adds_to_score] (found
            once per function, `attnkit.mods.memo`; False without one).
        nonfinite_keys: ``(b, h_kv, s)`` True where a row of ``k`` holds a NaN or an infinity, as
            the caller knew it (a [`KVCache`][attnkit.cache.KVCache]), or None: a hint that a
            backend may take instead of reading ``k``, not an option.
        finite: whether every value of q and of the keys is finite, as the registry found before a
            backend that [keeps the NaN rule by a look][attnkit.backends.base.Backend.looks_at_values]
            ran: True, or False where one is not or Python may not look (the exact path then
            runs); None where the registry did not look (a float mask or ALiBi: the backend's
            exact path runs anyway).
        options: the options in use, named as the arguments of ``attention``.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    masks: Masks
    scale: float
    softcap: float | None = None
    alibi_slopes: Tensor | None = None
    sinks: Tensor | None = None
    dropout_p: float = 0.0
    return_lse: bool = False
    return_weights: bool | str = False
    score_mod: ScoreMod | None = None
    block_mask: BlockMask | None = None
    indices: Tensor | None = None
    mod_tensors: tuple[Tensor, ...] = ()
    mod_adds: bool = False
    nonfinite_keys: Tensor | None = None
    finite: bool | None = None
    options: frozenset[str] = frozenset()

    def with_tensors(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        alibi_slopes: Tensor | None,
        attn_mask: Tensor | None,
        key_mask: Tensor | None,
        mod_tensors: tuple[Tensor, ...] = (),
    ) -> Call:
        """The same call on other tensors of the same shapes (those an autograd function or a
        transform hands over, a chunk of a ring's pieces): nothing is checked again, and nothing
        is known of the new keys' rows."""
        masks = self.masks._replace(key_mask=key_mask, attn_mask=attn_mask)
        return self._replace(
            q=q,
            k=k,
            v=v,
            masks=masks,
            alibi_slopes=alibi_slopes,
            mod_tensors=mod_tensors,
            nonfinite_keys=None,
            finite=None,
        )

    def looked(self, finite: bool | None) -> Call:
        """This call with ``finite`` set (the registry's look at the inputs), made from its fields
        in order: ``_replace`` costs 1 µs, a twentieth of a small call's own time, this a third of
        it. ``finite`` is the last field but ``options`` (held by a test)."""
        return tuple.__new__(Call, (*self[:-2], finite, self[-1]))

    def tensors(self) -> tuple[Tensor | None, ...]:
        """The call's tensors other than ``mod_tensors``, in the order ``with_tensors`` takes."""
        masks = self.masks
        return self.q, self.k, self.v, self.alibi_slopes, masks.attn_mask, masks.key_mask


def call_of(q: Tensor, k: Tensor, v: Tensor, masks: Masks, scale: float, **fields) -> Call:
    """A [`Call`][attnkit.call.Call] of arguments already checked, with the set of
    options in use computed once."""
    return Call(q, k, v, masks, scale, options=_options_in_use(masks, fields), **fields)


def _options_in_use(masks: Masks, fields: dict) -> frozenset[str]:
    window, key_mask, attn_mask = masks.window, masks.key_mask, masks.attn_mask
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
    if masks.shift != 0:
        used.append("shift")
    for name in ("softcap", "alibi_slopes", "sinks", "score_mod", "block_mask", "indices"):
        if fields.get(name) is not None:
            used.append(name)
    for name in ("dropout_p", "return_lse", "return_weights"):
        if fields.get(name):
            used.append(name)
    return frozenset(used)


class AttentionOutput(NamedTuple):
    """``out`` ``(b, h, t, d_v)``; ``lse`` ``(b, h, t)`` and ``weights`` ``(b, h, t, s)`` if asked."""

    out: Tensor
    lse: Tensor | None = None
    weights: Tensor | None = None


def forward_ad_active() -> bool:
    """Whether forward-mode AD may reach this call: inside ``torch.autograd.forward_ad.dual_level``,
    ``torch.func.jvp`` or ``jacfwd`` (both set a forward-AD level). Backends without a jvp rule are
    then refused, before they would fail inside torch."""
    return torch.autograd.forward_ad._current_level >= 0


def wants_grad(*tensors: Tensor | None) -> bool:
    """Whether autograd will record this call: grad mode is on and some tensor requires grad."""
    if torch.is_grad_enabled():
        for x in tensors:  # a loop, not any(): no generator on every call
            if x is not None and x.requires_grad:
                return True
    return False


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
