"""attnkit's rule for NaN and infinity, the pieces the backends share.

A query *selects* the keys it may see: a key it may not see never enters its arithmetic. A score
made non-finite by the inputs (q, k, a float mask, the ALiBi slopes) is NaN, never a mask; a NaN
spreads to every output it touches; a row with no allowed key is 0. The reference backend applies
the rule to its materialised scores; the kernels to the rows of q and k before their products
(a query or key row with a NaN or an infinity gives a non-finite score with every partner).

Finding non-finite values costs a pass over the data. In eager mode the cheap pass decides whether
the exact one is needed; inside ``torch.compile`` or a ``torch.func`` transform, where Python
cannot branch on data, the exact path always runs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit import force
from attnkit._tracing import traced
from attnkit.kernels.finite import values_finite

NAN = float("nan")


def nan_unless_finite(scores: Tensor) -> Tensor:
    """A score made infinite or NaN by the inputs is NaN, never a mask: ``-inf`` would silently drop
    a key, ``+inf`` take all the weight. Only the masks make a key invisible."""
    return scores.where(torch.isfinite(scores), NAN)


def can_branch_on_data(*tensors: Tensor) -> bool:
    """Whether Python may look at these tensors' values: plain CPU tensors in eager mode (not while
    compiling, tracing or under a ``torch.func`` transform or a dispatch mode, where a branch would
    be frozen or refused; not on an accelerator, where a look costs a synchronisation, nor inside
    [`force.blind`][attnkit.force.blind], which runs a CPU as one)."""
    if (
        force.is_blind()
        or traced()
        or torch.jit.is_tracing()
        or torch._C._are_functorch_transforms_active()
        or torch._C._len_torch_dispatch_stack() > 0
    ):
        return False
    for x in tensors:  # noqa: SIM110 - a loop, not all(): no generator on every call
        if type(x) is not Tensor or not x.is_cpu:
            return False
    return True


def all_finite(*tensors: Tensor) -> bool:
    """Whether Python may look at the tensors (`can_branch_on_data`) and every value of each is
    finite, in one pass over each: the common case, in which no row needs the exact check."""
    return can_branch_on_data(*tensors) and values_finite(tensors)


def inputs_finite(*queries: Tensor, keys: Tensor, nonfinite_keys: Tensor | None = None) -> bool:
    """Whether Python may look and every value of ``queries`` and ``keys`` is finite; for the keys,
    from the caller's record of their rows where there is one (``s`` flags, not ``s * d`` values:
    a cache's, [`KVCache.nonfinite_keys`][attnkit.cache.KVCache.nonfinite_keys])."""
    if nonfinite_keys is None:
        return all_finite(*queries, keys)
    known = nonfinite_keys
    return can_branch_on_data(known) and not bool(known.any()) and all_finite(*queries)


def nonfinite_rows(x: Tensor) -> Tensor:
    """``(...)`` True where a row ``x[..., :]`` holds a NaN or an infinity.

    Where Python may look, one pass over the whole of ``x`` decides (`all_finite`), and the
    exact check by rows (`zero_or_nan_rows`) runs only when it finds a value that is not finite
    (the one pass is much faster than torch's ``isfinite(x).all(-1)``: docs/bench/choices.md)."""
    if all_finite(x):
        return torch.zeros(x.shape[:-1], dtype=torch.bool, device=x.device)
    return torch.isnan(zero_or_nan_rows(x))


def zero_or_nan_rows(x: Tensor) -> Tensor:
    """``(...)`` 0 where the row ``x[..., :]`` is finite, NaN where it holds a NaN or an infinity.

    The rows' products with zeros, summed: exact, since ``0 * x`` is 0 or NaN and never overflows,
    and a sum of them is NaN as soon as one is, with no branch on data. On a GPU a batched matrix product reads ``x`` once at
    the memory's bandwidth (`_products_with_zeros`); elsewhere ``x * 0`` is summed by rows."""
    x = x.detach()
    if x.is_cpu or traced():
        return (x * 0).sum(dim=-1)
    products = _products_with_zeros(x)
    return _largest_times_zero(x) if products is None else products


def _largest_times_zero(x: Tensor) -> Tensor:
    """`zero_or_nan_rows` from each row's largest magnitude (inf or NaN where the row holds a value
    that is not finite) times 0: exact, and on a GPU one reduction that reads ``x`` once where
    ``x * 0`` would write a copy of it first."""
    return torch.linalg.vector_norm(x, ord=math.inf, dim=-1) * 0


def _products_with_zeros(x: Tensor) -> Tensor | None:
    """`zero_or_nan_rows` of a 4-D ``x`` as one batched product with a vector of zeros. A batched
    matrix product reads ``x`` at the GPU's memory bandwidth, where a reduction by rows reads it at
    a fraction of that (``scripts/gpu-row-checks.py``). None where ``x``'s rows are not one strided
    batch (a transposed view is taken in its memory order)."""
    if x.dim() != 4 or x.stride(-1) != 1:
        return None
    order = sorted(range(3), key=lambda i: -x.stride(i))  # outermost first
    rows = x.permute(*order, 3)
    a, b, r, d = rows.shape
    if a > 1 and b > 1 and rows.stride(0) != b * rows.stride(1):
        return None  # the two outer dims are not one batch of equal strides
    zero = x.new_zeros(1, d, 1).expand(a * b, d, 1)
    products = torch.bmm(rows.flatten(0, 1), zero).view(a, b, r)
    return products.permute(*[order.index(i) for i in range(3)])


def nan_rows(x: Tensor) -> Tensor:
    """``x`` with every row that holds a NaN or an infinity made all NaN: its scores are then NaN
    with every partner, before any product (``tanh(inf)`` would hide an infinite score, a ``-inf``
    one pass for a mask). ``x`` itself when every row is finite, where Python may look."""
    if all_finite(x):
        return x
    return x.masked_fill(nonfinite_rows(x)[..., None], NAN)


def may_hold_nonfinite(*tensors: Tensor) -> bool:
    """Whether to take a careful path for non-finite values: where Python may look, whether one of
    the tensors may hold a NaN or an infinity (not `all_finite`; with torch's sums, rarely, an
    overflow says so too: the careful path is right then too, only slower); elsewhere, always."""
    return not all_finite(*tensors)
