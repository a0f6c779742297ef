"""The benchmark's cases of user-written scores and masks, each written as its users write it for
each peer: a ``score_mod``/``mask_mod`` for FlexAttention and attnkit, a dense mask or bias for
the naive formula and SDPA.

- ``relbias``: a learned relative-position bias, ``score + table[h, q_idx - kv_idx]``, causal;
  the table is trained (it requires grad with the backward).
- ``alibi-mod``: ALiBi written as a ``score_mod``, causal, beside the built-in ``alibi`` variant.
- ``document``: 8 packed documents, causal within each (a block mask).
- ``prefix-lm``: the first quarter of the tokens sees itself bidirectionally, the rest causally.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

import attnkit
from attnkit.functional import attention

FLEX_VARIANTS = ("relbias", "alibi-mod", "document", "prefix-lm")
OWN_MASK = ("prefix-lm",)  # variants whose mask is not the causal one (reports do not say causal)
DOCUMENTS = 8


@dataclass
class Mods:
    """One case's functions, the tensors they read, and the dense equivalents."""

    score_mod: Callable | None
    mask_mod: Callable | None
    table: Tensor | None  # what score_mod reads and a backward trains
    causal: bool  # the causal part, which attnkit takes as causal=True
    dense_bias: Callable[[Tensor], Tensor] | None = None  # positions (n,) -> the (h, n, n) bias

    def bias(self, n: int, dtype: torch.dtype, device: str = "cpu") -> Tensor | None:
        """The score_mod as a dense ``(h, n, n)`` bias, built from the table as a user would."""
        if self.dense_bias is None:
            return None
        return self.dense_bias(torch.arange(n, device=device)).to(dtype)

    def allowed(self, n: int, device: str = "cpu") -> Tensor | None:
        """The mask as a dense ``(n, n)`` bool, causal folded in."""
        position = torch.arange(n, device=device)
        allowed = position[:, None] >= position if self.causal else None
        if self.mask_mod is not None:
            by_mod = self.mask_mod(None, None, position[:, None], position)
            allowed = by_mod if allowed is None else allowed & by_mod
        return allowed


def build(variant: str, n: int, h: int, grad: bool, device: str = "cpu") -> Mods:
    """The functions of ``variant`` for sequences of ``n`` and ``h`` heads, their tensors on
    ``device``."""
    if variant == "relbias":
        same = torch.Generator().manual_seed(0)  # every peer gets the same table
        table = torch.randn(h, 2 * n - 1, generator=same) * 0.1
        table = table.to(device).requires_grad_(grad)

        def relative_bias(score, b, head, q_idx, kv_idx):
            return score + table[head, q_idx - kv_idx + n - 1]

        def dense(position):
            return table[:, position[:, None] - position + n - 1]

        return Mods(relative_bias, None, table, causal=True, dense_bias=dense)
    if variant == "alibi-mod":
        slopes = attnkit.alibi_slopes(h).to(device)

        def alibi(score, b, head, q_idx, kv_idx):
            return score - slopes[head] * (q_idx - kv_idx).abs()

        def dense_alibi(position):
            return -slopes[:, None, None] * (position[:, None] - position).abs()

        return Mods(alibi, None, slopes, causal=True, dense_bias=dense_alibi)
    if variant == "document":
        documents = torch.arange(n, device=device) * DOCUMENTS // n

        def same_document(b, head, q_idx, kv_idx):
            return documents[q_idx] == documents[kv_idx]

        return Mods(None, same_document, None, causal=True)
    if variant == "prefix-lm":
        prefix = n // 4

        def prefix_lm(b, head, q_idx, kv_idx):
            return (kv_idx < prefix) | (q_idx >= kv_idx)

        return Mods(None, prefix_lm, None, causal=False)
    raise ValueError(f"unknown variant {variant!r}")


def _with_causal(mask_mod: Callable | None, causal: bool) -> Callable | None:
    if not causal:
        return mask_mod
    if mask_mod is None:
        return lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    return lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx, kv_idx) & (q_idx >= kv_idx)


def kernel_fn(
    impl: str, variant: str, n: int, h: int, grad: bool, device: str = "cpu"
) -> tuple[Callable, list[Tensor]]:
    """The call that ``impl`` makes for ``variant``, and the tensors besides q, k, v that a
    backward trains (whose gradients are reset between runs)."""
    mods = build(variant, n, h, grad, device)
    trained = [mods.table] if mods.table is not None and mods.table.requires_grad else []
    if impl in ("naive", "torch-sdpa"):
        allowed = mods.allowed(n, device)

        def dense(q, k, v):
            bias = mods.bias(n, q.dtype, device)
            if impl == "torch-sdpa":
                mask = allowed if bias is None else bias.masked_fill(~allowed, -math.inf)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
            scores = scores if bias is None else scores + bias
            return torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1) @ v

        return dense, trained
    if impl == "flex-compiled":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mask_mod = _with_causal(mods.mask_mod, mods.causal)
        block_mask = create_block_mask(mask_mod, None, None, n, n, device=device)
        compiled = torch.compile(flex_attention, dynamic=False)
        return lambda q, k, v: compiled(q, k, v, mods.score_mod, block_mask), trained
    if impl == "attnkit-builtin":  # the built-in option that says the same, where there is one
        return (
            lambda q, k, v: attention(q, k, v, causal=True, alibi_slopes=mods.table),
            trained,
        )
    backend = impl.removeprefix("attnkit-")
    options = attention_options(mods, n, device)
    return lambda q, k, v: attention(q, k, v, backend=backend, **options), trained


def attention_options(mods: Mods, n: int, device: str = "cpu") -> dict:
    """What attnkit's ``attention`` takes for these functions: the causal part as ``causal=True``
    where no mask_mod is given, else in the block mask."""
    if mods.mask_mod is None:
        return {"causal": mods.causal, "score_mod": mods.score_mod}
    mask_mod = _with_causal(mods.mask_mod, mods.causal)
    block_mask = attnkit.create_block_mask(mask_mod, None, None, n, n, device=device)
    return {"score_mod": mods.score_mod, "block_mask": block_mask}


def supported(impl: str, variant: str) -> str | None:
    """Why ``impl`` has no case for ``variant``, or None."""
    if impl == "attnkit-builtin" and variant != "alibi-mod":
        return "n/a: no built-in option says the same"
    if impl in ("torch-sdpa-math", "attnkit-reference", "attnkit-tiled"):
        return "n/a: not measured for user functions (attnkit-auto runs the tiled loop)"
    return None
