"""Evaluating a user's ``score_mod`` and ``mask_mod`` over a block of scores, with errors that
name the function and the block."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import noop_mask

from attnkit.mods.compiling import compile_block, compiled_or_eager, name_of

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


class Block(NamedTuple):
    """The broadcast indices of one block: batches ``b``, heads ``h``, rows ``q``, keys ``kv``."""

    b: Tensor
    h: Tensor
    q: Tensor
    kv: Tensor

    @staticmethod
    def of(batches: range, heads: range, rows: range, keys: range, device=None) -> Block:
        def index(r: range, dim: int) -> Tensor:
            shape = [1, 1, 1, 1]
            shape[dim] = len(r)
            return torch.arange(r.start, r.stop, device=device).view(shape)

        return Block(index(batches, 0), index(heads, 1), index(rows, 2), index(keys, 3))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.b.numel(), self.h.numel(), self.q.numel(), self.kv.numel())

    def where(self) -> str:
        q, kv = self.q.view(-1), self.kv.view(-1)
        return (
            f"the block of queries {int(q[0])}..{int(q[-1])} and keys {int(kv[0])}..{int(kv[-1])}"
        )


def mask(mask_mod: MaskMod, at: Block, *, compiled: bool = False) -> Tensor:
    """``mask_mod`` over a block: a bool tensor broadcastable to ``at.shape``. ``compiled``:
    through [`compile_block`][attnkit.mods.compile_block]."""
    if mask_mod is noop_mask:  # torch's "no mask", a 0-d True
        return torch.ones((1, 1, 1, 1), dtype=torch.bool, device=at.q.device)
    try:
        allowed = (compile_block(mask_mod) if compiled else mask_mod)(*at)
        _elementwise(allowed, at.shape)
    except Exception as error:
        allowed = _by_vmap("mask_mod", mask_mod, at, None, error)
    if not isinstance(allowed, Tensor) or allowed.dtype != torch.bool:
        got = allowed.dtype if isinstance(allowed, Tensor) else type(allowed).__name__
        raise TypeError(
            f"mask_mod {name_of(mask_mod)} returned {got} for {at.where()}; it must return a "
            "bool tensor (True = may attend)"
        )
    return allowed


def score(
    score_mod: ScoreMod,
    scores: Tensor,
    at: Block,
    *,
    compiled: bool = False,
    also: torch.dtype | None = None,
) -> Tensor:
    """``score_mod`` over a block of ``scores`` of shape ``at.shape``: the modified scores, of the
    same shape and dtype. ``compiled``: through [`compile_block`][attnkit.mods.compile_block].
    ``also``: a dtype accepted too and cast to the scores' (the reference backend computes in
    float64 the scores a mod's float32 tensors expect)."""
    try:
        out = (compile_block(score_mod) if compiled else score_mod)(scores, *at)
        _elementwise(out, scores.shape)
        if out.shape != scores.shape:  # a function of fewer dims: a block of its own, writable
            out = out.expand(scores.shape).contiguous()
    except Exception as error:
        out = _by_vmap("score_mod", score_mod, at, scores, error)
        if isinstance(out, Tensor) and 0 in out.stride():  # vmap's broadcast of a constant
            out = out.contiguous()  # a block of its own, which the kernels write into
    if out.shape != scores.shape:
        raise ValueError(
            f"score_mod {name_of(score_mod)} changed the shape of {at.where()} from "
            f"{tuple(scores.shape)} to {tuple(out.shape)}"
        )
    if out.dtype == also:
        out = out.to(scores.dtype)
    if out.dtype != scores.dtype:
        raise TypeError(
            f"score_mod {name_of(score_mod)} returned {out.dtype} for {at.where()}, not the "
            f"scores' {scores.dtype}"
        )
    return out


def bias(score_mod: ScoreMod, at: Block, *, compiled: bool = False) -> Tensor:
    """The ``f`` of a mod that [adds to the score][attnkit.mods.adds_to_score] over a block:
    ``score_mod(0, b, h, q_idx, kv_idx)``, float32, of a shape that broadcasts to ``at.shape``.
    ``compiled``: through ``torch.compile`` ([`compiled_or_eager`][attnkit.mods.compiled_or_eager]),
    which makes it one pass that writes the block."""
    zero = torch.zeros((1, 1, 1, 1), device=at.q.device)
    try:
        f = (compiled_or_eager(score_mod) if compiled else score_mod)(zero, *at)
        _elementwise(f, at.shape)
    except Exception:  # one score at a time, or the general path's error naming mod and block
        f = score(score_mod, zero.expand(at.shape), at)
    return f


def bias_grads(
    score_mod: ScoreMod,
    at: Block,
    dbias: Tensor,
    tensors: tuple[Tensor, ...],
    *,
    compiled: bool = False,
    evaluated: Tensor | None = None,
) -> tuple[Tensor | None, ...]:
    """The gradients of ``tensors`` (those the mod reads) from ``dbias``, the loss's gradient with
    respect to the mod's [`bias`][attnkit.mods.bias] over the block ``at``; None for one that
    ``f`` does not read. ``evaluated``: that bias, already evaluated over ``at`` with grad enabled
    (its graph kept), so that it is not evaluated again (one evaluated without its graph gives
    None for every tensor)."""
    f = evaluated
    if f is None:
        with torch.enable_grad():
            f = bias(score_mod, at, compiled=compiled)
    if not f.requires_grad:
        return (None,) * len(tensors)
    return torch.autograd.grad(f, tensors, dbias.sum_to_size(f.shape), allow_unused=True)


def _elementwise(result: Tensor, shape: tuple[int, ...]) -> None:
    """Raise unless ``result`` is what an elementwise function of the block's four broadcast
    indices gives: a 4-D tensor that broadcasts to the block. Anything else (a reduction over a
    dim, say) means something else one score at a time, so it runs under ``vmap``."""
    if not isinstance(result, Tensor) or result.dim() != 4:
        raise TypeError("not a 4-D tensor")
    torch.broadcast_shapes(result.shape, shape)


def _by_vmap(kind: str, mod: Callable, at: Block, scores: Tensor | None, first: Exception):
    """``mod`` of one score at a time, mapped over the block's four index dims with ``torch.vmap``
    (innermost keys, outermost batches), as torch's FlexAttention evaluates mods."""
    lead = () if scores is None else (0,)
    fn = mod
    for dim in reversed(range(4)):
        fn = torch.vmap(fn, in_dims=(*lead, *(0 if i == dim else None for i in range(4))))
    indices = [x.reshape(-1) for x in at]
    try:
        out = fn(*indices) if scores is None else fn(scores, *indices)
    except Exception as error:
        kind_of = (
            type(error) if type(error) in (TypeError, ValueError, IndexError) else RuntimeError
        )
        raise kind_of(f"{kind} {name_of(mod)} failed on {at.where()}: {error}") from first
    return out


def at_positions(given: dict, q_offset: int, kv_offset: int) -> dict:
    """``given``'s ``score_mod`` and ``mask_mod`` seeing ``q_idx + q_offset`` and
    ``kv_idx + kv_offset``: the positions in the sequence of a chunk's queries and of the keys a
    KV cache holds. Other entries pass through."""
    score_mod, mask_mod = given.get("score_mod"), given.get("mask_mod")
    if (q_offset == 0 and kv_offset == 0) or (score_mod is None and mask_mod is None):
        return given
    shifted = dict(given)
    # 0-d tensors, not ints: torch.compile takes them as inputs rather than compiling anew for
    # each offset (a cache's every position, a ring's every pair of chunks)
    q_offset, kv_offset = torch.tensor(q_offset), torch.tensor(kv_offset)
    if score_mod is not None:

        def score_at(score, b, h, q_idx, kv_idx):
            return score_mod(score, b, h, q_idx + q_offset, kv_idx + kv_offset)

        score_at.__qualname__ = name_of(score_mod)
        score_at.__wrapped__ = score_mod
        score_at.__attnkit_shifted__ = True  # the same mod at other indices (mods.memo)
        shifted["score_mod"] = score_at
    if mask_mod is not None:

        def mask_at(b, h, q_idx, kv_idx):
            return mask_mod(b, h, q_idx + q_offset, kv_idx + kv_offset)

        mask_at.__qualname__ = name_of(mask_mod)
        mask_at.__wrapped__ = mask_mod
        mask_at.__attnkit_shifted__ = True
        shifted["mask_mod"] = mask_at
    return shifted
