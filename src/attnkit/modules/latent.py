"""Multi-head latent attention (MLA, DeepSeek-V2 and V3, Kimi K2; the book's bonus to the
attention chapter): keys and values come from one small latent per token, so that a cache holds
the latent rather than every head's keys and values.

For a token ``x``, the layer makes

    latent = norm(W_DKV x)                  (c numbers: 512 in DeepSeek-V3)
    k_h = [W_UK,h latent, rope(W_KR x)]     the RoPE part shared by every head (r numbers: 64)
    v_h = W_UV,h latent
    q_h = [q_nope,h, rope(q_rope,h)]        from W_query x, or W_UQ norm(W_DQ x) (compressed)

and attends as any multi-head layer would (keys of ``n + r``, values of ``v`` numbers a head): the
prefill runs ``attention`` on the decompressed keys and values. A decoding step never
decompresses: the key's up-projection folds into the query and the value's into the output,

    q_latent,h = W_UK,h^T q_nope,h                      (the query, in latent space)
    o_latent,h = softmax([q_latent,h, q_rope,h] . [latent_j, rope_key_j]) latent_j
    o_h = W_UV,h o_latent,h

three products, the middle one multi-query attention over the cache's ``(c + r)``-wide rows,
shared by every head. (``W_UK``'s bias, if any, adds the same amount to every score of a query:
the softmax does not see it.)

Shapes: ``b`` batch, ``t`` tokens, ``h`` heads, ``n`` key head dim without RoPE, ``r`` RoPE
dim, ``v`` value head dim, ``c`` latent dim, ``s`` tokens held.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit import _checks
from attnkit.functional import attention
from attnkit.latent_cache import LatentCache
from attnkit.positions import RotaryEmbedding


class MultiHeadLatentAttention(nn.Module):
    """Causal multi-head latent attention with decoupled RoPE.

    Args:
        d_in: input width.
        d_out: output width.
        num_heads: query heads ``h`` (every head reads the one latent).
        latent_dim: the latent's width ``c``.
        head_dim: each head's key width without RoPE ``n`` (default ``d_out // num_heads``).
        rope_dim: the RoPE part's width ``r``, shared by the heads' keys (even).
        value_head_dim: each head's value width ``v`` (default ``head_dim``).
        query_latent_dim: compress the queries through a latent of this width first (DeepSeek-V3:
            1536); None: one projection.
        dropout: on the attention weights, in training.
        qkv_bias: biases on the projections into and out of the latents.
        rope_base: the rotary embedding's wavelength base.
        max_len: the most positions the rotary embedding covers.

    Example:
        >>> mla = MultiHeadLatentAttention(64, 64, num_heads=4, latent_dim=32, rope_dim=8)
        >>> x = torch.randn(2, 10, 64)
        >>> mla(x).shape
        torch.Size([2, 10, 64])
        >>> cache = mla.new_cache(2, max_len=16)
        >>> steps = [mla(x[:, :9], cache=cache), mla(x[:, 9:], cache=cache)]  # prompt, one token
        >>> tuple(cache.keys().shape)  # (b, 1, s, c + r): a latent and a RoPE key a token
        (2, 1, 10, 40)
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        num_heads: int,
        *,
        latent_dim: int,
        head_dim: int | None = None,
        rope_dim: int = 64,
        value_head_dim: int | None = None,
        query_latent_dim: int | None = None,
        dropout: float = 0.0,
        qkv_bias: bool = False,
        rope_base: float = 10000.0,
        max_len: int = 4096,
    ) -> None:
        super().__init__()
        for value, name in ((d_in, "d_in"), (d_out, "d_out"), (num_heads, "num_heads")):
            _checks.check_positive_int(value, name)
        head_dim = d_out // num_heads if head_dim is None else head_dim
        value_head_dim = head_dim if value_head_dim is None else value_head_dim
        for value, name in (
            (latent_dim, "latent_dim"),
            (head_dim, "head_dim"),
            (rope_dim, "rope_dim"),
            (value_head_dim, "value_head_dim"),
        ):
            _checks.check_positive_int(value, name)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.num_heads, self.latent_dim, self.rope_dim = num_heads, latent_dim, rope_dim
        self.head_dim, self.value_head_dim, self.dropout = head_dim, value_head_dim, dropout
        query_width = num_heads * (head_dim + rope_dim)
        if query_latent_dim is None:
            self.W_query = nn.Linear(d_in, query_width, bias=qkv_bias)
        else:
            _checks.check_positive_int(query_latent_dim, "query_latent_dim")
            self.W_DQ = nn.Linear(d_in, query_latent_dim, bias=qkv_bias)
            self.query_norm = nn.RMSNorm(query_latent_dim, eps=1e-6)
            self.W_UQ = nn.Linear(query_latent_dim, query_width, bias=qkv_bias)
        self.query_latent_dim = query_latent_dim
        self.W_DKV = nn.Linear(d_in, latent_dim, bias=qkv_bias)
        self.latent_norm = nn.RMSNorm(latent_dim, eps=1e-6)
        self.W_KR = nn.Linear(d_in, rope_dim, bias=qkv_bias)
        self.W_UK = nn.Linear(latent_dim, num_heads * head_dim, bias=qkv_bias)
        self.W_UV = nn.Linear(latent_dim, num_heads * value_head_dim, bias=qkv_bias)
        self.out_proj = nn.Linear(num_heads * value_head_dim, d_out)
        self.rope = RotaryEmbedding(rope_dim, base=rope_base, max_len=max_len)
        self.scale = (head_dim + rope_dim) ** -0.5

    def new_cache(self, batch_size: int, max_len: int) -> LatentCache:
        """A [`LatentCache`][attnkit.latent_cache.LatentCache] for this layer, of its dtype and
        device."""
        weight = self.W_DKV.weight
        return LatentCache(batch_size, max_len, self.latent_dim, self.rope_dim,
                           dtype=weight.dtype, device=weight.device)  # fmt: skip

    def forward(self, x: Tensor, *, cache: LatentCache | None = None) -> Tensor:
        """Args:
            x: ``(b, t, d_in)``.
            cache: this layer's [`LatentCache`][attnkit.latent_cache.LatentCache]
                ([`new_cache`][attnkit.modules.latent.MultiHeadLatentAttention.new_cache]):
                ``x`` continues the tokens it holds. A one-token step outside training runs
                absorbed (it never decompresses the cache); longer chunks decompress it. The
                cache is for inference: it keeps no graph, so no gradient reaches the latents
                it holds.

        Returns:
            ``(b, t, d_out)``.
        """
        _checks.check_tensor(x, "x")
        d_in = self.W_DKV.in_features
        if x.dim() != 3 or x.shape[-1] != d_in:
            raise ValueError(f"x must be (b, t, d_in={d_in}), got shape {tuple(x.shape)}")
        b, t, _ = x.shape
        h, n, r = self.num_heads, self.head_dim, self.rope_dim
        start = 0 if cache is None else cache.position
        positions = torch.arange(start, start + t, device=x.device)
        q = self._queries(x).view(b, t, h, n + r).transpose(1, 2)  # (b, h, t, n + r)
        q_nope, q_rope = q.split([n, r], dim=-1)
        q_rope = self.rope(q_rope, positions)
        latent = self.latent_norm(self.W_DKV(x))  # (b, t, c)
        rope_key = self.rope(self.W_KR(x)[:, None], positions)  # (b, 1, t, r): every head's
        if cache is not None:
            cache.append(latent, rope_key[:, 0])
            if t == 1 and not self.training:
                return self._absorbed(q_nope, q_rope, cache)
            latent, rope_key = cache.latents()[:, 0], cache.rope_keys()
        s = latent.shape[1]
        k_nope = self.W_UK(latent).view(b, s, h, n).transpose(1, 2)
        v = self.W_UV(latent).view(b, s, h, self.value_head_dim).transpose(1, 2)
        k = torch.cat([k_nope, rope_key.expand(b, h, s, r)], dim=-1)  # (b, h, s, n + r)
        o = attention(torch.cat([q_nope, q_rope], dim=-1), k, v, causal=True, scale=self.scale,
                      dropout_p=self.dropout if self.training else 0.0)  # fmt: skip
        return self.out_proj(o.transpose(1, 2).reshape(b, t, h * self.value_head_dim))

    def _queries(self, x: Tensor) -> Tensor:
        """``(b, t, h * (n + r))``: through the query latent where the layer compresses them."""
        if self.query_latent_dim is None:
            return self.W_query(x)
        return self.W_UQ(self.query_norm(self.W_DQ(x)))

    def _absorbed(self, q_nope: Tensor, q_rope: Tensor, cache: LatentCache) -> Tensor:
        """One step over the cache's latents, never decompressed: the module docstring's three
        products."""
        b, h, t, _ = q_nope.shape
        c, v = self.latent_dim, self.value_head_dim
        up_k = self.W_UK.weight.view(h, self.head_dim, c)
        q_latent = torch.einsum("bhtn,hnc->bhtc", q_nope, up_k)  # (b, h, t, c)
        query = torch.cat([q_latent, q_rope], dim=-1)  # (b, h, t, c + r)
        o_latent = attention(query, cache.keys(), cache.latents(), causal=True, scale=self.scale)
        o = torch.einsum("bhtc,hvc->bhtv", o_latent, self.W_UV.weight.view(h, v, c))
        if self.W_UV.bias is not None:  # the weights sum to 1: the bias passes through
            o = o + self.W_UV.bias.view(h, 1, v)
        return self.out_proj(o.transpose(1, 2).reshape(b, t, h * v))

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, latent_dim={self.latent_dim}, head_dim={self.head_dim}, "
            f"rope_dim={self.rope_dim}, value_head_dim={self.value_head_dim}, "
            f"query_latent_dim={self.query_latent_dim}"
        )
