"""Encoder-decoder attention: queries from the decoder, keys and values from the encoder.

``CrossAttention`` is multi-head scaled dot-product attention over a memory; ``AdditiveAttention``
is Bahdanau's additive scoring ``v^T tanh(W_q q + W_k k)`` followed by the same softmax and weighted
sum ([`attnkit.attend`][attnkit.textbook.attend]).

Masks: ``key_mask`` ``(b, s)`` is True for a real encoder token, False for padding.

Shapes: ``b`` batch, ``t`` decoder tokens, ``s`` encoder tokens, ``h`` heads, ``e`` widths.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit import _checks
from attnkit.cache import KVCache
from attnkit.modules._common import as_batched, unbatch
from attnkit.modules.projected import ProjectedAttention
from attnkit.textbook import attend


def _check_memory(memory: Tensor, d_kv: int, like: Tensor, x: Tensor, unbatched: bool) -> Tensor:
    memory, memory_unbatched = as_batched(memory, "memory", d_kv, "d_kv", like)
    if memory_unbatched != unbatched or memory.shape[0] != x.shape[0]:
        raise ValueError(
            f"x and memory must both be batched with the same batch size or both unbatched, "
            f"got shapes {tuple(x.shape)} and {tuple(memory.shape)}"
        )
    return memory


class CrossAttention(ProjectedAttention):
    """Multi-head attention of decoder states ``x`` over encoder states ``memory``.

    Args:
        d_q: width of the decoder states (queries).
        d_kv: width of the encoder states (keys and values).
        d_out: output width, split evenly over the heads.
        num_heads: number of heads.
        dropout: dropout on the attention weights, in training mode only.
        qkv_bias: add a bias to the query, key and value projections.
        out_bias: add a bias to the output projection.
        device: where the parameters live.
        dtype: the parameters' dtype.

    Example:
        >>> cross = CrossAttention(32, 48, 64, 4)
        >>> cross(torch.randn(2, 5, 32), torch.randn(2, 9, 48)).shape
        torch.Size([2, 5, 64])
    """

    def __init__(
        self,
        d_q: int,
        d_kv: int,
        d_out: int,
        num_heads: int,
        *,
        dropout: float = 0.0,
        qkv_bias: bool = False,
        out_bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            d_q,
            d_kv,
            d_out,
            num_heads,
            num_kv_heads=None,
            dropout=dropout,
            qkv_bias=qkv_bias,
            out_bias=out_bias,
            device=device,
            dtype=dtype,
        )

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        cache: KVCache | None = None,
        key_mask: Tensor | None = None,
        need_weights: bool = False,
        average_weights: bool = True,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Args:
            x: ``(b, t, d_q)`` decoder states (or unbatched ``(t, d_q)``).
            memory: ``(b, s, d_kv)`` encoder states (or unbatched ``(s, d_kv)``).
            cache: a [`KVCache`][attnkit.cache.KVCache] (``num_heads`` key/value heads, ``max_len >= s``)
                for decoding: the first call projects ``memory`` into it, later calls reuse those
                keys and values and ignore ``memory`` and ``key_mask`` (which may then be None).
            key_mask: ``(b, s)`` bool, True for a real encoder token.
            need_weights: also return the weights: ``(b, t, s)`` averaged over heads when
                ``average_weights``, else ``(b, h, t, s)``.

        Returns:
            ``(b, t, d_out)``, or ``(output, weights)``.
        """
        x, unbatched = as_batched(x, "x", self.d_q, "d_q", self.W_query.weight)
        _checks.check_flag(need_weights, "need_weights")
        _checks.check_flag(average_weights, "average_weights")
        if cache is not None:
            self._check_cache(cache, x)
            if cache.window is not None:
                raise ValueError(
                    "cross-attention reads the whole memory: use a cache without window"
                )
            self._check_decoding(x, memory)
        step = cache is not None  # a cached decoding step: its projections fused
        if cache is not None and cache.size:
            queries = self._project_queries(x, step)
            keys, values = cache.get()
            key_mask = cache.key_mask
        else:
            if memory is None:
                first = (
                    " (the first call with an empty cache needs it)" if cache is not None else ""
                )
                raise ValueError(f"memory is required{first}")
            memory = _check_memory(memory, self.d_kv, self.W_key.weight, x, unbatched)
            if unbatched and key_mask is not None and key_mask.dim() == 1:
                key_mask = key_mask.unsqueeze(0)
            queries, keys, values = self._project(x, memory, step)
            if cache is not None:
                if key_mask is not None:
                    _checks.check_key_mask(key_mask, *memory.shape[:2], x.device)
                keys, values = cache.update(keys, values, key_mask=key_mask)
        result = self._attend(
            queries,
            keys,
            values,
            causal=False,
            key_mask=key_mask,
            attn_mask=None,
            need_weights=need_weights,
            average_weights=average_weights,
            step=step,
            **self._known_of(cache, keys),
        )
        return unbatch(result, unbatched)


class AdditiveAttention(nn.Module):
    """Bahdanau (additive) attention: ``score(q, k) = v^T tanh(W_q q + W_k k)``.

    Args:
        d_query: width of the decoder state.
        d_key: width of the encoder states.
        d_hidden: width of the hidden layer that scores each (query, key) pair.
        device: where the parameters live.
        dtype: the parameters' dtype.

    Example:
        >>> attn = AdditiveAttention(16, 8, 32)
        >>> context, weights = attn(torch.randn(2, 16), torch.randn(2, 7, 8))
        >>> context.shape, weights.shape
        (torch.Size([2, 8]), torch.Size([2, 7]))
    """

    def __init__(
        self,
        d_query: int,
        d_key: int,
        d_hidden: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for value, name in ((d_query, "d_query"), (d_key, "d_key"), (d_hidden, "d_hidden")):
            _checks.check_positive_int(value, name)
        _checks.check_module_dtype(dtype)
        factory = {"device": device, "dtype": dtype}
        self.d_query, self.d_key = d_query, d_key
        self.W_query = nn.Linear(d_query, d_hidden, bias=False, **factory)
        self.W_key = nn.Linear(d_key, d_hidden, bias=False, **factory)
        self.v = nn.Linear(d_hidden, 1, bias=False, **factory)

    def forward(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor | None = None,
        *,
        key_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Args:
            query: ``(b, d_query)`` one decoder step, or ``(b, t, d_query)`` several.
            keys: ``(b, s, d_key)`` encoder states.
            values: ``(b, s, d_v)``; None means ``keys``.
            key_mask: ``(b, s)`` bool, True for a real encoder token.

        Returns:
            ``(context, weights)``: ``(b, d_v)`` and ``(b, s)`` for one step, ``(b, t, d_v)`` and
            ``(b, t, s)`` for several.
        """
        _checks.check_tensor(query, "query")
        _checks.check_rank(query, "query", (2, 3), "(batch, d_query) or (batch, steps, d_query)")
        _checks.check_features(query, "query", self.d_query, "d_query")
        keys, keys_unbatched = as_batched(keys, "keys", self.d_key, "d_key", self.W_key.weight)
        values = keys if values is None else values
        _checks.check_tensor(values, "values")
        _checks.check_rank(values, "values", (3,), "(batch, keys, d_v)")
        b, s = keys.shape[:2]
        if keys_unbatched or query.shape[0] != b or values.shape[:2] != (b, s):
            raise ValueError(
                "query (b, [t,] d_query), keys (b, s, d_key) and values (b, s, d_v) must agree "
                f"in b and s, got {tuple(query.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}"
            )
        if key_mask is not None:
            _checks.check_key_mask(key_mask, b, s, query.device)

        steps = query.dim() == 3
        projected_query = self.W_query(query).unsqueeze(
            -2
        )  # (b, [t,] hidden) -> (b, [t,] 1, hidden)
        projected_keys = self.W_key(keys)  # (b, s, d_key) -> (b, s, hidden)
        if steps:
            projected_keys = projected_keys.unsqueeze(1)  # (b, 1, s, hidden): shared by the t steps
            values = values.unsqueeze(1)  # (b, 1, s, d_v)
            key_mask = None if key_mask is None else key_mask.unsqueeze(1)  # (b, 1, s)
        features = torch.tanh(projected_query + projected_keys)  # (b, [t,] s, hidden)
        attn_scores = self.v(features).squeeze(-1)  # (b, [t,] s, 1) -> (b, [t,] s)
        result = attend(attn_scores, values, mask=key_mask)
        return result.context, result.weights
