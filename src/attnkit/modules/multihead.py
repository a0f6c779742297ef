"""Multi-head attention: one projection for all heads, split heads, one attention call, an output
projection. Grouped-query (``num_kv_heads < num_heads``) and multi-query (``num_kv_heads = 1``)
attention share key/value heads between query heads.

Masks: True = may attend. ``key_mask`` ``(b, s)`` is True for a real token; ``attn_mask`` is bool or
a float added to the scores, broadcastable to ``(b, h, t, s)``. A causal mask for ``t != s`` aligns
bottom-right (see [`attnkit.masks`][attnkit.masks]).

Shapes: ``b`` batch, ``t`` query tokens, ``s`` key tokens, ``h`` heads, ``h_kv`` key/value heads,
``d`` head dim = ``d_out / h``, ``e`` embed width. Module boundaries are ``(b, t, e)``, the attention
call inside is ``(b, h, t, d)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask

from attnkit import _checks
from attnkit._tracing import traced
from attnkit.cache import KVCache
from attnkit.functional import attention
from attnkit.masks import alibi_slopes
from attnkit.mods import MaskMod, ScoreMod
from attnkit.modules import interop
from attnkit.modules._common import as_batched, module_softcap, module_window, unbatch
from attnkit.modules.projected import ProjectedAttention
from attnkit.positions import RotaryEmbedding, token_positions
from attnkit.varlen import document_mask

if TYPE_CHECKING:
    from attnkit.distributed import ContextParallel


class MultiHeadAttention(ProjectedAttention):
    """Multi-head self-attention with split heads and an output projection.

    Args:
        d_in: input width.
        d_out: output width, split evenly over the heads (``head_dim = d_out // num_heads``).
        context_length: the longest input accepted; None means no limit.
        dropout: dropout on the attention weights, in training mode only.
        num_heads: number of query heads.
        qkv_bias: add a bias to the query, key and value projections.
        causal: token ``i`` attends only to tokens ``0..i``.
        num_kv_heads: key/value heads (grouped-query attention); None means ``num_heads``.
        window: each token sees at most ``window`` positions: the last ones, itself included, when
            causal; centred on itself otherwise. None means no limit.
        alibi: add ALiBi's linear distance penalty with the standard slopes
            ([`attnkit.alibi_slopes`][attnkit.masks.alibi_slopes]).
        rope: rotary position embeddings on queries and keys: True for a
            [`RotaryEmbedding`][attnkit.positions.RotaryEmbedding] with base 10000 and ``max_len = context_length``
            (4096 when that is None), or a ``RotaryEmbedding`` of your own.
        softcap: cap the scores smoothly to ``(-softcap, softcap)`` (Gemma 2 uses 50).
        sinks: a learnable logit per head, zero at first, that joins every query's softmax
            denominator and brings no value (GPT-OSS's attention sinks), as ``self.sinks``.
        out_bias: add a bias to the output projection.
        device: where the parameters live.
        dtype: the parameters' dtype.

    Raises:
        ValueError: ``d_out`` not divisible by ``num_heads``, ``num_heads`` not divisible by
            ``num_kv_heads``, ``dropout`` outside ``[0, 1)``, or a ``rope`` of another head dim.

    Example:
        >>> mha = MultiHeadAttention(768, 768, 1024, 0.0, 12, num_kv_heads=4)  # GQA
        >>> mha(torch.randn(2, 10, 768)).shape
        torch.Size([2, 10, 768])

        Decoding with a cache: a prompt, then one token at a time.

        >>> mha = MultiHeadAttention(64, 64, 256, 0.0, 4, rope=True).eval()
        >>> cache = KVCache(1, mha.num_kv_heads, 256, mha.head_dim)
        >>> with torch.no_grad():  # a cache is for inference
        ...     out = mha(torch.randn(1, 10, 64), cache=cache)  # prefill
        ...     out = mha(torch.randn(1, 1, 64), cache=cache)  # the 11th token
        >>> cache.position
        11
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int | None,
        dropout: float,
        num_heads: int,
        *,
        qkv_bias: bool = False,
        causal: bool = True,
        num_kv_heads: int | None = None,
        window: int | None = None,
        alibi: bool = False,
        rope: bool | RotaryEmbedding = False,
        softcap: float | None = None,
        sinks: bool = False,
        out_bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            d_in,
            d_in,
            d_out,
            num_heads,
            num_kv_heads=num_kv_heads,
            dropout=dropout,
            qkv_bias=qkv_bias,
            out_bias=out_bias,
            device=device,
            dtype=dtype,
        )
        if context_length is not None:
            _checks.check_positive_int(context_length, "context_length")
        self.context_length = context_length
        self.causal = _checks.check_flag(causal, "causal")
        _checks.check_flag(alibi, "alibi")
        self.window = module_window(window, causal)
        self.softcap = module_softcap(softcap)
        slopes = alibi_slopes(num_heads).to(device) if alibi else None
        self.register_buffer("alibi_slopes", slopes, persistent=False)
        _checks.check_flag(sinks, "sinks")
        zeros = torch.zeros(num_heads, device=device, dtype=dtype) if sinks else None
        self.sinks = None if zeros is None else nn.Parameter(zeros)
        if rope is True:
            rope = RotaryEmbedding(self.head_dim, max_len=context_length or 4096, device=device)
        elif isinstance(rope, RotaryEmbedding):
            if rope.head_dim != self.head_dim:
                raise ValueError(
                    f"rope has head_dim {rope.head_dim} but this module's heads are "
                    f"{self.head_dim} wide (d_out // num_heads)"
                )
        elif rope is not False:
            raise TypeError(f"rope must be a bool or a RotaryEmbedding, got {type(rope).__name__}")
        self.rope = rope or None

    def forward(
        self,
        x: Tensor,
        *,
        cache: KVCache | None = None,
        key_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        need_weights: bool = False,
        average_weights: bool = True,
        score_mod: ScoreMod | None = None,
        mask_mod: MaskMod | None = None,
        block_mask: BlockMask | None = None,
        documents: Tensor | None = None,
        context_parallel: ContextParallel | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Args:
            x: ``(b, t, d_in)`` or unbatched ``(t, d_in)``.
            cache: a [`KVCache`][attnkit.cache.KVCache] of this layer (``num_kv_heads``, ``head_dim``) for
                decoding: the chunk ``x`` comes after the ``cache.position`` tokens it holds, and
                its keys and values are appended. Prefill in chunks of any size, then one token at
                a time. Causal modules only, without gradients (under ``torch.no_grad()``); under
                ``torch.compile`` a step compiles once (a cache without window; no ``attn_mask``
                or ``need_weights`` then).
            key_mask: ``(b, t)`` bool, True for a real token (padding False). From torch's
                ``key_padding_mask`` (True = padding): ``key_mask = ~key_padding_mask``. With a
                cache, the mask of this chunk (left padding of ragged prompts); the cache keeps it.
            attn_mask: bool (True = may attend) or float (added to scores), broadcastable to
                ``(b, h, t, s)``, ``s`` the keys attended (``t``, or the cache's); combined with the
                causal mask when ``causal``.
            need_weights: also return the softmax weights (before dropout).
            average_weights: average the weights over heads: ``(b, t, s)``, else ``(b, h, t, s)``.
            score_mod: ``score_mod(score, b, h, q_idx, kv_idx)`` (see
                [`attnkit.mods`][attnkit.mods]), after this module's ALiBi and soft-capping. With
                a cache, ``q_idx`` and ``kv_idx`` are the tokens' positions in the sequence: the
                cached tokens come first.
            mask_mod: ``mask_mod(b, h, q_idx, kv_idx)``, with the same positions; combined with
                the causal mask and the window.
            block_mask: a ``BlockMask`` for ``(t, t)`` (without a cache).
            documents: ``(t,)`` document ids of packed sequences (each document contiguous): no
                token sees another document's (without a cache;
                [`attnkit.document_mask`][attnkit.varlen.document_mask]).
            context_parallel: a [`ContextParallel`][attnkit.distributed.ContextParallel]: ``x`` is
                this rank's shard of a sequence split over a process group, and the output is its
                shard of the whole sequence's output (ring attention; RoPE at the tokens' global
                positions; ``key_mask`` and ``score_mod``/``mask_mod`` as
                [`ring_attention`][attnkit.distributed.ring_attention] takes them). Without a cache,
                ``attn_mask``, weights, dropout (``eval()``), block masks or ``documents``.

        Returns:
            ``(b, t, d_out)``, or ``(output, weights)``.
        """
        x, unbatched = as_batched(x, "x", self.d_q, "d_in", self._modules["W_query"].weight)
        if type(need_weights) is not bool or type(average_weights) is not bool:  # say which
            _checks.check_flag(need_weights, "need_weights")
            _checks.check_flag(average_weights, "average_weights")
        b, t, _ = x.shape
        if unbatched and key_mask is not None and key_mask.dim() == 1:
            key_mask = key_mask.unsqueeze(0)
        if key_mask is not None:
            _checks.check_key_mask(key_mask, b, t, x.device)
        if cache is not None or context_parallel is not None:
            self._check_mode(x, cache, context_parallel, documents, attn_mask, need_weights)
        elif self.context_length is not None and t > self.context_length:
            _checks.check_context_length(t, self.context_length)
        step = cache is not None  # a cached decoding step: its projections fused
        queries, keys, values = self._project(x, x, step)
        if self.rope is not None:
            positions = self._positions(t, key_mask, cache, context_parallel, x.device)
            queries, keys = self.rope(queries, positions), self.rope(keys, positions)
        mods = {"score_mod": score_mod, "mask_mod": mask_mod, "block_mask": block_mask}
        if documents is not None or block_mask is not None:
            mods = _mods_of(score_mod, mask_mod, block_mask, documents, cache, x.device)
        layer = {"attn_mask": attn_mask, "window": self.window, "alibi_slopes": self.alibi_slopes}
        if cache is None:
            options = {"causal": self.causal, "key_mask": key_mask, **layer, **mods}
        else:  # the chunk joins the cache; its queries attend to what the cache gives back
            keys, values, options = cache.step(
                keys,
                values,
                key_mask=key_mask,
                score_mod=score_mod,
                mask_mod=mask_mod,
                context_length=self.context_length,
                **layer,
            )
        result = self._attend(
            queries,
            keys,
            values,
            need_weights=need_weights,
            average_weights=average_weights,
            sinks=self.sinks,
            softcap=self.softcap,
            attend=attention if context_parallel is None else context_parallel.attention,
            step=step,
            **options,
        )
        return unbatch(result, unbatched) if unbatched else result

    def _check_mode(self, x, cache, context_parallel, documents, attn_mask, need_weights) -> None:
        """Check what this call's mode allows: a whole sequence, a cached step (compiled or not)
        or a shard of a sequence split across ranks."""
        t = x.shape[1]
        if context_parallel is not None:  # t tokens a rank
            whole = t * context_parallel.size()
            _checks.check_context_length(whole, self.context_length, "the whole sequence")
            if cache is not None or documents is not None:
                raise ValueError(
                    "context_parallel takes no cache (it is for whole sequences) and no "
                    "documents (give a mask_mod with the documents of the whole sequence)"
                )
        elif cache is None:
            _checks.check_context_length(t, self.context_length)
        else:
            self._check_cache(cache, x)
            if need_weights and traced():
                raise ValueError(
                    "need_weights cannot be used with a KVCache under torch.compile: a compiled "
                    "step attends over the cache's whole buffer, whose length is not the keys held"
                )

    @staticmethod
    def _positions(t, key_mask, cache, context_parallel, device) -> Tensor:
        """The rotary positions of this call's tokens."""
        if context_parallel is not None:
            return context_parallel.positions(t, device)
        if cache is None:
            return token_positions(t, key_mask, device=device)
        return cache.next_positions(t, key_mask)

    def _check_cache(self, cache: KVCache, x: Tensor) -> None:
        super()._check_cache(cache, x)
        if not self.causal:
            raise ValueError(
                "a KV cache needs a causal module: with causal=False earlier tokens would have "
                "attended to later ones"
            )
        if cache.window is not None and (self.window is None or self.window[0] > cache.window - 1):
            needed = "every position" if self.window is None else f"window={self.window[0] + 1}"
            raise ValueError(
                f"the cache keeps a window of {cache.window} positions but this module needs "
                f"{needed}; build the cache with window=None or a larger window"
            )
        self._check_decoding(x)

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> MultiHeadAttention:
        """An equivalent non-causal module from a ``torch.nn.MultiheadAttention``
        ([`attnkit.modules.interop.from_torch`][attnkit.modules.interop.from_torch])."""
        return interop.from_torch(cls, m)

    def to_torch(self) -> nn.MultiheadAttention:
        """The equivalent ``torch.nn.MultiheadAttention``, ``batch_first=True``
        ([`attnkit.modules.interop.to_torch`][attnkit.modules.interop.to_torch])."""
        return interop.to_torch(self)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, causal={self.causal}, window={self.window}, "
            f"alibi={self.alibi_slopes is not None}, rope={self.rope is not None}, "
            f"softcap={self.softcap}, sinks={self.sinks is not None}, "
            f"context_length={self.context_length}, dropout={self.dropout}"
        )


def _mods_of(score_mod, mask_mod, block_mask, documents, cache, device) -> dict[str, Any]:
    """The call's score and mask functions, with ``documents`` as a block mask."""
    mods = {"score_mod": score_mod, "mask_mod": mask_mod, "block_mask": block_mask}
    if documents is not None:
        if block_mask is not None or mask_mod is not None:
            raise ValueError("give documents, mask_mod or block_mask, one of them")
        mods["block_mask"] = document_mask(documents, device=device)
    if cache is not None and (block_mask is not None or documents is not None):
        raise ValueError(
            "with a cache, give mask_mod (evaluated at the cached positions), not block_mask "
            "or documents"
        )
    return mods
