"""A module run over a sequence split across ranks: [`ContextParallel`][attnkit.distributed.ContextParallel]."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from attnkit.distributed.layout import chunks
from attnkit.distributed.ring import ring_attention
from attnkit.distributed.transport import DEFAULT_TIMEOUT, Ring


@dataclass(frozen=True)
class ContextParallel:
    """How a module runs over a sequence split across the ranks of ``group``: pass it as
    ``MultiHeadAttention(...)(x, context_parallel=ContextParallel(...))``, ``x`` being this
    rank's shard cut by ``layout`` (see [`shard`][attnkit.distributed.shard]). The module's
    projections run on the shard, its RoPE at the tokens' global positions, and its attention
    call becomes [`ring_attention`][attnkit.distributed.ring_attention] with the same options.

    Example:
        ``out = mha(shard(x, 1, layout="zigzag"), context_parallel=ContextParallel(layout="zigzag"))``
        gives on each rank ``shard(mha(x), 1, layout="zigzag")``; the gradient of ``x`` is the
        shard of the whole one, and each parameter's is this rank's part: sum it over the
        group (DDP does), as for any parameter every rank holds.

    RoPE takes each token's index in the whole sequence as its position (a ``key_mask`` does not
    move the positions, unlike an unsplit call with left padding, where they count real tokens).
    """

    group: dist.ProcessGroup | None = None
    layout: str = "contiguous"
    timeout: float = DEFAULT_TIMEOUT

    def size(self) -> int:
        """How many ranks the sequence is split over."""
        return Ring.of(self.group, self.timeout).size

    def positions(self, t: int, device: torch.device | None = None) -> Tensor:
        """The global positions ``(t,)`` of this rank's ``t`` tokens."""
        ring = Ring.of(self.group, self.timeout)
        pieces = chunks(t * ring.size, ring.size, self.layout)[ring.rank]
        return torch.cat([torch.arange(start, start + n, device=device) for start, n in pieces])

    def attention(self, q: Tensor, k: Tensor, v: Tensor, **options) -> Tensor:
        """[`ring_attention`][attnkit.distributed.ring_attention] over this group and layout."""
        return ring_attention(
            q, k, v, group=self.group, layout=self.layout, timeout=self.timeout, **options
        )
