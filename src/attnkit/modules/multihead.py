"""Multi-head attention: one projection for all heads, split heads, one attention call, an output
projection. Grouped-query (``num_kv_heads < num_heads``) and multi-query (``num_kv_heads = 1``)
attention share key/value heads between query heads.

Masks: True = may attend. ``key_mask`` ``(b, s)`` is True for a real token; ``attn_mask`` is bool or
a float added to the scores, broadcastable to ``(b, h, t, s)``. A causal mask for ``t != s`` aligns
bottom-right (see :mod:`attnkit.masks`).

Shapes: ``b`` batch, ``t`` query tokens, ``s`` key tokens, ``h`` heads, ``h_kv`` key/value heads,
``d`` head dim = ``d_out / h``, ``e`` embed width. Module boundaries are ``(b, t, e)``, the attention
call inside is ``(b, h, t, d)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnkit import _checks
from attnkit.functional import attention
from attnkit.masks import alibi_slopes
from attnkit.modules._common import (
    as_batched,
    merge_heads,
    module_softcap,
    module_window,
    split_heads,
    unbatch,
)


class ProjectedAttention(nn.Module):
    """Projections, head split, the attention call and the output projection, shared by
    :class:`MultiHeadAttention` (keys from the input itself) and
    :class:`~attnkit.CrossAttention` (keys from a memory)."""

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

    def _forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        causal: bool,
        key_mask: Tensor | None,
        attn_mask: Tensor | None,
        need_weights: bool,
        average_weights: bool,
        **score_options: Any,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``x`` ``(b, t, d_q)`` and ``memory`` ``(b, s, d_kv)``, already checked and batched;
        ``score_options`` go to :func:`attnkit.functional.attention` (window, ALiBi, softcap)."""
        queries = split_heads(self.W_query(x), self.num_heads)  # (b, t, e) -> (b, h, t, d)
        keys = split_heads(self.W_key(memory), self.num_kv_heads)  # (b, s, e) -> (b, h_kv, s, d)
        values = split_heads(self.W_value(memory), self.num_kv_heads)  # -> (b, h_kv, s, d)
        result = attention(
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
        out = self.out_proj(merge_heads(context))  # (b, h, t, d) -> (b, t, e) -> (b, t, e)
        if not need_weights:
            return out
        return out, weights.mean(dim=1) if average_weights else weights  # (b, t, s) | (b, h, t, s)


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
            (:func:`attnkit.alibi_slopes`).
        softcap: cap the scores smoothly to ``(-softcap, softcap)`` (Gemma 2 uses 50).
        out_bias: add a bias to the output projection.
        device, dtype: for the parameters.

    Raises:
        ValueError: ``d_out`` not divisible by ``num_heads``, ``num_heads`` not divisible by
            ``num_kv_heads``, or ``dropout`` outside ``[0, 1)``.

    Example:
        >>> mha = MultiHeadAttention(768, 768, 1024, 0.0, 12, num_kv_heads=4)  # GQA
        >>> mha(torch.randn(2, 10, 768)).shape
        torch.Size([2, 10, 768])
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
        self.causal = causal
        self.window = module_window(window, causal)
        self.softcap = module_softcap(softcap)
        slopes = alibi_slopes(num_heads).to(device) if alibi else None
        self.register_buffer("alibi_slopes", slopes, persistent=False)

    def forward(
        self,
        x: Tensor,
        *,
        key_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        need_weights: bool = False,
        average_weights: bool = True,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Args:
            x: ``(b, t, d_in)`` or unbatched ``(t, d_in)``.
            key_mask: ``(b, t)`` bool, True for a real token (padding False). From torch's
                ``key_padding_mask`` (True = padding): ``key_mask = ~key_padding_mask``.
            attn_mask: bool (True = may attend) or float (added to scores), broadcastable to
                ``(b, h, t, t)``; combined with the causal mask when ``causal``.
            need_weights: also return the softmax weights (before dropout).
            average_weights: average the weights over heads: ``(b, t, t)``, else ``(b, h, t, t)``.

        Returns:
            ``(b, t, d_out)``, or ``(output, weights)``.
        """
        x, unbatched = as_batched(x, "x", self.d_q, "d_in", self.W_query.weight)
        _checks.check_context_length(x.shape[1], self.context_length)
        if unbatched and key_mask is not None and key_mask.dim() == 1:
            key_mask = key_mask.unsqueeze(0)
        result = self._forward(
            x,
            x,
            causal=self.causal,
            key_mask=key_mask,
            attn_mask=attn_mask,
            need_weights=need_weights,
            average_weights=average_weights,
            window=self.window,
            alibi_slopes=self.alibi_slopes,
            softcap=self.softcap,
        )
        return unbatch(result, unbatched)

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
        for option in ("window", "alibi_slopes", "softcap"):
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
            f"alibi={self.alibi_slopes is not None}, softcap={self.softcap}, "
            f"context_length={self.context_length}, dropout={self.dropout}"
        )
