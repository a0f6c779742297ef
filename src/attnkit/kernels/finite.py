"""The finite-values check: whether every value of some tensors is finite, in one pass over
each, as the rule for non-finite values ([`attnkit.rules.nonfinite`][attnkit.rules.nonfinite])
asks before it decides whether a row needs the exact check.

The C++ check (``finite_values.h``) lives in the tiled kernel's build; it is used where that build
is already at hand, never loaded or built for a check alone.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit.kernels import loader

KERNEL = loader.KERNELS["tiled"]
"""The C++ build whose check of values `values_finite` calls, where one is at hand."""


def _finite(x: Tensor) -> bool:
    """Whether every value of ``x`` is finite, in one pass of torch's: for float32 and float64
    their sum (not finite if a value is not, and, rarely, on overflow: a caller's exact check then
    decides); for half precision their min and max, faster than a sum widened to float32
    (docs/bench/choices.md)."""
    if x.numel() == 0:
        return True
    if x.requires_grad:  # no graph for a look
        x = x.detach()
    if x.dtype in (torch.float16, torch.bfloat16):
        low, high = torch.aminmax(x)  # a NaN anywhere makes both NaN
        return bool(torch.isfinite(low) & torch.isfinite(high))
    return math.isfinite(x.sum().item())  # a Python float: no tensor operation more


def values_finite(tensors: tuple[Tensor, ...]) -> bool:
    """Whether every value of each tensor is finite, where Python may look at them: in one call of
    the C++ check of the tiled kernel's build (``finite_values.h``: exact, no tensor made) where
    one is at hand and it reads the tensors whole (dense, of a float type); else by `_finite` for
    each. On a small call the check is a good part of attnkit's own time around SDPA, and
    torch's way costs a dispatch, a tensor and a read back per input (docs/bench/choices.md)."""
    kernel = KERNEL.load_at_hand()
    finite = None if kernel is None else kernel.all_finite(tensors)
    return all(_finite(x) for x in tensors) if finite is None else finite
