"""The book's small GPT, on attnkit's modules: the model that the chapter after attention builds.

Token and position embeddings, then ``num_layers`` pre-norm blocks, each

    x = x + attention(norm_1(x))          # attnkit's causal MultiHeadAttention
    x = x + feed_forward(norm_2(x))       # Linear(e, 4e) -> GELU -> Linear(4e, e)

then a final norm and a linear output head that gives a score (logit) to every token of the
vocabulary. ``feed_forward=False`` drops the feed-forward half of every block: an
attention-only transformer, the smallest model in which induction heads form (Elhage et al.,
"A Mathematical Framework for Transformer Circuits", 2021). ``layers="LLLA"`` makes a hybrid, as
Qwen3-Next and Qwen3.5 are: ``L`` a [`GatedDeltaNet`][attnkit.modules.deltanet.GatedDeltaNet]
block (linear attention), ``A`` a softmax-attention block, the pattern repeated over the layers.

Attention is never written here: every head runs in
[`MultiHeadAttention`][attnkit.modules.multihead.MultiHeadAttention], which asks it for its weights
when ``need_weights=True``, or in ``GatedDeltaNet``, which has none to give. Generation keeps a
[`KVCache`][attnkit.cache.KVCache] for each softmax block and a
[`StateCache`][attnkit.state_cache.StateCache] for each linear one (``new_caches``, ``generate``).

Shapes: ``b`` batch, ``t`` tokens, ``e`` embedding width (``emb_dim``), ``h`` heads, ``L`` layers,
``V`` vocabulary size.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit import _checks
from attnkit.cache import KVCache
from attnkit.modules import GatedDeltaNet, MultiHeadAttention
from attnkit.state_cache import StateCache

LAYER_KINDS = {"A": "softmax attention", "L": "linear attention (Gated DeltaNet)"}


class FeedForward(nn.Module):
    """The block's feed-forward network: ``Linear(e, 4e) -> GELU -> Linear(4e, e)``, applied to
    every token by itself."""

    def __init__(self, emb_dim: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(emb_dim, 4 * emb_dim),
            nn.GELU(approximate="tanh"),  # the book's GELU (GPT-2's tanh approximation)
            nn.Linear(4 * emb_dim, emb_dim),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)  # (b, t, e) -> (b, t, e)


class TransformerBlock(nn.Module):
    """One pre-norm block: causal multi-head attention (``kind="A"``) or Gated DeltaNet
    (``kind="L"``), then (unless ``feed_forward=False``) the feed-forward network, each added back
    to its input (a residual connection)."""

    def __init__(
        self,
        emb_dim: int,
        context_length: int,
        num_heads: int,
        dropout: float = 0.0,
        *,
        qkv_bias: bool = False,
        feed_forward: bool = True,
        kind: str = "A",
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(emb_dim)
        self.kind = kind
        if kind == "L":
            self.att = GatedDeltaNet(
                emb_dim, emb_dim, num_heads, dropout=dropout, qkv_bias=qkv_bias, conv_size=4
            )
        else:
            self.att = MultiHeadAttention(
                emb_dim, emb_dim, context_length, dropout, num_heads, qkv_bias=qkv_bias, causal=True
            )
        self.norm2 = nn.LayerNorm(emb_dim) if feed_forward else None
        self.ff = FeedForward(emb_dim) if feed_forward else None
        self.drop_shortcut = nn.Dropout(dropout)

    def forward(
        self, x: Tensor, *, need_weights: bool = False, cache: KVCache | StateCache | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """``x`` ``(b, t, e)`` -> the new ``x`` ``(b, t, e)`` and, with ``need_weights``, every
        head's attention weights ``(b, h, t, t)`` (None otherwise, and for a linear block, which
        has none). ``cache``: the block's cache while generating."""
        attn_weights = None
        if cache is not None:
            attended = self.att(self.norm1(x), cache=cache)
        elif need_weights and self.kind == "A":
            attended, attn_weights = self.att(
                self.norm1(x), need_weights=True, average_weights=False
            )
        else:
            attended = self.att(self.norm1(x))
        x = x + self.drop_shortcut(attended)
        if self.ff is not None:
            x = x + self.drop_shortcut(self.ff(self.norm2(x)))
        return x, attn_weights


class GPTModel(nn.Module):
    """A GPT: embeddings, ``num_layers`` transformer blocks, a final norm and an output head.

    Args:
        vocab_size: number of distinct tokens.
        context_length: the longest sequence it reads (the position embeddings' count).
        emb_dim: embedding width ``e``, split evenly over the heads.
        num_heads: attention heads per block.
        num_layers: transformer blocks.
        dropout: dropout on embeddings, attention weights and residual branches (training only).
        qkv_bias: biases on the query, key and value projections.
        feed_forward: False for an attention-only model (no feed-forward network, no second norm).
        layers: the blocks' kinds, a pattern repeated over the layers: ``"A"`` softmax attention
            (the default, every block), ``"L"`` Gated DeltaNet; ``"LLLA"`` is Qwen3-Next's and
            Qwen3.5's 3:1 hybrid.

    Raises:
        ValueError: a size below 1, ``emb_dim`` not divisible by ``num_heads``, or a pattern with
            another letter than ``A`` and ``L``.

    Example:
        >>> model = GPTModel(vocab_size=50, context_length=16, emb_dim=32, num_heads=4, num_layers=2)
        >>> idx = torch.randint(0, 50, (3, 16))
        >>> logits, attn_weights = model(idx, need_weights=True)
        >>> logits.shape, attn_weights.shape  # (b, t, V) and (L, b, h, t, t)
        (torch.Size([3, 16, 50]), torch.Size([2, 3, 4, 16, 16]))
    """

    def __init__(
        self,
        vocab_size: int,
        context_length: int,
        emb_dim: int,
        num_heads: int,
        num_layers: int,
        dropout: float = 0.0,
        *,
        qkv_bias: bool = False,
        feed_forward: bool = True,
        layers: str = "A",
    ) -> None:
        super().__init__()
        for value, name in (
            (vocab_size, "vocab_size"),
            (context_length, "context_length"),
            (emb_dim, "emb_dim"),
            (num_heads, "num_heads"),
            (num_layers, "num_layers"),
        ):
            _checks.check_positive_int(value, name)
        if emb_dim % num_heads:
            raise ValueError(f"emb_dim ({emb_dim}) must be divisible by num_heads ({num_heads})")
        if not isinstance(layers, str) or not layers or set(layers) - set(LAYER_KINDS):
            raise ValueError(f"layers must be a pattern of A and L (e.g. 'LLLA'), got {layers!r}")
        self.context_length = context_length
        self.layers = "".join(layers[i % len(layers)] for i in range(num_layers))
        self.tok_emb = nn.Embedding(vocab_size, emb_dim)
        self.pos_emb = nn.Embedding(context_length, emb_dim)
        self.drop_emb = nn.Dropout(dropout)
        self.trf_blocks = nn.ModuleList(
            TransformerBlock(
                emb_dim,
                context_length,
                num_heads,
                dropout,
                qkv_bias=qkv_bias,
                feed_forward=feed_forward,
                kind=kind,
            )
            for kind in self.layers
        )
        self.final_norm = nn.LayerNorm(emb_dim)
        self.out_head = nn.Linear(emb_dim, vocab_size, bias=False)

    def forward(
        self,
        in_idx: Tensor,
        *,
        need_weights: bool = False,
        caches: list[KVCache | StateCache] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Args:
            in_idx: ``(b, t)`` token ids, ``t <= context_length``.
            need_weights: also return every softmax-attention head's weights.
            caches: one per block ([`new_caches`][attnkit.models.gpt.GPTModel.new_caches]) while
                generating: ``in_idx`` continues the tokens they hold.

        Returns:
            the logits ``(b, t, V)``, or ``(logits, attn_weights)`` with ``attn_weights``
            ``(L, b, h, t, t)`` for the ``L`` softmax-attention blocks: block ``l``, head ``k``,
            query ``i`` weighs key ``j`` by ``attn_weights[l, :, k, i, j]``.

        Raises:
            ValueError: a sequence longer than ``context_length`` (with the cached tokens);
                ``need_weights`` with ``caches``, or in a model without a softmax block.
        """
        if need_weights and caches is not None:
            raise ValueError(
                "need_weights cannot be used with caches (generation returns no weights)"
            )
        if need_weights and "A" not in self.layers:
            raise ValueError(
                f"need_weights: a model of layers={self.layers!r} has no softmax-attention block "
                "(Gated DeltaNet has no weights to give)"
            )
        t = in_idx.shape[1]  # in_idx: (b, t)
        start = 0 if caches is None else caches[0].position
        _checks.check_context_length(start + t, self.context_length)
        positions = torch.arange(start, start + t, device=in_idx.device)
        x = self.tok_emb(in_idx) + self.pos_emb(positions)  # (b, t, e) + (t, e) -> (b, t, e)
        x = self.drop_emb(x)
        all_weights = []
        for i, block in enumerate(self.trf_blocks):
            cache = None if caches is None else caches[i]
            x, attn_weights = block(x, need_weights=need_weights, cache=cache)
            if attn_weights is not None:
                all_weights.append(attn_weights)
        logits = self.out_head(self.final_norm(x))  # (b, t, e) -> (b, t, V)
        if not need_weights:
            return logits
        return logits, torch.stack(all_weights)  # L x (b, h, t, t) -> (L, b, h, t, t)

    def new_caches(self, batch_size: int) -> list[KVCache | StateCache]:
        """A cache for each block, for generating ``batch_size`` rows: a ``KVCache`` of
        ``context_length`` positions for a softmax block, a ``StateCache`` for a linear one."""
        weight = self.out_head.weight
        where = {"dtype": weight.dtype, "device": weight.device}
        caches: list[KVCache | StateCache] = []
        for block in self.trf_blocks:
            att = block.att
            if block.kind == "L":
                caches.append(att.new_cache(batch_size, device=weight.device))
            else:
                size = (batch_size, att.num_kv_heads, self.context_length, att.head_dim)
                caches.append(KVCache(*size, **where))
        return caches

    @torch.no_grad()
    def generate(self, in_idx: Tensor, max_new_tokens: int) -> Tensor:
        """``in_idx`` ``(b, t)`` followed by ``max_new_tokens`` tokens, each the most likely
        after those before it (greedy), read once through the caches: the prompt, then a token
        at a time.

        Raises:
            ValueError: more tokens in all than ``context_length``.
        """
        _checks.check_positive_int(max_new_tokens, "max_new_tokens")
        total = in_idx.shape[1] + max_new_tokens
        _checks.check_context_length(total, self.context_length, "prompt + max_new_tokens")
        caches = self.new_caches(in_idx.shape[0])
        logits = self(in_idx, caches=caches)
        tokens = [in_idx]
        for _ in range(max_new_tokens):
            tokens.append(logits[:, -1].argmax(dim=-1, keepdim=True))  # (b, 1)
            if len(tokens) <= max_new_tokens:
                logits = self(tokens[-1], caches=caches)
        return torch.cat(tokens, dim=1)
