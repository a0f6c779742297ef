"""The projections' matrix-vector product for a decoding step: a module's query, key and value
projections of a few rows in one pass of the threads over every weight, where torch's
matrix-vector product runs on one thread. The C++ code is ``gemv.h``, bound in the decode
kernel's build ([`attnkit.backends.decode`][attnkit.backends.decode] runs its attention).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.overrides import has_torch_function

from attnkit._tracing import traced
from attnkit.kernels import loader

KERNEL = loader.KERNELS["decode"]
"""The C++ build that holds the product."""

MAX_ROWS = 16
"""The most rows a call computes (a decoding step's few tokens times the batch)."""

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LINEAR_FORWARD = nn.Linear.forward  # a forward patched on the class later is called instead


def runs_linear(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None]) -> bool:
    """Whether [`linear`][attnkit.kernels.gemv.linear] computes what ``torch.nn.functional.linear`` would (its sums in another order) for each
    weight and bias: at most [`MAX_ROWS`][attnkit.kernels.gemv.MAX_ROWS] rows of plain CPU tensors of one dtype (float32,
    bfloat16 or float16), contiguous weights and biases, nothing that needs a gradient; outside
    autocast, tracing, ``torch.compile``, ``torch.func`` transforms and ``__torch_function__`` or
    dispatch modes; with a kernel at hand or to be built (checked last, so that a training step
    never looks for it)."""
    grad = torch.is_grad_enabled()
    if (
        torch.jit.is_tracing()  # first: under tracing, the shapes below would be tensors
        or not weights
        or x.dim() == 0
        or not 0 < x.numel() <= MAX_ROWS * x.shape[-1]
        or not x.is_cpu
        or x.dtype not in _DTYPES
        or (grad and x.requires_grad)
        or torch.is_autocast_enabled("cpu")
        or traced()
        or torch._C._are_functorch_transforms_active()  # vmap, grad, ...: x or a weight is wrapped
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._len_torch_dispatch_stack() > 0
    ):
        return False
    params = [*weights, *(b for b in biases if b is not None)]
    if has_torch_function((x, *params)):  # subclasses that override torch functions
        return False
    for p in params:
        if (
            not p.is_cpu
            or p.dtype != x.dtype
            or not p.is_contiguous()
            or (grad and p.requires_grad)
        ):
            return False
    return KERNEL.usable()[0]


def linear(
    x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None]
) -> list[Tensor] | None:
    """``[torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases)]`` for the few rows
    of a decoding step (see [`runs_linear`][attnkit.kernels.gemv.runs_linear]), in one pass of the threads over every weight (the
    query, key and value projections of a token in one call), where torch's matrix-vector product
    runs on one thread; None if the kernel could not be built or loaded now."""
    kernel = KERNEL.load()
    return None if kernel is None else kernel.linear(x, list(weights), list(biases))


def project(layers: Sequence[nn.Module], x: Tensor) -> list[Tensor]:
    """``[layer(x) for layer in layers]`` for a cached decoding step's few rows: one pass of the
    threads over every weight ([`linear`][attnkit.kernels.gemv.linear]) where each layer is a plain
    ``nn.Linear`` with no hooks of its own and the call fits the kernel
    ([`runs_linear`][attnkit.kernels.gemv.runs_linear]); otherwise each layer is called. Hooks
    registered for every module at once (``torch.nn.modules.module.register_module_forward_hook``)
    are not run by the fused product."""
    if all(_plain_linear(layer) for layer in layers):
        weights = [layer.weight for layer in layers]
        biases = [layer.bias for layer in layers]
        if runs_linear(x, weights, biases):
            rows = linear(x, weights, biases)
            if rows is not None:
                return rows
    return [layer(x) for layer in layers]


def _plain_linear(layer: nn.Module) -> bool:
    """Whether calling ``layer`` is ``F.linear(x, layer.weight, layer.bias)``: an ``nn.Linear``
    itself (not a subclass, not given a ``forward`` of its own) with no hooks registered on it."""
    state = vars(layer)
    return (
        type(layer) is nn.Linear
        and nn.Linear.forward is _LINEAR_FORWARD
        and "forward" not in state
        and not (state["_forward_hooks"] or state["_forward_pre_hooks"])
    )
