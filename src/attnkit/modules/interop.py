"""Between attnkit's [`MultiHeadAttention`][attnkit.modules.multihead.MultiHeadAttention] and
``torch.nn.MultiheadAttention``: the same weights in either, where both can represent the
module."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

MultiHeadAttention = TypeVar("MultiHeadAttention", bound=nn.Module)
"""attnkit's `MultiHeadAttention` or a subclass, as its class methods hand it over (a type
variable rather than an import, so that this module and the class's do not import each other)."""


def from_torch(cls: type[MultiHeadAttention], m: nn.MultiheadAttention) -> MultiHeadAttention:
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


def to_torch(self: MultiHeadAttention) -> nn.MultiheadAttention:
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
