"""``MultiheadAttention``: torch's ``nn.MultiheadAttention`` whose attention runs on attnkit.

It is torch's class with one method replaced: the constructor, the parameters and buffers (their
names and shapes: a ``state_dict`` loads strictly both ways), ``merge_masks`` and every attribute
torch's Transformer layers read are torch's own; ``forward`` keeps torch 2.13's semantics and
computes the attention with [`attnkit.functional.attention`][attnkit.functional.attention].

It refuses what torch's layer refuses, in its words ([`attnkit.nn.checks`][attnkit.nn.checks]).
Two differences: a query whose every key is masked gets 0 here (attnkit's rule), where torch's
gives NaN when it returns weights; a query row holding a NaN stays NaN, where torch's CPU kernel
gives 0.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.functional import attention
from attnkit.nn.checks import check_inputs
from attnkit.nn.functional import top_left_causal

__all__ = ["MultiheadAttention"]


class MultiheadAttention(torch.nn.MultiheadAttention):
    """A drop-in for ``torch.nn.MultiheadAttention``: the same constructor, parameters and
    ``forward``, computed by attnkit.

    Example:
        >>> import torch
        >>> mha = MultiheadAttention(64, 4, batch_first=True)
        >>> x = torch.randn(2, 10, 64)
        >>> out, weights = mha(x, x, x)
        >>> out.shape, weights.shape
        (torch.Size([2, 10, 64]), torch.Size([2, 10, 10]))
    """

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """torch's ``nn.MultiheadAttention.forward``: inputs ``(L, N, E)`` (``(N, L, E)`` with
        ``batch_first``) or unbatched ``(L, E)``; ``key_padding_mask`` ``(N, S)``, True (or
        ``-inf``) where a key is padding; ``attn_mask`` ``(L, S)`` or ``(N * num_heads, L, S)``,
        True (or ``-inf``) where a query may not look, a float one added to the scores;
        ``is_causal`` a hint that needs ``attn_mask``, except that with ``need_weights=False`` and
        no ``key_padding_mask`` the mask is dropped for the top-left causal one. Returns the output
        and the weights after dropout (averaged over the heads unless ``average_attn_weights`` is
        False), or None without ``need_weights``.

        Under ``torch.jit.script`` this method is compiled and the attention is not: a scripted
        model calls back into Python for it (it runs, it cannot be saved for C++)."""
        return self._attend(
            query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
            is_causal,
        )  # fmt: skip

    @torch.jit.ignore  # attnkit's Python, which TorchScript cannot compile
    def _attend(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None,
        need_weights: bool,
        attn_mask: Tensor | None,
        average_attn_weights: bool,
        is_causal: bool,
    ) -> tuple[Tensor, Tensor | None]:
        batched = check_inputs(
            self, query, key, value, key_padding_mask, attn_mask, is_causal, need_weights
        )
        if not batched:
            query, key, value = (x.unsqueeze(0) for x in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        top_left = is_causal and key_padding_mask is None and not need_weights
        q, k, v = _heads(self, query, key, value)  # (N, H, L or S, d)
        mask, key_mask = _masks(self, attn_mask if not top_left else None, key_padding_mask, q)
        t, causal = q.shape[2], False
        if top_left:  # the given mask gives way to torch's top-left causal one
            mask, causal = top_left_causal(mask, t, k.shape[2], q.device)
        dropout = self.dropout if self.training else 0.0
        result = attention(
            q,
            k,
            v,
            attn_mask=mask,
            key_mask=key_mask,
            causal=causal,
            dropout_p=dropout,
            return_weights="dropped" if need_weights else False,
        )
        out, weights = result if need_weights else (result, None)
        n, h, _, d = out.shape
        out = F.linear(out.transpose(1, 2).reshape(n, t, h * d), *_out(self, out.dtype))
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        if not batched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights


def _out(module: torch.nn.MultiheadAttention, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    bias = module.out_proj.bias
    return module.out_proj.weight, None if bias is None else bias.to(dtype)


def _heads(
    module: torch.nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The projections, batch first, split into heads; with ``add_bias_kv`` the learned key
    and value appended, with ``add_zero_attn`` a key and value of zeros after them."""
    e, h = module.embed_dim, module.num_heads
    bias = module.in_proj_bias
    biases = (None, None, None) if bias is None else bias.chunk(3)
    if module._qkv_same_embed_dim:
        weights = module.in_proj_weight.chunk(3)
    else:
        weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
    q, k, v = (  # a bias of another dtype taken in the inputs', as torch's layer takes it
        F.linear(x, w, None if b is None else b.to(x.dtype))
        for x, w, b in zip((query, key, value), weights, biases)
    )
    n = q.shape[0]
    if module.bias_k is not None:
        k = torch.cat([k, module.bias_k.reshape(1, 1, e).expand(n, 1, e)], dim=1)
        v = torch.cat([v, module.bias_v.reshape(1, 1, e).expand(n, 1, e)], dim=1)
    if module.add_zero_attn:
        k, v = (torch.cat([x, x.new_zeros(n, 1, e)], dim=1) for x in (k, v))
    return tuple(x.reshape(n, x.shape[1], h, e // h).transpose(1, 2) for x in (q, k, v))


def _masks(
    module: torch.nn.MultiheadAttention,
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    q: Tensor,
) -> tuple[Tensor | None, Tensor | None]:
    """torch's masks as attnkit's: ``attn_mask`` broadcastable to ``(N, H, L, S)``, True
    where a query may look, or a float one; a bool ``key_padding_mask`` as ``key_mask`` (True
    for a real key), a float one added to ``attn_mask``. Both gain the columns of
    ``add_bias_kv`` and ``add_zero_attn``, which every query sees."""
    extra = (module.bias_k is not None) + bool(module.add_zero_attn)
    n, h, t, _ = q.shape
    mask = None
    if attn_mask is not None:
        mask = _attnkit_polarity(attn_mask, q.dtype, "attn_mask")
        if mask.dim() == 3:
            mask = mask.reshape(n, h, t, mask.shape[-1])
        mask = _pad(mask, extra)
    if key_padding_mask is None:
        return mask, None
    padding = _attnkit_polarity(key_padding_mask, q.dtype, "key_padding_mask")
    padding = _pad(padding, extra)
    if padding.dtype == torch.bool:
        if mask is None or mask.dtype == torch.bool:
            return mask, padding
        return mask.masked_fill(~padding[:, None, None], float("-inf")), None
    added = padding[:, None, None]
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    return added if mask is None else mask + added, None


def _pad(mask: Tensor, extra: int) -> Tensor:
    """``mask`` with ``extra`` more keys that every query sees."""
    if not extra:
        return mask
    return F.pad(mask, (0, extra), value=True if mask.dtype == torch.bool else 0.0)


def _attnkit_polarity(mask: Tensor, dtype: torch.dtype, name: str) -> Tensor:
    """torch's mask (True: may not look) as attnkit's (True: may look); a float one as it is,
    in the queries' dtype as torch converts it."""
    if mask.dtype == torch.bool:
        return ~mask
    if not torch.is_floating_point(mask):
        raise TypeError(f"{name} must be a bool or float tensor, got {mask.dtype}")
    return mask.to(dtype)
