"""Learned sinks on torch's fused kernels, through the log-sum-exp they return.

torch's public ``scaled_dot_product_attention`` returns the output only. Its flash kernels (the
CPU's, and CUDA's for half precision) and cuDNN's also return each row's log-sum-exp ``lse``, from
which a sink joins the output exactly ([`attnkit.rules.sinks`][attnkit.rules.sinks]):

    lse' = logaddexp(lse, z_h),    y = out * exp(lse - lse')

``y`` is the attention output of a softmax whose denominator holds the sink, so its backward is
the kernel's own backward asked about ``y`` and ``lse'`` instead of ``out`` and ``lse``: the kernel
recomputes the weights as ``exp(score - lse')``, which are those of ``y``, and takes its row term
``D = dy . y`` from the output it is given. The sink's own gradient is
``-sum(dy . y * exp(z_h - lse'))`` over the batch and the rows. One kernel each way, the one torch's
SDPA picks for the same call (on an H100, cuDNN's), and one pass over the output.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend

from attnkit.call import Call
from attnkit.masks import Masks
from attnkit.rules.exact import differentiable_grads
from attnkit.rules.sinks import share_of_keys

_FLASH, _CUDNN = SDPBackend.FLASH_ATTENTION.value, SDPBackend.CUDNN_ATTENTION.value
"""torch's fused kernels whose lse this path takes, as numbered by `_fused_sdp_choice`."""


def refuses(call: Call) -> str | None:
    """Why torch's fused kernels cannot run ``call``, which has sinks, on this path (None if they
    can): they mask causally (``t == s``, or one query) or not at all here, and their dropout
    would have to be drawn again in the backward; torch's SDPA would pick, for the same call, its
    flash kernel (on a CPU) or its flash or cuDNN kernel (on CUDA: half precision, a head dim they
    take), as it would under ``torch.nn.attention.sdpa_kernel``."""
    q, k = call.q, call.k
    t, s = q.shape[-2], k.shape[-2]
    masks = call.masks
    unmasked = masks.window is None and masks.key_mask is None and masks.attn_mask is None
    if not (unmasked or (masks.is_causal_only and (t == s or t == 1))):
        return "sinks with a mask other than causal over as many keys as queries"
    others = call.options & {"alibi_slopes", "dropout_p"}
    if others:
        return f"sinks with {', '.join(sorted(others))}"
    if not (q.is_cuda or q.is_cpu):
        return f"sinks on {q.device.type}: torch's fused kernels with an lse run on CPU and CUDA"
    if fused_kernel(call.q, call.k, call.v, _causal(call), call.scale) is None:
        return (
            "sinks where torch's SDPA would run neither its flash nor its cuDNN kernel (values "
            "of another width than the keys; on CUDA float32, or a head dim they do not take): "
            "those return the lse the sinks join through"
        )
    return None


def attention_with_sinks(call: Call) -> Tensor:
    """The output of ``call`` with its sinks joined, on torch's fused kernel; the caller applies
    attnkit's rule for non-finite inputs."""
    q, k, v, causal = call.q, call.k, call.v, _causal(call)
    kernel = fused_kernel(q, k, v, causal, call.scale)
    if kernel == "cudnn":  # cuDNN's kernels read strided inputs wrongly through these ops
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _SinksJoined.apply(q, k, v, call.sinks, kernel, causal, call.scale)


def _causal(call: Call) -> bool:
    return call.masks.is_causal_only and call.q.shape[-2] > 1


def fused_kernel(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> str | None:
    """``"cpu"`` (the CPU's flash kernel), ``"flash"`` or ``"cudnn"``: the kernel torch's SDPA
    picks for the call, or None for one without the lse this path needs (the memory-efficient
    kernel pads it, the math path has none)."""
    gqa = q.shape[1] != k.shape[1]
    choice = torch._fused_sdp_choice(q, k, v, None, 0.0, causal, scale=scale, enable_gqa=gqa)
    if choice == _FLASH:
        if q.is_cpu:
            return "cpu"
        # SDPA pads a head dim that is not a multiple of 8 for CUDA's flash kernel; its op does not
        return None if q.shape[-1] % 8 else "flash"
    return "cudnn" if choice == _CUDNN else None


def _forward(kernel: str, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float):
    """``(out, lse, state)`` from ``kernel``: ``lse`` ``(b, h, t)``, ``state`` what its backward
    takes."""
    aten = torch.ops.aten
    if kernel == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse, ()
    if kernel == "flash":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
        )
    else:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        )
    return out, lse.view(lse.shape[:3]), (cum_q, cum_k, max_q, max_k, seed, offset)


def _backward(kernel: str, dy, q, k, v, y, lse, state, causal: bool, scale: float):
    """``(dq, dk, dv)`` from ``kernel``'s backward, asked about the output ``y`` of weights
    ``exp(score - lse)``; ``dy`` laid out as ``y``, as cuDNN's backward needs."""
    aten = torch.ops.aten
    if kernel == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dy, q, k, v, y, lse, 0.0, causal, scale=scale
        )
    cum_q, cum_k, max_q, max_k, seed, offset = state
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention_backward(
            dy, q, k, v, y, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
        )
    lse = lse.unsqueeze(-1)  # (b, h, t, 1), as cuDNN's forward gave it
    return aten._scaled_dot_product_cudnn_attention_backward(
        dy, q, k, v, y, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal,
        scale=scale,
    )  # fmt: skip


class _SinksJoined(torch.autograd.Function):
    """Attention with sinks on one of torch's fused kernels, forward and backward (see the
    module's note). A backward with ``create_graph=True`` differentiates the reference backend's
    recomputation ([`differentiable_grads`][attnkit.rules.exact.differentiable_grads])."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, kernel: str, causal: bool, scale: float):
        out, lse, state = _forward(kernel, q, k, v, causal, scale)
        keep, _ = share_of_keys(lse, sinks)
        y = (out * keep.unsqueeze(-1)).to(out.dtype)
        ctx.save_for_backward(q, k, v, sinks, out, lse, *state[:2], *state[4:])
        ctx.sizes = state[2:4]  # the longest lengths: numbers, not tensors
        ctx.kernel, ctx.causal, ctx.scale = kernel, causal, scale
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, sinks, out, lse, *state = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the kernel's backward has no backward
            masks = Masks(window=(-1, 0)) if ctx.causal else Masks()
            call = Call(q, k, v, masks, ctx.scale, sinks=sinks)
            need_q, need_k, need_v, need_sinks = ctx.needs_input_grad[:4]
            wanted = (need_q, need_k, need_v, False, False, need_sinks)  # no slopes, no mask
            dq, dk, dv, _, _, dsinks = differentiable_grads(call, dy, None, wanted)
            return dq, dk, dv, dsinks, None, None, None
        if state:
            state = (*state[:2], *ctx.sizes, *state[2:])
        keep, joined_lse = share_of_keys(lse, sinks)
        # a row made NaN (a sink of +inf) has NaN weights, which the kernel's backward spreads
        joined_lse = joined_lse.masked_fill(keep.isnan(), float("nan"))
        keep = keep.unsqueeze(-1)
        dq = dk = dv = None
        if any(ctx.needs_input_grad[:3]):
            y = (out * keep).to(out.dtype)  # made again: saved, it would double the memory
            laid_out = dy if dy.stride() == y.stride() else torch.empty_like(y).copy_(dy)
            dq, dk, dv = _backward(
                ctx.kernel, laid_out, q, k, v, y, joined_lse, state, ctx.causal, ctx.scale
            )
        dsinks = None
        if ctx.needs_input_grad[3]:  # each row's sink share times -(dy . y), y unrounded
            share = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - joined_lse)
            row = (dy.to(lse.dtype) * out.to(lse.dtype) * keep).sum(dim=-1)
            dsinks = -(row * share).sum(dim=(0, 2)).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None
