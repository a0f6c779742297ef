"""Single-head attention with trainable weights, step by step as the chapter builds it.

``SelfAttention`` adds trainable ``W_q, W_k, W_v`` and the ``1/sqrt(d_out)`` scaling;
``CausalAttention`` adds the causal mask and dropout; ``MultiHeadAttentionWrapper`` stacks
independent causal heads. All of them compute through [`attnkit.functional.attention`][attnkit.functional.attention].

Masks use one convention everywhere: True = may attend. Causal means token ``i`` attends to tokens
``0..i``.

Shapes: ``b`` batch, ``t`` tokens, ``e`` = ``d_in`` input width, ``d_out`` output width per head,
``h`` heads. Inputs are ``(b, t, d_in)`` (or unbatched ``(t, d_in)``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit import _checks
from attnkit.functional import attention
from attnkit.masks import alibi_slopes
from attnkit.modules._common import as_batched, module_softcap, module_window
from attnkit.textbook import AttentionResult


class SelfAttention(nn.Module):
    """Self-attention with trainable query, key and value projections (one head).

    ``queries = x W_q``, ``keys = x W_k``, ``values = x W_v``; ``weights = softmax(queries keys^T *
    scale)``; ``context = weights values``, with ``scale = 1/sqrt(d_out)``.

    Args:
        d_in: input width ``e``.
        d_out: width of the queries, keys, values and of the output.
        qkv_bias: add a bias to the three projections.
        window: each token sees at most ``window`` positions: the last ones, itself included, when
            causal; centred on itself otherwise. None means no limit.
        alibi: add ALiBi's linear distance penalty (slope ``1/256`` for a single head).
        softcap: cap the scores smoothly to ``(-softcap, softcap)``.
        device: where the parameters live, as in torch's own modules.
        dtype: the parameters' dtype, as in torch's own modules.

    Example:
        >>> attn = SelfAttention(3, 2)
        >>> attn(torch.randn(1, 6, 3)).shape
        torch.Size([1, 6, 2])
    """

    # What the subclasses change: the chapter's next steps.
    causal: bool = False
    context_length: int | None = None
    dropout: float = 0.0

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        qkv_bias: bool = False,
        window: int | None = None,
        alibi: bool = False,
        softcap: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _checks.check_positive_int(d_in, "d_in")
        _checks.check_positive_int(d_out, "d_out")
        _checks.check_module_dtype(dtype)
        factory = {"device": device, "dtype": dtype}
        self.d_in, self.d_out = d_in, d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias, **factory)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias, **factory)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias, **factory)
        self.scale = d_out**-0.5
        self.window = module_window(window, self.causal)
        self.softcap = module_softcap(softcap)
        slopes = alibi_slopes(1).to(device) if alibi else None
        self.register_buffer("alibi_slopes", slopes, persistent=False)

    @classmethod
    def from_matrices(
        cls, W_q: Tensor, W_k: Tensor, W_v: Tensor, *, scale: float | None = None
    ) -> SelfAttention:
        """Build the module from explicit ``(d_in, d_out)`` matrices, used as ``x @ W``.

        Args:
            W_q: the query projection, ``(d_in, d_out)``.
            W_k: the key projection, ``(d_in, d_out)``.
            W_v: the value projection, ``(d_in, d_out)``.
            scale: multiplies the scores; None means ``1/sqrt(d_out)``, ``1.0`` leaves them unscaled.
        """
        for name, W in (("W_q", W_q), ("W_k", W_k), ("W_v", W_v)):
            _checks.check_tensor(W, name)
            _checks.check_rank(W, name, (2,), "(d_in, d_out)")
        if not W_q.shape == W_k.shape == W_v.shape:
            raise ValueError(
                "W_q, W_k and W_v must have the same shape (d_in, d_out), got "
                f"{tuple(W_q.shape)}, {tuple(W_k.shape)} and {tuple(W_v.shape)}"
            )
        dtype = W_q.dtype if W_q.is_floating_point() else torch.get_default_dtype()
        module = cls(*W_q.shape, device=W_q.device, dtype=dtype)
        with torch.no_grad():
            for linear, W in ((module.W_query, W_q), (module.W_key, W_k), (module.W_value, W_v)):
                linear.weight.copy_(W.T)  # nn.Linear computes x @ weight^T
        if scale is not None:
            module.scale = _checks.check_positive_number(scale, "scale")
        return module

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, bool]:
        x, unbatched = as_batched(x, "x", self.d_in, "d_in", self.W_query.weight)
        _checks.check_context_length(x.shape[1], self.context_length)
        # (b, t, d_in) -> (b, t, d_out) -> (b, 1, t, d_out): a single head
        queries, keys, values = (
            W(x).unsqueeze(1) for W in (self.W_query, self.W_key, self.W_value)
        )
        return queries, keys, values, unbatched

    def _attend(self, queries: Tensor, keys: Tensor, values: Tensor, need_weights: bool):
        return attention(
            queries,
            keys,
            values,
            causal=self.causal,
            window=self.window,
            alibi_slopes=self.alibi_slopes,
            softcap=self.softcap,
            scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            return_weights=need_weights,
        )

    def forward(self, x: Tensor, *, need_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Args:
            x: ``(b, t, d_in)`` or ``(t, d_in)``.
            need_weights: also return the weights ``(b, t, t)``, before dropout.

        Returns:
            The context ``(b, t, d_out)``, or ``(context, weights)``.
        """
        _checks.check_flag(need_weights, "need_weights")
        queries, keys, values, unbatched = self._project(x)
        result = self._attend(queries, keys, values, need_weights)
        out, weights = result if need_weights else (result, None)
        out = out.squeeze(1)  # (b, 1, t, d_out) -> (b, t, d_out)
        if unbatched:
            out = out.squeeze(0)
        if not need_weights:
            return out
        weights = weights.squeeze(1)  # (b, 1, t, t) -> (b, t, t)
        return out, weights.squeeze(0) if unbatched else weights

    def trace(self, x: Tensor) -> AttentionResult:
        """Run the forward pass and keep every step: queries, keys, values, the raw scores
        ``queries @ keys^T`` (before scaling and masking), the weights and the context."""
        queries, keys, values, unbatched = self._project(x)
        context, weights = self._attend(queries, keys, values, need_weights=True)
        attn_scores = queries @ keys.transpose(
            -2, -1
        )  # (b, 1, t, d) x (b, 1, d, t) -> (b, 1, t, t)
        steps = (queries, keys, values, attn_scores, weights, context)
        steps = [s.squeeze(1).squeeze(0) if unbatched else s.squeeze(1) for s in steps]
        queries, keys, values, attn_scores, weights, context = steps
        return AttentionResult(attn_scores, weights, context, queries, keys, values)

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}, scale={self.scale:.4g}"


class CausalAttention(SelfAttention):
    """Single-head self-attention where token ``i`` sees only tokens ``0..i``, with dropout.

    Args:
        d_in: input width.
        d_out: output width.
        context_length: the longest input accepted.
        dropout: dropout probability on the attention weights, in training mode only.
        qkv_bias: add a bias to the three projections.
        window: as in [`SelfAttention`][attnkit.modules.single.SelfAttention].
        alibi: likewise.
        softcap: likewise.
        device: where the parameters live.
        dtype: the parameters' dtype.
    """

    causal = True

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float = 0.0,
        *,
        qkv_bias: bool = False,
        window: int | None = None,
        alibi: bool = False,
        softcap: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            d_in,
            d_out,
            qkv_bias=qkv_bias,
            window=window,
            alibi=alibi,
            softcap=softcap,
            device=device,
            dtype=dtype,
        )
        _checks.check_positive_int(context_length, "context_length")
        self.context_length = context_length
        self.dropout = _checks.check_probability(dropout, "dropout")

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, context_length={self.context_length}, dropout={self.dropout}"
        )


class MultiHeadAttentionWrapper(nn.Module):
    """Multi-head attention as ``num_heads`` independent [`CausalAttention`][attnkit.modules.single.CausalAttention] heads whose outputs
    are concatenated: output width ``num_heads * d_out``. [`MultiHeadAttention`][attnkit.modules.multihead.MultiHeadAttention] is the
    efficient version (one projection for all heads, and an output projection).

    Args:
        d_in: input width.
        d_out: output width of each head.
        context_length: the longest input accepted.
        dropout: dropout on the attention weights, in training mode only.
        num_heads: number of heads.
        qkv_bias: add a bias to the projections.
        device: where the parameters live.
        dtype: the parameters' dtype.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        *,
        qkv_bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _checks.check_positive_int(num_heads, "num_heads")
        self.heads = nn.ModuleList(
            CausalAttention(
                d_in, d_out, context_length, dropout, qkv_bias=qkv_bias, device=device, dtype=dtype
            )
            for _ in range(num_heads)
        )

    def forward(
        self, x: Tensor, *, need_weights: bool = False, average_weights: bool = True
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Args:
            x: ``(b, t, d_in)`` or ``(t, d_in)``.
            need_weights: also return the weights: ``(b, t, t)`` averaged over heads when
                ``average_weights``, else ``(b, h, t, t)``.

        Returns:
            ``(b, t, h * d_out)``, or ``(output, weights)``.
        """
        if not need_weights:
            return torch.cat([head(x) for head in self.heads], dim=-1)
        outs, weights = zip(*(head(x, need_weights=True) for head in self.heads))
        stacked = torch.stack(weights, dim=-3)  # h x (b, t, t) -> (b, h, t, t)
        return torch.cat(outs, dim=-1), stacked.mean(dim=-3) if average_weights else stacked
