"""What multi-head modules share: projections, the head split, one attention call, the output
projection ([`ProjectedAttention`][attnkit.modules.projected.ProjectedAttention]).

Shapes: ``b`` batch, ``t`` query tokens, ``s`` key tokens, ``h`` heads, ``h_kv`` key/value heads,
``d`` head dim = ``d_out / h``, ``e`` embed width. Module boundaries are ``(b, t, e)``, the attention
call inside is ``(b, h, t, d)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from attnkit import _checks
from attnkit.cache import KVCache
from attnkit.functional import attention
from attnkit.kernels import gemv
from attnkit.modules._common import merge_heads, split_heads


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

    def _linears(self, names: tuple[str, ...], x: Tensor, step: bool) -> list[Tensor]:
        """The named projections of ``x``: each layer called, or in a cached decoding ``step`` one
        fused product of their weights ([`gemv.project`][attnkit.kernels.gemv.project])."""
        layers = [self._modules[name] for name in names]
        return gemv.project(layers, x) if step else [layer(x) for layer in layers]

    def _project_queries(self, x: Tensor, step: bool = False) -> Tensor:
        # (b, t, e) -> (b, h, t, d)
        [q] = self._linears(("W_query",), x, step)
        return split_heads(q, self.num_heads)

    def _project(
        self, x: Tensor, memory: Tensor, step: bool = False
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries ``(b, h, t, d)`` from ``x`` ``(b, t, d_q)``; keys and values ``(b, h_kv, s, d)``
        from ``memory`` ``(b, s, d_kv)``. ``step``: a cached decoding step."""
        layers = self._modules
        if x is memory and not step:  # self-attention: each projection of x, as its layer's call
            q, k, v = layers["W_query"](x), layers["W_key"](x), layers["W_value"](x)
            queries = split_heads(q, self.num_heads)  # (b, t, e) -> (b, h, t, d)
        elif x is memory:  # a cached step: the three projections of x in one product
            q, k, v = self._linears(("W_query", "W_key", "W_value"), x, step)
            queries = split_heads(q, self.num_heads)
        else:
            queries = self._project_queries(x, step)
            k, v = self._linears(("W_key", "W_value"), memory, step)
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
        step: bool = False,
        **score_options: Any,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The attention call and the output projection; ``score_options`` go to
        [`attnkit.functional.attention`][attnkit.functional.attention] (window, ALiBi, softcap),
        or to ``attend``, a function with its signature (ring attention). ``step``: a cached
        decoding step (its output projection in the fused product)."""
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
        merged = merge_heads(context)  # (b, h, t, d) -> (b, t, e)
        out = (
            gemv.project([self._modules["out_proj"]], merged)[0]
            if step
            else self._modules["out_proj"](merged)
        )
        if not need_weights:
            return out
        return out, weights.mean(dim=1) if average_weights else weights  # (b, t, s) | (b, h, t, s)

    @staticmethod
    def _known_of(cache: KVCache | None, keys: Tensor) -> dict[str, Tensor]:
        """What a cache knows of the keys it returned, for ``attention``: which rows hold a NaN or
        an infinity, off the CPU, where SDPA would read the whole cache to find them (on a CPU the
        decode kernel finds them as it streams the keys)."""
        if cache is None or keys.is_cpu:
            return {}
        return {"nonfinite_keys": cache.nonfinite_keys()}

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
