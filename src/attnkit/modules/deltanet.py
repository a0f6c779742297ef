"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5: projections and gates around
one call to [`gated_delta_rule`][attnkit.linear.functional.gated_delta_rule], as the book's bonus
chapter writes it, in transformers' layout.

From each token the layer makes a query, a key and a value per head, a write strength ``beta``
(a sigmoid, one per value head), a decay ``g = -exp(A_log) * softplus(W_alpha x + dt_bias)``
(one per value head, ``<= 0``), and an output gate. The delta rule runs on the L2-normalised
queries and keys; its output is RMS-normalised per head, multiplied by ``silu(gate)`` and
projected. The book's bonus writes one ``beta`` per channel for simplicity; the models (and
transformers, and this layer) have one per head. Qwen3-Next's short causal convolution over the
queries', keys' and values' channels is an option (``conv_size``).

Shapes: ``b`` batch, ``t`` tokens, ``h`` value heads, ``h_k`` query/key heads, ``d_k``/``d_v``
head dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import _checks
from attnkit.linear import gated_delta_rule
from attnkit.state_cache import StateCache


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet: linear attention with the gated delta rule.

    Args:
        d_in: input width.
        d_out: output width, ``num_heads * d_v``.
        num_heads: value heads ``h``.
        num_key_heads: query/key heads ``h_k`` (default ``h``; ``h`` must be a multiple: each
            query/key head is read by ``h / h_k`` value heads, Qwen3.5's layout).
        key_head_dim: ``d_k`` (default ``d_v``).
        conv_size: the width of a short causal convolution (with SiLU) over the queries', keys'
            and values' channels before the heads, as in Qwen3-Next (4 there); None: none, as the
            book's bonus writes it.
        dropout: on the layer's output before ``out_proj``, in training mode only.
        qkv_bias: biases on ``W_query``, ``W_key`` and ``W_value``.
        norm_eps: the RMS norm's epsilon.

    Example:
        >>> layer = GatedDeltaNet(64, 64, num_heads=4)
        >>> layer(torch.randn(2, 10, 64)).shape
        torch.Size([2, 10, 64])
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        num_heads: int,
        *,
        num_key_heads: int | None = None,
        key_head_dim: int | None = None,
        conv_size: int | None = None,
        dropout: float = 0.0,
        qkv_bias: bool = False,
        norm_eps: float = 1e-6,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for value, name in ((d_in, "d_in"), (d_out, "d_out"), (num_heads, "num_heads")):
            _checks.check_positive_int(value, name)
        if d_out % num_heads:
            raise ValueError(f"d_out ({d_out}) must be divisible by num_heads ({num_heads})")
        num_key_heads = num_heads if num_key_heads is None else num_key_heads
        _checks.check_positive_int(num_key_heads, "num_key_heads")
        if num_heads % num_key_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_key_heads ({num_key_heads})"
            )
        self.d_out, self.num_heads, self.num_key_heads = d_out, num_heads, num_key_heads
        self.head_dim = d_out // num_heads
        self.key_head_dim = self.head_dim if key_head_dim is None else key_head_dim
        _checks.check_positive_int(self.key_head_dim, "key_head_dim")
        if conv_size is not None:
            _checks.check_positive_int(conv_size, "conv_size")
        self.conv_size = conv_size
        self.dropout = dropout
        kw = {"device": device, "dtype": dtype}
        d_k = num_key_heads * self.key_head_dim
        self.W_query = nn.Linear(d_in, d_k, bias=qkv_bias, **kw)
        self.W_key = nn.Linear(d_in, d_k, bias=qkv_bias, **kw)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias, **kw)
        self.W_gate = nn.Linear(d_in, d_out, bias=False, **kw)
        self.W_beta = nn.Linear(d_in, num_heads, bias=False, **kw)
        self.W_alpha = nn.Linear(
            d_in, num_heads, bias=False, **kw
        )  # the decay, with A_log, dt_bias
        self.A_log = nn.Parameter(torch.zeros(num_heads, **kw))
        self.dt_bias = nn.Parameter(torch.ones(num_heads, **kw))
        self.conv = None
        if conv_size is not None:  # depthwise over q, k and v's channels: (c, 1, w)
            channels = 2 * d_k + d_out
            self.conv = nn.Parameter(torch.empty(channels, 1, conv_size, **kw))
            nn.init.kaiming_uniform_(self.conv, a=5**0.5)  # as nn.Conv1d initialises
        self.norm = nn.RMSNorm(self.head_dim, eps=norm_eps, **kw)
        self.out_proj = nn.Linear(d_out, d_out, **kw)

    def new_cache(self, batch_size: int, device: torch.device | str | None = None) -> StateCache:
        """A [`StateCache`][attnkit.state_cache.StateCache] for decoding with this layer (on its
        parameters' device unless ``device`` is given; a float64 state for a float64 layer)."""
        weight = self.W_value.weight
        return StateCache(
            batch_size,
            self.num_heads,
            self.key_head_dim,
            self.head_dim,
            conv_channels=0 if self.conv is None else self.conv.shape[0],
            conv_size=self.conv_size or 0,
            dtype=torch.promote_types(weight.dtype, torch.float32),
            device=weight.device if device is None else device,
        )

    def forward(self, x: Tensor, *, cache: StateCache | None = None) -> Tensor:
        """Args:
            x: ``(b, t, d_in)``.
            cache: this layer's [`StateCache`][attnkit.state_cache.StateCache]
                ([`new_cache`][attnkit.modules.deltanet.GatedDeltaNet.new_cache]) for decoding:
                ``x`` continues the tokens it has seen (a prompt, then a token at a time) and the
                cache keeps the state after them.

        Returns:
            ``(b, t, d_out)``.
        """
        _checks.check_tensor(x, "x")
        if x.dim() != 3 or x.shape[-1] != self.W_query.in_features:
            raise ValueError(
                f"x must be (b, t, d_in={self.W_query.in_features}), got shape {tuple(x.shape)}"
            )
        b, t, _ = x.shape
        if cache is not None:
            self._check_cache(cache, b)
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        if self.conv is not None:
            q, k, v = self._convolve(q, k, v, cache)
        # the gates in float32 at least (in float16, exp(A_log) * softplus(...) would overflow)
        wide = torch.promote_types(x.dtype, torch.float32)
        beta = torch.sigmoid(self.W_beta(x).to(wide))  # (b, t, h): how strongly each token writes
        alpha = self.W_alpha(x).to(wide) + self.dt_bias.to(wide)
        g = -self.A_log.to(wide).exp() * F.softplus(alpha)  # (b, t, h), <= 0
        h, h_k = self.num_heads, self.num_key_heads
        o, final = gated_delta_rule(
            q.view(b, t, h_k, self.key_head_dim),
            k.view(b, t, h_k, self.key_head_dim),
            v.view(b, t, h, self.head_dim),
            g,
            beta,
            initial_state=None if cache is None else cache.initial_state(),
            output_final_state=cache is not None,
            use_qk_l2norm=True,
            inplace_final_state=True,  # a decoding step writes the cache's state where it lies
        )
        if cache is not None:
            cache.advance(final, t)
        gate = self.W_gate(x).view(b, t, h, self.head_dim)
        context = (self.norm(o) * F.silu(gate)).reshape(b, t, self.d_out)
        context = F.dropout(context, self.dropout, self.training)
        return self.out_proj(context)

    def _check_cache(self, cache: StateCache, b: int) -> None:
        if not isinstance(cache, StateCache):
            raise TypeError(f"cache must be an attnkit.StateCache, got {type(cache).__name__}")
        names = (
            "batch_size",
            "num_heads",
            "key_head_dim",
            "head_dim",
            "conv_channels",
            "conv_size",
        )
        got = tuple(getattr(cache, n) for n in names)
        channels = 0 if self.conv is None else self.conv.shape[0]
        want = (b, self.num_heads, self.key_head_dim, self.head_dim, channels, self.conv_size or 0)
        if got != want:
            raise ValueError(
                f"cache has ({', '.join(names)}) = {got}, but this layer and call need {want}"
            )

    def _convolve(
        self, q: Tensor, k: Tensor, v: Tensor, cache: StateCache | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The short causal convolution (and SiLU) over q, k and v's channels; with a cache, from
        the inputs it saw last."""
        mixed = torch.cat([q, k, v], dim=-1).transpose(1, 2)  # (b, c, t)
        first = F.pad(mixed, (self.conv.shape[-1] - 1, 0))  # zeros before the first token
        joined = first if cache is None else cache.convolve_inputs(mixed)
        out = F.silu(F.conv1d(joined, self.conv, groups=self.conv.shape[0])).transpose(1, 2)
        return out.split([q.shape[-1], k.shape[-1], v.shape[-1]], dim=-1)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_key_heads={self.num_key_heads}, head_dim="
            f"{self.head_dim}, key_head_dim={self.key_head_dim}, conv_size={self.conv_size}"
        )
