"""The tiled backend's C++ kernel (``tiled.cpp``): the same algorithm as the PyTorch loop of
:mod:`attnkit.backends.tiled_loop`, with each block's score work fused into a few passes over rows
that stay in cache. It runs where the block products are float32 on a CPU (every CPU dtype but
float64, unless the CPU has fast half-precision products), outside ``torch.compile``'s tracing, and
where it could be built (:mod:`attnkit.backends._native`).

This module takes the operands as the kernel wants them (contiguous float32, q pre-scaled) and the
call's plan (:class:`attnkit.backends.tiled_loop.Plan`), and passes the masks in the kernel's form.
"""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attnkit.backends._native import Kernel

if TYPE_CHECKING:
    from attnkit.backends.tiled_loop import Plan

KERNEL = Kernel("tiled.cpp", ("-O3", "-fno-math-errno", "-fno-trapping-math"))
_EMPTY = {dtype: torch.empty(0, dtype=dtype) for dtype in (torch.float32, torch.bool)}


def marked(name: str) -> contextlib.AbstractContextManager:
    """A profiler range: ``attnkit::tiled_{native,loop}_{forward,backward}`` say which path ran.
    A no-op under torch.compile, whose graphs drop such ranges (with a warning)."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch.profiler.record_function(name)


def kernel_for(device: torch.device, matmul_dtype: torch.dtype) -> ModuleType | None:
    """The C++ kernel if it can run a call with these block products, else None."""
    if device.type != "cpu" or matmul_dtype != torch.float32:
        return None
    if torch.compiler.is_compiling():  # dynamo traces the PyTorch loop; it cannot trace C++
        return None
    return KERNEL.load()


def options(plan: Plan) -> tuple:
    """The request as the C++ kernel takes it: bias, allowed, key_mask, alibi, softcap, window."""
    req = plan.request
    shape = (plan.b, plan.h_kv * plan.groups, plan.t, plan.s)
    bias, allowed = _EMPTY[torch.float32], _EMPTY[torch.bool]
    mask = req.masks.attn_mask
    if mask is not None and mask.dtype == torch.bool:
        allowed = mask.expand(shape)
    elif mask is not None:
        bias = mask.detach().to(torch.float32).expand(shape)
    key_mask = req.masks.key_mask
    key_mask = _EMPTY[torch.bool] if key_mask is None else key_mask.contiguous()
    slopes = req.alibi_slopes
    slopes = _EMPTY[torch.float32] if slopes is None else slopes.to(torch.float32).contiguous()
    left, right = req.masks.window or (-1, -1)
    return bias, allowed, key_mask, slopes, req.softcap or 0.0, left, right


def forward(
    kernel: ModuleType, operands: tuple[Tensor, Tensor, Tensor], plan: Plan
) -> tuple[Tensor, Tensor]:
    """``(out, lse)``, float32, from the pre-scaled q, k and v."""
    with marked("attnkit::tiled_native_forward"):
        return kernel.forward(*operands, *options(plan), plan.block_q, plan.block_k)


def backward(
    kernel: ModuleType,
    dout: Tensor,
    operands: tuple[Tensor, Tensor, Tensor],
    lse: Tensor,
    delta: Tensor,
    plan: Plan,
    slopes_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients of the pre-scaled q, of k, of v and of the slopes (if ``slopes_grad``), float32.
    ``delta`` is ``dO_i . O_i - dlse_i``; rows of ``lse`` at -inf (no key) are read as 0."""
    dout = dout.to(torch.float32).contiguous()
    lse = lse.masked_fill(lse == float("-inf"), 0.0).contiguous()
    with marked("attnkit::tiled_native_backward"):
        dq, dk, dv, dslopes = kernel.backward(
            dout,
            *operands,
            lse,
            delta.contiguous(),
            *options(plan),
            plan.block_q,
            plan.block_k,
            slopes_grad,
        )
    return dq, dk, dv, dslopes if slopes_grad else None
