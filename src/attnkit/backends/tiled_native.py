"""The tiled backend's C++ kernel (``tiled.cpp``): the same algorithm as the PyTorch loop of
[`attnkit.backends.tiled_loop`][attnkit.backends.tiled_loop], with each block's score work fused into a few passes over rows
that stay in cache. It runs on a CPU where the block products are float32 (float32 inputs, and
half-precision ones on CPUs without fast half-precision products) or bf16 (bf16 inputs where its
build has AVX512-BF16), outside ``torch.compile``'s tracing, and where it could be built
(`attnkit.backends._native`).

bf16 blocks are multiplied in pairs with float32 sums (``pair_products.h``), with AVX512-BF16's
``vdpbf16ps``, in builds for CPUs that have it; a portable version of the same sums, slow, lets the
tests check that path on any CPU. Scores, softmax statistics and accumulators are float32.

This module takes the operands as the kernel wants them (contiguous, q pre-scaled, in the products'
dtype) and the call's plan ([`attnkit.backends.tiled_loop.Plan`][attnkit.backends.tiled_loop.Plan]), and passes the masks in the
kernel's form.
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
    """The C++ kernel if it can run a call with these block products, else None: float32 products
    always, bf16 ones where its build multiplies them with AVX512-BF16 (elsewhere the loop's bf16
    matrix products, oneDNN's, are the faster way)."""
    if device.type != "cpu" or matmul_dtype not in (torch.float32, torch.bfloat16):
        return None
    if torch.compiler.is_compiling():  # dynamo traces the PyTorch loop; it cannot trace C++
        return None
    kernel = KERNEL.load()
    if kernel is not None and matmul_dtype == torch.bfloat16 and pair_products(kernel) is None:
        return None
    return kernel


def pair_products(kernel: ModuleType) -> str | None:
    """How the kernel multiplies bf16 blocks: ``"avx512_bf16"`` (``vdpbf16ps``) where its build
    has it, else None (bf16 products then run in the loop). The tests return ``"portable"`` here to
    run the kernel's portable version of the same sums on any CPU."""
    return "avx512_bf16" if kernel.has_avx512_bf16() else None


def products(kernel: ModuleType, matmul_dtype: torch.dtype) -> str:
    """The block products as [`attnkit.functional.which_backend`][attnkit.functional.which_backend] names them: ``"float32"``,
    ``"bf16-avx512_bf16"`` or ``"bf16-portable"``."""
    return "float32" if matmul_dtype == torch.float32 else f"bf16-{pair_products(kernel)}"


def _route(kernel: ModuleType) -> int:
    return 1 if pair_products(kernel) == "avx512_bf16" else 0


def _even(x: Tensor) -> Tensor:
    """bf16 operands are multiplied in pairs along the head dim: an odd one gets a zero column."""
    if x.dtype == torch.float32 or x.shape[-1] % 2 == 0:
        return x
    return torch.nn.functional.pad(x, (0, 1))


def options(plan: Plan) -> tuple:
    """The request as the C++ kernel takes it: bias, allowed, key_mask, alibi, softcap, window,
    shift."""
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
    return bias, allowed, key_mask, slopes, req.softcap or 0.0, left, right, req.masks.shift


def forward(
    kernel: ModuleType, operands: tuple[Tensor, Tensor, Tensor], plan: Plan
) -> tuple[Tensor, Tensor]:
    """``(out, lse)``, float32, from the pre-scaled q, k and v."""
    dv = operands[2].shape[-1]
    with marked("attnkit::tiled_native_forward"):
        out, lse = kernel.forward(
            *map(_even, operands), *options(plan), plan.block_q, plan.block_k, _route(kernel)
        )
    return out[..., :dv], lse


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
    d, d_v = operands[0].shape[-1], operands[2].shape[-1]
    dout = _even(dout.to(operands[0].dtype).contiguous())
    lse = lse.to(torch.float32).masked_fill(lse == float("-inf"), 0.0).contiguous()
    with marked("attnkit::tiled_native_backward"):
        dq, dk, dv, dslopes = kernel.backward(
            dout,
            *map(_even, operands),
            lse,
            delta.to(torch.float32).contiguous(),
            *options(plan),
            plan.block_q,
            plan.block_k,
            slopes_grad,
            _route(kernel),
        )
    return dq[..., :d], dk[..., :d], dv[..., :d_v], dslopes if slopes_grad else None
