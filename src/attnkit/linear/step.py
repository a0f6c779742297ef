"""A decoding step of the gated delta rule on the C++ kernel (``delta_step.h``, in the linear
kernel's build): one token per sequence, each head's state read twice and written once, in place
where the caller asks (``inplace_final_state``: a layer's cache). It keeps no graph: a step of
generation, not of training.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.linear import kernel

KERNEL = kernel.KERNEL
"""The C++ build that holds the step (and the chunked kernel)."""

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def refuses(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
) -> str | None:
    """Why the step cannot run this call, or None (never builds or loads the kernel)."""
    if q.shape[1] != 1 or cu_seqlens is not None:
        return "more than one token a sequence (the step takes one)"
    tensors = [x for x in (q, k, v, g, beta, initial_state) if x is not None]
    if q.dtype not in _DTYPES:
        return "not float32, bfloat16 or float16 tensors"
    if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
        return "a gradient is wanted (the step keeps no graph)"
    return kernel.refuses(tensors)  # the same build as the chunked kernel's


def step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor | None,
    state: Tensor,
    *,
    eps: float,
    scale: float,
    g_floor: float,
) -> Tensor:
    """``o`` ``(b, 1, h, d_v)`` of one token, ``state`` ``(b, h, d_k, d_v)`` (contiguous float32)
    updated in place. The kernel L2-normalises ``q`` and ``k`` ``(b, 1, h_k, d_k)`` with ``eps``
    (none where it is negative), scales ``q`` by ``scale`` and raises ``g`` to ``g_floor``: in its
    one pass, where torch's operations would each cost more than the state's read.

    Raises:
        attnkit.kernels.loader.KernelUnavailableError: the kernel could not be built or loaded.
    """
    built = KERNEL.require("the delta rule's step")
    none = torch.empty(0)

    def flat(x: Tensor | None) -> Tensor:
        return none if x is None else x[:, 0].float().contiguous()

    o = built.delta_step(state, flat(q), flat(k), flat(v), flat(g), flat(beta), eps, scale, g_floor)
    return o[:, None]
