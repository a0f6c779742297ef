"""What a multi-head latent attention layer carries between decoding steps: one compressed latent
and one RoPE key per token, shared by all its heads, never the heads' keys and values. The
counterpart of [`KVCache`][attnkit.cache.KVCache] for a
[`MultiHeadLatentAttention`][attnkit.modules.latent.MultiHeadLatentAttention] layer.

Both live in one buffer, the latent in the first ``latent_dim`` channels of a token and its RoPE
key in the last ``rope_dim``, so that the decoding step reads the keys of every head as one
``(latent_dim + rope_dim)``-wide row a token, and the values as the first ``latent_dim`` of it,
without a copy.

Shapes: ``b`` batch, ``s`` tokens held, ``c`` latent dim, ``r`` RoPE dim.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit import _checks


class LatentCache(nn.Module):
    """One latent-attention layer's tokens, preallocated.

    Args:
        batch_size: rows decoded together.
        max_len: the most tokens it will hold, prompt and generated.
        latent_dim: the layer's latent width ``c`` (DeepSeek-V3: 512).
        rope_dim: the width ``r`` of its RoPE key (DeepSeek-V3: 64).
        dtype: of the buffer.
        device: of the buffer.

    The buffer moves with ``.to()`` but stays out of ``state_dict()``, and holds no graph.

    Example:
        >>> cache = LatentCache(1, max_len=32, latent_dim=512, rope_dim=64)
        >>> cache.bytes_per_token()  # (512 + 64) float32 numbers, for every head at once
        2304
    """

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        latent_dim: int,
        rope_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for value, name in (
            (batch_size, "batch_size"),
            (max_len, "max_len"),
            (latent_dim, "latent_dim"),
            (rope_dim, "rope_dim"),
        ):
            _checks.check_positive_int(value, name)
        self.batch_size, self.max_len = batch_size, max_len
        self.latent_dim, self.rope_dim = latent_dim, rope_dim
        shape = (batch_size, max_len, latent_dim + rope_dim)
        self.register_buffer("tokens", torch.zeros(shape, dtype=dtype, device=device), False)
        self.position = 0

    def append(self, latent: Tensor, rope_key: Tensor) -> None:
        """Write ``t`` more tokens: ``latent`` ``(b, t, c)`` and ``rope_key`` ``(b, t, r)``
        (rotated at its position already).

        Raises:
            ValueError: shapes that do not match the cache, or more tokens than ``max_len``.
            TypeError: a dtype other than the cache's.
        """
        b, c, r = self.batch_size, self.latent_dim, self.rope_dim
        for x, width, name in ((latent, c, "latent"), (rope_key, r, "rope_key")):
            _checks.check_tensor(x, name)
            if x.dim() != 3 or x.shape[0] != b or x.shape[2] != width:
                raise ValueError(f"{name} must be (b={b}, t, {width}), got shape {tuple(x.shape)}")
            if x.dtype != self.tokens.dtype:
                raise TypeError(f"{name} must be {self.tokens.dtype} as the cache, got {x.dtype}")
        t = latent.shape[1]
        if rope_key.shape[1] != t:
            raise ValueError(f"latent has {t} tokens, rope_key {rope_key.shape[1]}")
        end = self.position + t
        if end > self.max_len:
            raise ValueError(
                f"the cache holds {self.position} of max_len={self.max_len} tokens; "
                f"{t} more do not fit"
            )
        self.tokens[:, self.position : end, :c] = latent.detach()
        self.tokens[:, self.position : end, c:] = rope_key.detach()
        self.position = end

    def keys(self) -> Tensor:
        """Every held token as the decoding step's keys: ``(b, 1, s, c + r)``, a view."""
        return self.tokens[:, None, : self.position]

    def latents(self) -> Tensor:
        """Every held token's latent, the decoding step's values: ``(b, 1, s, c)``, a view."""
        return self.keys()[..., : self.latent_dim]

    def rope_keys(self) -> Tensor:
        """Every held token's RoPE key: ``(b, 1, s, r)``, a view."""
        return self.keys()[..., self.latent_dim :]

    def bytes_per_token(self) -> int:
        """The bytes one token takes in every row of the batch: ``(c + r)`` numbers."""
        return (self.latent_dim + self.rope_dim) * self.tokens.element_size()

    def reset(self) -> None:
        """Forget every token."""
        self.tokens.zero_()
        self.position = 0

    def extra_repr(self) -> str:
        return (
            f"batch_size={self.batch_size}, max_len={self.max_len}, latent_dim={self.latent_dim}, "
            f"rope_dim={self.rope_dim}, position={self.position}"
        )
