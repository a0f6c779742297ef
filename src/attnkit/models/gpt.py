"""The book's small GPT, on attnkit's modules: the model that the chapter after attention builds.

Token and position embeddings, then ``num_layers`` pre-norm blocks, each

    x = x + attention(norm_1(x))          # attnkit's causal MultiHeadAttention
    x = x + feed_forward(norm_2(x))       # Linear(e, 4e) -> GELU -> Linear(4e, e)

then a final norm and a linear output head that gives a score (logit) to every token of the
vocabulary. ``feed_forward=False`` drops the feed-forward half of every block: an
attention-only transformer, the smallest model in which induction heads form (Elhage et al.,
"A Mathematical Framework for Transformer Circuits", 2021).

Attention is never written here: every head runs in
[`MultiHeadAttention`][attnkit.modules.multihead.MultiHeadAttention], which asks it for its weights
when ``need_weights=True``.

Shapes: ``b`` batch, ``t`` tokens, ``e`` embedding width (``emb_dim``), ``h`` heads, ``L`` layers,
``V`` vocabulary size.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit import _checks
from attnkit.modules import MultiHeadAttention


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
    """One pre-norm block: causal multi-head attention, then (unless ``feed_forward=False``) the
    feed-forward network, each added back to its input (a residual connection)."""

    def __init__(
        self,
        emb_dim: int,
        context_length: int,
        num_heads: int,
        dropout: float = 0.0,
        *,
        qkv_bias: bool = False,
        feed_forward: bool = True,
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(emb_dim)
        self.att = MultiHeadAttention(
            emb_dim, emb_dim, context_length, dropout, num_heads, qkv_bias=qkv_bias, causal=True
        )
        self.norm2 = nn.LayerNorm(emb_dim) if feed_forward else None
        self.ff = FeedForward(emb_dim) if feed_forward else None
        self.drop_shortcut = nn.Dropout(dropout)

    def forward(self, x: Tensor, *, need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """``x`` ``(b, t, e)`` -> the new ``x`` ``(b, t, e)`` and, with ``need_weights``, every
        head's attention weights ``(b, h, t, t)`` (None otherwise)."""
        attn_weights = None
        if need_weights:
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

    Raises:
        ValueError: a size below 1, or ``emb_dim`` not divisible by ``num_heads``.

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
        self.context_length = context_length
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
            )
            for _ in range(num_layers)
        )
        self.final_norm = nn.LayerNorm(emb_dim)
        self.out_head = nn.Linear(emb_dim, vocab_size, bias=False)

    def forward(
        self, in_idx: Tensor, *, need_weights: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Args:
            in_idx: ``(b, t)`` token ids, ``t <= context_length``.
            need_weights: also return every head's attention weights.

        Returns:
            the logits ``(b, t, V)``, or ``(logits, attn_weights)`` with ``attn_weights``
            ``(L, b, h, t, t)``: layer ``l``, head ``k``, query ``i`` weighs key ``j`` by
            ``attn_weights[l, :, k, i, j]``.
        """
        t = in_idx.shape[1]  # in_idx: (b, t)
        _checks.check_context_length(t, self.context_length)
        positions = torch.arange(t, device=in_idx.device)
        x = self.tok_emb(in_idx) + self.pos_emb(positions)  # (b, t, e) + (t, e) -> (b, t, e)
        x = self.drop_emb(x)
        all_weights = []
        for block in self.trf_blocks:
            x, attn_weights = block(x, need_weights=need_weights)
            all_weights.append(attn_weights)
        logits = self.out_head(self.final_norm(x))  # (b, t, e) -> (b, t, V)
        if not need_weights:
            return logits
        return logits, torch.stack(all_weights)  # L x (b, h, t, t) -> (L, b, h, t, t)
