"""Rotary position embeddings (RoPE, Su et al. 2021), in the rotate-half convention of Llama in Hugging
Face transformers.

RoPE rotates each pair of channels ``(x[i], x[i + d/2])`` of a query or key at position ``p`` by the
angle ``p * base^(-2i/d)``. The score of a query at ``p`` and a key at ``p'`` then depends on ``p - p'``
only, so a key cached at its own position never needs rotating again. (ALiBi, the other way to give
attention positions, is a score bias: see [`attnkit.alibi_slopes`][attnkit.masks.alibi_slopes].)

The positions themselves come from [`token_positions`][attnkit.positions.token_positions]: a
ragged (left-padded) batch counts each row's real tokens only.

Shapes: ``b`` batch, ``h`` heads, ``t`` tokens, ``d`` head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit import _checks
from attnkit._tracing import traced


class RotaryEmbedding(nn.Module):
    """Rotary embeddings for heads of width ``head_dim``, positions ``0 .. max_len - 1``.

    Args:
        head_dim: width of one head (even).
        base: the wavelength base (Llama: 10000; ``rope_theta`` in Hugging Face configs).
        max_len: the most positions; the cos/sin tables are built once for them.
        device: of the tables.

    Example:
        >>> rope = RotaryEmbedding(64, max_len=128)
        >>> q = torch.randn(1, 8, 10, 64)
        >>> rope(q, torch.arange(10)).shape
        torch.Size([1, 8, 10, 64])
    """

    def __init__(
        self,
        head_dim: int,
        *,
        base: float = 10000.0,
        max_len: int = 4096,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        _checks.check_positive_int(head_dim, "head_dim")
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        self.base = _checks.check_positive_number(base, "base")
        _checks.check_positive_int(max_len, "max_len")
        self.head_dim, self.max_len = head_dim, max_len
        # Angles in float64, rounded once: transformers computes them in float32, which is off by
        # up to ulp(p) radians at position p (1e-5 relative error in the output at p = 300).
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
        inv_freq = self.base**-exponents  # (d/2,)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float64, device=device), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # (max_len, d): channel i and i + d/2 share
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate ``x`` ``(b, h, t, d)`` at ``positions``: ``(t,)`` shared by the batch, or ``(b, t)``
        per row (ragged batches)."""
        _checks.check_tensor(x, "x")
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"x must be (batch, heads, tokens, head_dim={self.head_dim}), got shape "
                f"{tuple(x.shape)}"
            )
        if positions.shape not in ((x.shape[2],), (x.shape[0], x.shape[2])):
            raise ValueError(
                f"positions must be (tokens,) = ({x.shape[2]},) or (batch, tokens) = "
                f"{(x.shape[0], x.shape[2])}, got shape {tuple(positions.shape)}"
            )
        if not traced() and positions.numel():
            last = int(positions.max())
            if last >= self.max_len:
                raise ValueError(
                    f"position {last} is beyond the rotary table (max_len={self.max_len}); "
                    "build RotaryEmbedding with a larger max_len"
                )
        cos = self.cos[positions].to(x.dtype)  # (t, d) or (b, t, d)
        sin = self.sin[positions].to(x.dtype)
        if positions.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (b, 1, t, d): broadcast over heads
        return x * cos + rotate_half(x) * sin

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}, max_len={self.max_len}"


def rotate_half(x: Tensor) -> Tensor:
    """``(x1, x2) -> (-x2, x1)`` on the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def token_positions(
    n: int, key_mask: Tensor | None, start: Tensor | int = 0, device: torch.device | None = None
) -> Tensor:
    """Positions of ``n`` tokens that follow ``start`` tokens seen: ``(n,)`` without a mask; with a
    ``(b, n)`` mask, ``(b, n)`` counting real tokens only (a left-padded row starts at its first real
    token; padding gets position 0)."""
    if key_mask is None:
        if isinstance(start, Tensor):  # per-row starts, no padding in this chunk
            return start[:, None] + torch.arange(n, device=start.device)
        return torch.arange(start, start + n, device=device)
    counted = key_mask.long().cumsum(dim=1) - 1  # (b, n): real tokens before each one
    start = start[:, None] if isinstance(start, Tensor) else start
    return (counted + start).masked_fill(~key_mask, 0)
