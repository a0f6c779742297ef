"""The SDPA backend: torch's fused ``scaled_dot_product_attention``.

torch's ``is_causal=True`` aligns the mask top-left, attnkit bottom-right (see :mod:`attnkit.masks`);
the two agree only when ``t == s``, so ``is_causal`` is used only then and an explicit mask otherwise.
ALiBi becomes a float mask added to the scores. SDPA has no soft-capping and returns neither weights
nor the log-sum-exp: asking for those raises in the dispatcher.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from attnkit.backends.base import AttentionOutput, Request
from attnkit.masks import alibi_bias


def sdpa(q: Tensor, k: Tensor, v: Tensor, request: Request) -> AttentionOutput:
    """Shapes ``q (b, h, t, d)``, ``k (b, h_kv, s, d)``, ``v (b, h_kv, s, d_v)``."""
    t, s = q.shape[-2], k.shape[-2]
    masks = request.masks
    is_causal = masks.is_causal_only and t == s and request.alibi_slopes is None
    allowed = None if is_causal else masks.allowed(t, s, q.device)
    attn_mask = allowed
    bias = masks.bias()
    if request.alibi_slopes is not None:
        alibi = alibi_bias(request.alibi_slopes.to(q.dtype), t, s)  # (h, t, s)
        bias = alibi if bias is None else bias + alibi
    if bias is not None:
        attn_mask = bias if allowed is None else bias.masked_fill(~allowed, float("-inf"))

    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=request.dropout_p,
        is_causal=is_causal,
        scale=request.scale,
        enable_gqa=bool(q.shape[1] != k.shape[1]),  # bool: under jit.trace the sizes are tensors
    )
    if allowed is not None:
        # Rows with no allowed key are zero by construction, whatever the kernel on this device does.
        out = out.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)
    return AttentionOutput(out)
