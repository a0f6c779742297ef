"""Dropout of the attention weights without a mask in memory, for the tiled backend.

Whether the weight of query row ``i`` on key ``j`` is kept is a hash of the call's seed, the row
and the key: a counter-based generator, as FlashAttention's Philox is. The forward draws each
block's mask as it goes and the backward draws the same mask again, so neither keeps a ``(t, s)``
tensor. The C++ kernel (``tiled_dropout.h``) and the PyTorch loop compute the same hash, bit for
bit: the seed decides the mask, whichever runs.

The hash is MurmurHash3's 32-bit finaliser, applied twice: once to the seed and the row's index
(``(batch * h + head) * t + i``), once to that and the key's index. A weight is dropped where the
hash falls below ``p * 2**32``; the kept ones are scaled by ``1 / (1 - p)``, so that the output's
expectation is the output without dropout. The seed is drawn from torch's default generator at
each call, so ``torch.manual_seed`` makes a run repeat.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from attnkit import force
from attnkit._tracing import traced
from attnkit.kernels import loader

_M32 = 0xFFFFFFFF
ROW_MULTIPLIER = 0x9E3779B1
"""Spreads a row's index over 32 bits before the row's hash (the golden ratio's)."""
KEY_MULTIPLIER = 0x85EBCA77
"""Spreads a key's index likewise before the weight's hash."""
KERNEL = loader.KERNELS["tiled"]


class Dropout(NamedTuple):
    """One call's dropout: its probability and the seed its masks come from."""

    p: float
    seed: int  # in [0, 2**32)

    @staticmethod
    def drawn(p: float) -> Dropout:
        """A dropout of probability ``p`` with a seed from torch's default generator."""
        return Dropout(p, int(torch.randint(0, 2**32, (), dtype=torch.int64)))

    @property
    def threshold(self) -> int:
        """A weight whose hash is below this is dropped."""
        return min(round(self.p * 2**32), _M32)

    @property
    def scale(self) -> float:
        """What the kept weights are multiplied by."""
        return 1.0 / (1.0 - self.p)


def fmix32(x: Tensor) -> Tensor:
    """MurmurHash3's finaliser on int64 tensors holding 32-bit values (products are taken modulo
    ``2**32``: int64 multiplication wraps, and the low 32 bits are the same)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def row_hashes(dropout: Dropout, rows: Tensor) -> Tensor:
    """Each row's hash, from its index ``(batch * h + head) * t + i`` (int64)."""
    return fmix32(dropout.seed ^ ((rows * ROW_MULTIPLIER) & _M32))


def kept(dropout: Dropout, rows: Tensor, keys: Tensor) -> Tensor:
    """Which weights are kept: bool, ``rows``' shape plus ``keys``' (row and key indices, int64)."""
    hashes = row_hashes(dropout, rows)[..., None] ^ ((keys * KEY_MULTIPLIER) & _M32)
    return fmix32(hashes) >= dropout.threshold


def keep_scale(
    dropout: Dropout, b: int, h: int, t: int, i0: int, i1: int, j0: int, j1: int, device, dtype
) -> Tensor:
    """The block ``[i0, i1) x [j0, j1)`` of the factors the weights are multiplied by, ``(b, h,
    i1 - i0, j1 - j0)``: ``1 / (1 - p)`` where kept, 0 where dropped. In float32 on a CPU, from
    the C++ kernel where a build of it is at hand (`_native_factors`)."""
    factors = _native_factors(dropout, b, h, t, i0, i1, j0, j1, torch.device(device), dtype)
    if factors is not None:
        return factors
    heads = torch.arange(b * h, device=device).view(b, h, 1) * t
    rows = heads + torch.arange(i0, i1, device=device)
    keep = kept(dropout, rows, torch.arange(j0, j1, device=device))
    return keep.to(dtype) * dropout.scale


def _native_factors(
    dropout: Dropout, b: int, h: int, t: int, i0: int, i1: int, j0: int, j1: int, device, dtype
) -> Tensor | None:
    """`keep_scale` by the tiled C++ kernel's hash, the same bit for bit: torch's operations on
    int64 take several passes over the block for each of the hash's steps, which made a call that
    returns its ``(t, s)`` weights after dropout spend most of its time on them. None where the
    kernel does not run (another device or dtype, ``torch.compile``, the loop forced) or no build
    of it is at hand: a call that runs the PyTorch loop never waits for a build for this."""
    if device.type != "cpu" or dtype != torch.float32 or traced() or force.loop_only():
        return None
    kernel = KERNEL.load_at_hand()
    if kernel is None:
        return None
    factors = kernel.dropout_factors(b * h, t, i0, i1, j0, j1, dropout.p, dropout.seed)
    return factors.view(b, h, i1 - i0, j1 - j0)
