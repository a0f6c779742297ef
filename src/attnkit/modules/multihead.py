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

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask

from attnkit import _checks
from attnkit.block_mask import document_mask
from attnkit.cache import KVCache, token_positions
from attnkit.functional import attention
from attnkit.masks import alibi_bias, alibi_slopes, window_mask
from attnkit.mods import MaskMod, ScoreMod, at_positions
from attnkit.modules._common import (
    as_batched,
    merge_heads,
    module_softcap,
    module_window,
    project,
    project_all,
    split_heads,
    unbatch,
)
from attnkit.positions import RotaryEmbedding

if TYPE_CHECKING:
    from attnkit.distributed import ContextParallel


class ProjectedAttention(nn.Module):
    """Projections, head split, the attention call and the output projection, shared by
    [`MultiHeadAttention`][attnkit.modules.multihead.MultiHeadAttention] (keys from the input itself) and
    [`CrossAttention`][attnkit.modules.cross.CrossAttention] (keys from a memory)."""

    def __init__(
        self,
        d_q: int,
        d_kv: int,
        d_out: int,
        num_heads: int,
        *,
        num_kv_heads: int | None,
        dropout: float,
        qkv_bias: bool,
        out_bias: bool,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        for value, name in (
            (d_q, "d_in"),
            (d_kv, "d_kv"),
            (d_out, "d_out"),
            (num_heads, "num_heads"),
        ):
            _checks.check_positive_int(value, name)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        _checks.check_positive_int(num_kv_heads, "num_kv_heads")
        _checks.check_module_dtype(dtype)
        _checks.check_flag(qkv_bias, "qkv_bias")
        _checks.check_flag(out_bias, "out_bias")
        _checks.check_divisible(d_out, "d_out", num_heads, "num_heads")
        _checks.check_divisible(num_heads, "num_heads", num_kv_heads, "num_kv_heads")
        self.d_q, self.d_kv, self.d_out = d_q, d_kv, d_out
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = d_out // num_heads
        self.dropout = _checks.check_probability(dropout, "dropout")
        factory = {"device": device, "dtype": dtype}
        kv_width = num_kv_heads * self.head_dim
        self.W_query = nn.Linear(d_q, d_out, bias=qkv_bias, **factory)
        self.W_key = nn.Linear(d_kv, kv_width, bias=qkv_bias, **factory)
        self.W_value = nn.Linear(d_kv, kv_width, bias=qkv_bias, **factory)
        self.out_proj = nn.Linear(d_out, d_out, bias=out_bias, **factory)

    # The projections are read from self._modules: on Python 3.11, self.W_query first fails as an
    # attribute, raising and catching an AttributeError, before nn.Module.__getattr__ finds it
    # (about 10k instructions a lookup; a decoding step made 9 such lookups, a tenth of its Python).

    def _project_queries(self, x: Tensor) -> Tensor:
        # (b, t, e) -> (b, h, t, d)
        return split_heads(project(self._modules["W_query"], x), self.num_heads)

    def _project(self, x: Tensor, memory: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries ``(b, h, t, d)`` from ``x`` ``(b, t, d_q)``; keys and values ``(b, h_kv, s, d)``
        from ``memory`` ``(b, s, d_kv)``."""
        if x is memory:  # self-attention: the three projections of x in one call
            layers = self._modules
            q, k, v = project_all((layers["W_query"], layers["W_key"], layers["W_value"]), x)
            queries = split_heads(q, self.num_heads)  # (b, t, e) -> (b, h, t, d)
        else:
            queries = self._project_queries(x)
            k, v = project_all((self._modules["W_key"], self._modules["W_value"]), memory)
        # (b, s, e) -> (b, h_kv, s, d)
        return queries, split_heads(k, self.num_kv_heads), split_heads(v, self.num_kv_heads)

    def _attend(
        self,
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        *,
        causal: bool,
        key_mask: Tensor | None,
        attn_mask: Tensor | None,
        need_weights: bool,
        average_weights: bool,
        attend: Callable = attention,
        **score_options: Any,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The attention call and the output projection; ``score_options`` go to
        [`attnkit.functional.attention`][attnkit.functional.attention] (window, ALiBi, softcap),
        or to ``attend``, a function with its signature (ring attention)."""
        result = attend(
            queries,
            keys,
            values,
            attn_mask=attn_mask,
            key_mask=key_mask,
            causal=causal,
            dropout_p=self.dropout if self.training else 0.0,
            return_weights=need_weights,
            **score_options,
        )
        context, weights = result if need_weights else (result, None)
        # (b, h, t, d) -> (b, t, e) -> (b, t, e)
        out = project(self._modules["out_proj"], merge_heads(context))
        if not need_weights:
            return out
        return out, weights.mean(dim=1) if average_weights else weights  # (b, t, s) | (b, h, t, s)

    def _check_cache(self, cache: KVCache, x: Tensor) -> None:
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be an attnkit.KVCache, got {type(cache).__name__}")
        got = (cache.batch_size, cache.num_kv_heads, cache.head_dim)
        want = (x.shape[0], self.num_kv_heads, self.head_dim)
        if got != want:
            raise ValueError(
                f"cache has (batch_size, num_kv_heads, head_dim) = {got}, but this call needs {want}"
            )

    def _check_decoding(self, x: Tensor, memory: Tensor | None = None) -> None:
        """A cache is for inference, outside tracing: say so before torch fails obscurely."""
        if torch.jit.is_tracing():
            raise ValueError(
                "a KVCache cannot be traced with torch.jit.trace: the trace would freeze the "
                "cache's position at the traced call; trace the module without a cache, or use "
                "torch.compile for cached decoding"
            )
        inputs = (x,) if memory is None else (x, memory)
        if torch.is_grad_enabled() and any(
            t.requires_grad for t in (*inputs, *self.parameters()) if isinstance(t, Tensor)
        ):
            raise ValueError(
                "a KVCache stores keys and values without gradients, and overwrites what a "
                "backward would need: decode under torch.no_grad() or torch.inference_mode(), "
                "or train without a cache"
            )


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
                [`attnkit.document_mask`][attnkit.block_mask.document_mask]).
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
        _checks.check_flag(need_weights, "need_weights")
        _checks.check_flag(average_weights, "average_weights")
        b, t, _ = x.shape
        if unbatched and key_mask is not None and key_mask.dim() == 1:
            key_mask = key_mask.unsqueeze(0)
        if key_mask is not None:
            _checks.check_key_mask(key_mask, b, t, x.device)
        compiling = torch.compiler.is_compiling()
        if context_parallel is not None:  # t tokens a rank
            whole = t * context_parallel.size()
            _checks.check_context_length(whole, self.context_length, "the whole sequence")
        elif cache is None:
            _checks.check_context_length(t, self.context_length)
        else:
            self._check_cache(cache, x)
            if compiling:
                self._check_compiled_step(attn_mask, need_weights)
            else:  # the position is a Python int, which a compiled step must not read
                _checks.check_context_length(cache.position + t, self.context_length, "cache + x")
        if context_parallel is not None and (cache is not None or documents is not None):
            raise ValueError(
                "context_parallel takes no cache (it is for whole sequences) and no documents "
                "(give a mask_mod with the documents of the whole sequence)"
            )
        queries, keys, values = self._project(x, x)
        if self.rope is not None:
            if context_parallel is not None:
                positions = context_parallel.positions(t, x.device)
            elif cache is None:
                positions = token_positions(t, key_mask, device=x.device)
            else:
                positions = cache.next_positions(t, key_mask)
            queries, keys = self.rope(queries, positions), self.rope(keys, positions)
        mods = {"score_mod": score_mod, "mask_mod": mask_mod, "block_mask": block_mask}
        if documents is not None:
            if block_mask is not None or mask_mod is not None:
                raise ValueError("give documents, mask_mod or block_mask, one of them")
            mods["block_mask"] = document_mask(documents, device=x.device)
        if cache is not None and (block_mask is not None or documents is not None):
            raise ValueError(
                "with a cache, give mask_mod (evaluated at the cached positions), not block_mask "
                "or documents"
            )
        if cache is not None and compiling:
            if score_mod is not None or mask_mod is not None:
                raise ValueError("a compiled cached step takes no score_mod or mask_mod")
            return unbatch(self._compiled_step(queries, keys, values, cache, key_mask), unbatched)
        if cache is not None:
            keys, values = cache.update(keys, values, key_mask=key_mask)
            key_mask = None if cache.key_mask is None else cache.key_mask[:, -keys.shape[2] :]
            mods = at_positions(mods, cache.position - t, cache.position - keys.shape[2])
        result = self._attend(
            queries,
            keys,
            values,
            causal=self.causal,
            key_mask=key_mask,
            attn_mask=attn_mask,
            need_weights=need_weights,
            average_weights=average_weights,
            window=self.window,
            alibi_slopes=self.alibi_slopes,
            softcap=self.softcap,
            attend=attention if context_parallel is None else context_parallel.attention,
            **mods,
        )
        return unbatch(result, unbatched)

    def _compiled_step(
        self, queries: Tensor, keys: Tensor, values: Tensor, cache: KVCache, key_mask: Tensor | None
    ) -> Tensor:
        """A cached step under ``torch.compile``. No Python int may change from one token to the
        next (each value would compile anew), so the step attends over the cache's whole buffers
        ([`KVCache.update_static`][attnkit.cache.KVCache.update_static]), with the empty slots and the positions masked from the
        ``(t,)`` slots of the queries: its shapes never change and it compiles once."""
        t = queries.shape[2]
        slots = cache.next_slots(t)  # where this chunk goes: the queries' positions
        if self.context_length is not None:  # check_context_length, on the tensor
            torch._assert_async(
                slots[-1] < self.context_length,
                f"cache + x is longer than context_length ({self.context_length})",
            )
        keys, values, real = cache.update_static(keys, values, key_mask=key_mask)
        capacity = keys.shape[2]
        window = (-1, 0) if self.window is None else self.window  # a cached module is causal
        allowed = window_mask(t, capacity, window, device=keys.device, query_slots=slots)
        attn_mask = allowed & real[:, None, None, :]  # (t, C) & (b, 1, 1, C) -> (b, 1, t, C)
        if self.alibi_slopes is not None:
            bias = alibi_bias(self.alibi_slopes, t, capacity, query_slots=slots)  # (h, t, C)
            attn_mask = bias.to(queries.dtype).masked_fill(~attn_mask, float("-inf"))
        return self._attend(
            queries,
            keys,
            values,
            causal=False,
            key_mask=None,
            attn_mask=attn_mask,
            need_weights=False,
            average_weights=False,
            softcap=self.softcap,
        )

    @staticmethod
    def _check_compiled_step(attn_mask: Tensor | None, need_weights: bool) -> None:
        for used, name in ((attn_mask is not None, "attn_mask"), (need_weights, "need_weights")):
            if used:
                raise ValueError(
                    f"{name} cannot be used with a KVCache under torch.compile: a compiled step "
                    "attends over the cache's whole buffer, whose length is not the keys held"
                )

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
        """An equivalent non-causal module from a ``torch.nn.MultiheadAttention``.

        attnkit is always ``(b, t, e)``: with ``batch_first=False`` transpose the inputs. torch's
        ``key_padding_mask`` (True = padding) becomes ``key_mask=~key_padding_mask``, and a bool
        ``attn_mask`` (True = masked) becomes ``attn_mask=~attn_mask``.

        Raises:
            TypeError: ``m`` is not an ``nn.MultiheadAttention``.
            ValueError: ``m`` uses an option attnkit cannot represent (``add_bias_kv``,
                ``add_zero_attn``, ``kdim``/``vdim`` different from ``embed_dim``).
        """
        if not isinstance(m, nn.MultiheadAttention):
            raise TypeError(f"m must be a torch.nn.MultiheadAttention, got {type(m).__name__}")
        if not m._qkv_same_embed_dim:
            raise ValueError(
                f"kdim/vdim ({m.kdim}/{m.vdim}) different from embed_dim ({m.embed_dim}) "
                "is not supported"
            )
        if m.bias_k is not None:
            raise ValueError("add_bias_kv=True is not supported")
        if m.add_zero_attn:
            raise ValueError("add_zero_attn=True is not supported")
        e = m.embed_dim
        w = m.in_proj_weight
        module = cls(
            e,
            e,
            None,
            m.dropout,
            m.num_heads,
            qkv_bias=m.in_proj_bias is not None,
            causal=False,
            out_bias=m.out_proj.bias is not None,
            device=w.device,
            dtype=w.dtype,
        )
        with torch.no_grad():
            for i, linear in enumerate((module.W_query, module.W_key, module.W_value)):
                linear.weight.copy_(w[i * e : (i + 1) * e])  # in_proj_weight is (3e, e): q, k, v
                if m.in_proj_bias is not None:
                    linear.bias.copy_(m.in_proj_bias[i * e : (i + 1) * e])
            module.out_proj.load_state_dict(m.out_proj.state_dict())
        return module

    def to_torch(self) -> nn.MultiheadAttention:
        """The equivalent ``torch.nn.MultiheadAttention`` (``batch_first=True``).

        Raises:
            ValueError: this module uses something torch's cannot represent: ``causal`` (pass
                ``is_causal``/``attn_mask`` at call time instead), grouped-query attention,
                ``d_in != d_out``, or a bias on the q/k/v projections but not the output (or the
                reverse).
        """
        if self.causal:
            raise ValueError(
                "causal=True cannot be stored in nn.MultiheadAttention; build with causal=False "
                "and pass a causal attn_mask when calling it"
            )
        for option in ("window", "alibi_slopes", "rope", "softcap"):
            if getattr(self, option) is not None:
                raise ValueError(f"{option} has no counterpart in nn.MultiheadAttention")
        if self.num_kv_heads != self.num_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) != num_heads ({self.num_heads}): "
                "nn.MultiheadAttention has no grouped-query attention"
            )
        if self.d_q != self.d_out:
            raise ValueError(f"d_in ({self.d_q}) != d_out ({self.d_out}) is not supported")
        qkv_bias = self.W_query.bias is not None
        if qkv_bias != (self.out_proj.bias is not None):
            raise ValueError(
                f"qkv_bias ({qkv_bias}) and out_bias ({self.out_proj.bias is not None}) differ; "
                "nn.MultiheadAttention has one bias flag for both"
            )
        w = self.W_query.weight
        m = nn.MultiheadAttention(
            self.d_out,
            self.num_heads,
            dropout=self.dropout,
            bias=qkv_bias,
            batch_first=True,
            device=w.device,
            dtype=w.dtype,
        )
        linears = (self.W_query, self.W_key, self.W_value)
        with torch.no_grad():
            m.in_proj_weight.copy_(torch.cat([lin.weight for lin in linears]))
            if qkv_bias:
                m.in_proj_bias.copy_(torch.cat([lin.bias for lin in linears]))
            m.out_proj.load_state_dict(self.out_proj.state_dict())
        return m

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, causal={self.causal}, window={self.window}, "
            f"alibi={self.alibi_slopes is not None}, rope={self.rope is not None}, "
            f"softcap={self.softcap}, "
            f"context_length={self.context_length}, dropout={self.dropout}"
        )
