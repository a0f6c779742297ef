"""The chunked form of the gated delta rule on the C++ kernel (``delta_chunks.h`` and
``delta_chunks_backward.h``, in the linear kernel's build), forward and backward, as an autograd
function: the path the ``"chunked"`` backend takes on CPU tensors outside ``torch.compile``.

The kernel sums in float32 over packed sequences (every batch row one of them), a work item for
each (sequence, value head) on every thread; its products are float32, or bf16 for bf16 inputs on a
CPU with AVX512-BF16. Its backward recomputes each chunk from the state at
the chunk's start; those states are kept by the forward where a gradient will be wanted
([`KEEP_STATES`][attnkit.linear.kernel.KEEP_STATES]).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from attnkit._tracing import traced
from attnkit.kernels import loader

KERNEL = loader.KERNELS["linear"]
"""The C++ build that holds the chunked kernel."""

KEEP_STATES = True
"""Whether a forward that will be differentiated keeps every chunk's starting state (one
``(d_k, d_v)`` float32 state per 64 tokens and value head: two thirds of the size of ``q``, ``k``
and ``v`` at heads of 128) for the backward, rather than the backward recomputing them with a
first pass over the chunks. Keeping them makes a training step faster (``docs/bench`` has the
figures of both)."""


def refuses(tensors: list[Tensor]) -> str | None:
    """Why the kernel cannot run a call on these tensors, or None (never builds or loads it)."""
    if not all(x.is_cpu for x in tensors):
        return "not CPU tensors"
    if traced() or torch._C._are_functorch_transforms_active():
        return "inside torch.compile or a torch.func transform"
    usable, why = KERNEL.usable()
    return None if usable else f"without its kernel: {why}"


def chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor | None,
    state: Tensor,
    bounds: Tensor,
    *,
    eps: float,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Packed sequences in chunks, in float32. The kernel L2-normalises ``q`` and ``k`` with
    ``eps`` (none where it is negative) and scales ``q`` as it reads them, forward and backward:
    no normalised copy of them is made.

    Args:
        q: ``(tokens, h_k, d_k)``.
        k: ``(tokens, h_k, d_k)``.
        v: ``(tokens, h, d_v)``, ``h`` a multiple of ``h_k``.
        g: ``(tokens, h)`` log decays (raised to the floor), or None.
        beta: ``(tokens, h)`` write strengths, or None.
        state: ``(N, h, d_k, d_v)``, each sequence's state before its first token.
        bounds: ``(N + 1,)`` offsets of the sequences in ``tokens``.

    Returns:
        ``(o, final)``: ``(tokens, h, d_v)`` and ``(N, h, d_k, d_v)``, float32, differentiable
        with respect to every tensor but ``bounds``.

    Raises:
        attnkit.kernels.loader.KernelUnavailableError: the kernel could not be built or loaded.
    """
    kernel = KERNEL.require("the delta rule's chunked kernel")
    prepare = (float(eps), float(scale), q.dtype == torch.bfloat16)
    bounds = bounds.to("cpu", torch.int64).contiguous()  # the kernel reads it as it lies
    return _Chunked.apply(q, k, v, g, beta, state, bounds, prepare, kernel)


def _float(x: Tensor | None) -> Tensor:
    """``x`` as the kernel reads it: contiguous float32, or an empty tensor for None."""
    return torch.empty(0) if x is None else x.detach().float().contiguous()


def _rows(x: Tensor) -> Tensor:
    """``q``, ``k`` or ``v`` as the kernel reads it: contiguous, bf16 as it is (the kernel converts
    each row as it gathers it), any other dtype as float32."""
    x = x.detach()
    return x.contiguous() if x.dtype == torch.bfloat16 else x.float().contiguous()


class _Chunked(torch.autograd.Function):
    """The kernel's forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, state, bounds, prepare, kernel):
        inputs = [*map(_rows, (q, k, v)), *map(_float, (g, beta, state))]
        keep = KEEP_STATES and any(ctx.needs_input_grad[:6])
        o, final, kept = kernel.delta_chunks_forward(*inputs, bounds, *prepare, keep)
        ctx.save_for_backward(*inputs, bounds, kept)
        ctx.kernel, ctx.prepare = kernel, prepare
        ctx.given = (g is not None, beta is not None)
        return o, final

    @staticmethod
    @once_differentiable
    def backward(ctx, d_o, d_final):
        q, k, v, g, beta, state, bounds, kept = ctx.saved_tensors
        d_final = torch.empty(0) if d_final is None else d_final.float().contiguous()
        d_o = torch.zeros(v.shape) if d_o is None else d_o.float().contiguous()
        dq, dk, dv, dg, dbeta, d_state = ctx.kernel.delta_chunks_backward(
            q, k, v, g, beta, state, bounds, *ctx.prepare, kept, d_o, d_final
        )
        has_g, has_beta = ctx.given
        dg, dbeta = (dg if has_g else None), (dbeta if has_beta else None)
        return dq, dk, dv, dg, dbeta, d_state, None, None, None
