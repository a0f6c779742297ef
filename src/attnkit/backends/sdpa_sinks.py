"""Learned sinks on torch's fused flash kernels, through the log-sum-exp they return.

torch's public ``scaled_dot_product_attention`` returns the output only. Its flash kernels (CUDA's,
for half precision, and the CPU's) also return the row's log-sum-exp ``lse``, from which a sink joins
the output exactly ([`attnkit.backends.sinks`][attnkit.backends.sinks]):

    lse' = logaddexp(lse, z_h),    y = out * exp(lse - lse')

``y`` is the attention output of a softmax whose denominator holds the sink, so its backward is
the flash kernel's own backward asked about ``y`` and ``lse'`` instead of ``out`` and ``lse``: the
kernel recomputes the weights as ``exp(score - lse')``, which are those of ``y``, and takes its row
term ``D = dy . y`` from the output it is given. The sink's own gradient is
``-sum(dy . y * exp(z_h - lse'))`` over the batch and the rows. One kernel each way, as plain
attention, and one pass over the output.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.backends.base import AttentionOutput, Call
from attnkit.backends.reference import reference
from attnkit.backends.sinks import join as join_sinks
from attnkit.masks import Masks

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def refuses(call: Call) -> str | None:
    """Why torch's flash kernel cannot run ``call``, which has sinks, on this path (None if it can):
    the kernel masks causally (``t == s``, or one query) or not at all and takes no bias; its
    dropout would have to be drawn again in the backward."""
    q, k = call.q, call.k
    t, s = q.shape[-2], k.shape[-2]
    masks = call.masks
    unmasked = masks.window is None and masks.key_mask is None and masks.attn_mask is None
    if not (unmasked or (masks.is_causal_only and (t == s or t == 1))):
        return "sinks with a mask other than causal over as many keys as queries"
    others = call.options & {"alibi_slopes", "dropout_p"}
    if others:
        return f"sinks with {', '.join(sorted(others))}"
    if q.is_cuda:
        if q.dtype not in _FLASH_DTYPES or q.shape[-1] % 8 or q.shape[-1] > 256:
            return "sinks on CUDA other than float16/bfloat16 with a head dim of 8, 16, ... 256"
        if q.shape[-1] != call.v.shape[-1]:
            return "sinks on CUDA with values of another width than the keys"
        if torch.cuda.get_device_capability(q.device) < (8, 0):
            return "sinks on a GPU older than sm80, which has no flash kernel"
    elif not q.is_cpu:
        return f"sinks on {q.device.type}: torch's flash kernel runs on CPU and CUDA"
    return None


def attention_with_sinks(call: Call) -> Tensor:
    """The output of ``call`` with its sinks joined, on torch's flash kernel; the caller applies
    attnkit's rule for non-finite inputs."""
    causal = call.masks.is_causal_only and call.q.shape[-2] > 1
    return _SinksJoined.apply(call.q, call.k, call.v, call.sinks, causal, call.scale)


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float):
    """``(out, lse, state)``: torch's flash kernel, where ``state`` is what its backward takes."""
    if q.is_cuda:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
        )
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )
    return out, lse, ()


def _flash_backward(dy, q, k, v, y, lse, state, causal: bool, scale: float):
    """``(dq, dk, dv)`` from torch's flash backward, asked about the output ``y`` of weights
    ``exp(score - lse)``."""
    if q.is_cuda:
        cum_q, cum_k, max_q, max_k, seed, offset = state
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dy, q, k, v, y, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dy, q, k, v, y, lse, 0.0, causal, scale=scale
    )


class _SinksJoined(torch.autograd.Function):
    """Attention with sinks on the flash kernel, forward and backward (see the module's note). A
    backward with ``create_graph=True`` differentiates the reference backend's recomputation."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, causal: bool, scale: float):
        out, lse, state = _flash_forward(q, k, v, causal, scale)
        y, joined_lse, _ = join_sinks(AttentionOutput(out, lse), sinks, return_lse=True)
        ctx.save_for_backward(q, k, v, sinks, out, lse, joined_lse, *state[:2], *state[4:])
        ctx.state_sizes = state[2:4]
        ctx.causal, ctx.scale = causal, scale
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, sinks, out, lse, joined_lse, *state = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the flash backward has no backward
            return (*_differentiable_grads(ctx, dy, q, k, v, sinks), None, None)
        if state:
            state = (*state[:2], *ctx.state_sizes, *state[2:])
        dy = dy.contiguous()
        keep = torch.exp(lse - joined_lse).unsqueeze(-1)  # the keys' share of each row
        y = (out * keep).to(out.dtype)  # the output, made again: saved, it would double the memory
        dq, dk, dv = _flash_backward(dy, q, k, v, y, joined_lse, state, ctx.causal, ctx.scale)
        dsinks = None
        if ctx.needs_input_grad[3]:  # each row's sink share times -(dy . y), y unrounded
            share = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - joined_lse)
            row = (dy.to(lse.dtype) * out.to(lse.dtype) * keep).sum(dim=-1)
            dsinks = -(row * share).sum(dim=(0, 2)).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None


def _differentiable_grads(ctx, dy, q, k, v, sinks) -> list[Tensor | None]:
    """The gradients of q, k, v and the sinks as functions of them: the reference backend's
    recomputation, differentiated by autograd (at its ``O(t s)`` memory)."""
    masks = Masks(window=(-1, 0)) if ctx.causal else Masks()
    call = Call(q, k, v, masks, ctx.scale, sinks=sinks)
    out = reference(call).out
    inputs = (q, k, v, sinks)
    wanted = [x for x, need in zip(inputs, ctx.needs_input_grad) if need]
    grads = iter(torch.autograd.grad(out, wanted, dy, create_graph=True, allow_unused=True))
    return [next(grads) if need else None for need in ctx.needs_input_grad[:4]]
