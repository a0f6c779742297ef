"""What a linear-attention layer carries from one decoding step to the next: its recurrent state, and
the last inputs of its short convolution. The counterpart of [`KVCache`][attnkit.cache.KVCache] for
a [`GatedDeltaNet`][attnkit.modules.deltanet.GatedDeltaNet] layer, of a fixed size however long the
sequence: a hybrid model keeps one of these per linear layer and a ``KVCache`` per softmax layer.

Shapes: ``b`` batch, ``h`` value heads, ``d_k`` and ``d_v`` head dims, ``c`` the convolution's
channels, ``w`` its width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit import _checks


class StateCache(nn.Module):
    """One linear-attention layer's state between steps, preallocated.

    Args:
        batch_size: rows decoded together.
        num_heads: the layer's value heads.
        key_head_dim: its query/key head width.
        head_dim: its value head width.
        conv_channels: the channels of its short convolution (0: none).
        conv_size: the convolution's width ``w``; the cache keeps the last ``w - 1`` inputs.
        dtype: of the state and the kept inputs: float32 (the default, as the layer computes the
            state for float32, bfloat16 and float16), float64 for a float64 layer.
        device: of the buffers.

    The buffers move with ``.to()`` but stay out of ``state_dict()``, and hold no graph: the cache
    is for inference.

    Example:
        >>> cache = StateCache(1, num_heads=4, key_head_dim=16, head_dim=16)
        >>> cache.state.shape, cache.position
        (torch.Size([1, 4, 16, 16]), 0)
    """

    def __init__(
        self,
        batch_size: int,
        num_heads: int,
        key_head_dim: int,
        head_dim: int,
        *,
        conv_channels: int = 0,
        conv_size: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for value, name in (
            (batch_size, "batch_size"),
            (num_heads, "num_heads"),
            (key_head_dim, "key_head_dim"),
            (head_dim, "head_dim"),
        ):
            _checks.check_positive_int(value, name)
        if conv_channels or conv_size:
            _checks.check_positive_int(conv_channels, "conv_channels")
            _checks.check_positive_int(conv_size, "conv_size")
        self.batch_size, self.num_heads = batch_size, num_heads
        self.key_head_dim, self.head_dim = key_head_dim, head_dim
        self.conv_channels, self.conv_size = conv_channels, conv_size
        shape = (batch_size, num_heads, key_head_dim, head_dim)
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        self.register_buffer("state", torch.zeros(shape, dtype=dtype, device=device), False)
        conv = (batch_size, conv_channels, max(conv_size - 1, 0))
        self.register_buffer("conv", torch.zeros(conv, dtype=dtype, device=device), False)
        self.position = 0

    def reset(self) -> None:
        """Forget every token: the state and the convolution's inputs become zeros."""
        self.state.zero_()
        self.conv.zero_()
        self.position = 0

    def initial_state(self) -> Tensor | None:
        """The state the next chunk starts from (None before the first token: zeros)."""
        return self.state if self.position else None

    def convolve_inputs(self, x: Tensor) -> Tensor:
        """``x`` ``(b, c, n)``, the next ``n`` inputs of the convolution, after the ``w - 1`` it
        saw last (zeros before the first token): what a causal convolution of width ``w`` reads
        to give ``n`` outputs. The cache keeps the last ``w - 1`` of them for the next step."""
        joined = torch.cat([self.conv.to(x.dtype), x], dim=-1)
        self.conv.copy_(joined[..., joined.shape[-1] - self.conv.shape[-1] :].detach())
        return joined

    def advance(self, final_state: Tensor, n: int) -> None:
        """Keep the layer's state after a chunk of ``n`` tokens (nothing to copy where the step
        wrote it into the cache's own state)."""
        if final_state is not self.state:
            self.state.copy_(final_state.detach())
        self.position += n

    def extra_repr(self) -> str:
        return (
            f"batch_size={self.batch_size}, num_heads={self.num_heads}, key_head_dim="
            f"{self.key_head_dim}, head_dim={self.head_dim}, conv_channels={self.conv_channels}, "
            f"conv_size={self.conv_size}, position={self.position}"
        )
