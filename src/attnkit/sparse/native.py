"""Top-k sparse attention on the C++ kernel (``sparse.cpp``), forward and backward, as an
autograd function: the path the sparse backend takes on CPU tensors outside ``torch.compile``
and ``torch.func``.

The forward gathers, for each query, the rows of K and V its indices name and keeps only the
output and the log-sum-exp; the backward recomputes each query's weights from them, so nothing of
size ``t * n`` is kept. A backward run with ``create_graph=True`` differentiates the PyTorch form
([`attnkit.sparse.gather`][attnkit.sparse.gather]) instead, so that second derivatives are exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import force
from attnkit._tracing import traced
from attnkit.call import Call
from attnkit.kernels import loader
from attnkit.sparse import gather

KERNEL = loader.KERNELS["sparse"]
"""The C++ build of the sparse kernel."""

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes the kernel takes (its sums are float32; float64 runs in PyTorch)."""

MAX_GROUPS = 256
"""The most query heads per key/value head that the kernel takes."""


def refuses(call: Call) -> str | None:
    """Why the kernel cannot run ``call``, or None (never builds or loads it)."""
    q = call.q
    if force.gather_only():
        return "forced off (attnkit.force.forced('sparse:gather'))"
    if not q.is_cpu:
        return "not CPU tensors"
    if traced() or torch._C._are_functorch_transforms_active():
        return "inside torch.compile or a torch.func transform"
    if q.dtype not in DTYPES:
        return f"{q.dtype} (the kernel sums in float32)"
    if q.shape[1] // call.k.shape[1] > MAX_GROUPS:
        return f"more than {MAX_GROUPS} query heads per key/value head"
    usable, why = KERNEL.usable()
    return None if usable else f"without its kernel: {why}"


def pair_products(call: Call) -> bool:
    """Whether the kernel's scores for ``call`` are bf16 pair products (vdpbf16ps, sums in
    float32): bf16 inputs whose key head dim is a multiple of 32, a build with AVX512-BF16."""
    if call.q.dtype != torch.bfloat16 or call.q.shape[-1] % 32:
        return False
    return KERNEL.has_avx512_bf16()


def attend(call: Call) -> tuple[Tensor, Tensor]:
    """``(out (b, h, t, d_v), lse (b, h, t) float32)`` of ``call`` on the kernel, differentiable."""
    masks = call.masks
    window = masks.window if masks.window is not None else (-1, -1)
    settings = (call.scale, window, masks.shift)
    return _Sparse.apply(call.q, call.k, call.v, call.indices, masks.key_mask, settings, call)


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _options(options, key_mask: Tensor | None, settings: tuple) -> object:
    scale, (left, right), shift = settings
    options.scale, options.window_left, options.window_right, options.shift = (
        scale,
        left,
        right,
        shift,
    )
    if key_mask is not None:
        options.key_mask = key_mask.contiguous()
    return options


class _Sparse(torch.autograd.Function):
    """The kernel's forward and backward; the PyTorch form's where a backward is differentiated."""

    @staticmethod
    def forward(ctx, q, k, v, indices, key_mask, settings, call):
        kernel = KERNEL.require("sparse attention's C++ kernel")
        indices = indices.contiguous()
        operands = (_last_dim_contiguous(x.detach()) for x in (q, k, v))
        options = _options(kernel.SparseOptions(), key_mask, settings)
        out, lse = kernel.forward(*operands, indices, options)
        ctx.save_for_backward(q, k, v, out, lse, indices, key_mask)
        # the call without its tensors: the backward puts the saved ones back
        ctx.kernel, ctx.settings, ctx.call = kernel, settings, call.with_tensors(*[None] * 6)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor | None, dlse: Tensor | None):
        q, k, v, out, lse, indices, key_mask = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiate the PyTorch form
            call = ctx.call.with_tensors(q, k, v, None, None, key_mask)
            return _differentiable(call._replace(indices=indices), dout, dlse)
        if dout is None:
            dout = torch.zeros_like(out)
        delta = (dout.float() * out.float()).sum(-1)
        if dlse is not None:
            delta = delta - dlse
        options = _options(ctx.kernel.SparseBackwardOptions(), key_mask, ctx.settings)
        options.dout = _last_dim_contiguous(dout.to(q.dtype))
        options.lse, options.delta = lse.contiguous(), delta.contiguous()
        operands = (_last_dim_contiguous(x.detach()) for x in (q, k, v))
        dq, dk, dv = ctx.kernel.backward(*operands, indices, options)
        return dq, dk.sum(0).to(k.dtype), dv.sum(0).to(v.dtype), None, None, None, None


def _differentiable(call: Call, dout: Tensor | None, dlse: Tensor | None) -> tuple:
    """The gradients of q, k and v as functions of the inputs (``create_graph=True``): the
    PyTorch form recomputed and differentiated, so that a second derivative is exact."""
    inputs = [x for x in (call.q, call.k, call.v) if x.requires_grad]
    with torch.enable_grad():
        out, lse = gather.attend(call)
        pairs = [(y, dy) for y, dy in ((out, dout), (lse, dlse)) if dy is not None]
        grads = torch.autograd.grad(
            [y for y, _ in pairs],
            inputs,
            [dy for _, dy in pairs],
            create_graph=True,
            allow_unused=True,
        )
    found = iter(grads)
    result = [next(found) if x.requires_grad else None for x in (call.q, call.k, call.v)]
    return (*result, None, None, None, None)
