"""The tiled backend's C++ kernel (``tiled.cpp``): the same algorithm as the PyTorch loop of
[`attnkit.tiled.loop`][attnkit.tiled.loop], with each block's score work fused into a few passes over rows
that stay in cache. It runs on a CPU where the block products are float32 (float32 inputs, and
half-precision ones on CPUs without fast half-precision products) or bf16 (bf16 inputs where its
build has AVX512-BF16), outside ``torch.compile``'s tracing, and where it could be built
(`attnkit.kernels.loader`).

bf16 blocks are multiplied in pairs with float32 sums (``pair_products.h``), with AVX512-BF16's
``vdpbf16ps``, in builds for CPUs that have it; a portable version of the same sums, slow, lets the
tests check that path on any CPU. Scores, softmax statistics and accumulators are float32.

This module takes the operands in the products' dtype, q pre-scaled, and the call's plan
([`attnkit.tiled.loop.Plan`][attnkit.tiled.loop.Plan]); it hands the kernel each operand where it lies if it
can read it so (`_readable`), and the rest in the kernel's form: one
``TiledOptions``, filled once (`options`). The kernel writes its results into tensors it is given,
in the inputs' dtypes and layouts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from attnkit import mods
from attnkit._tracing import traced
from attnkit.mods import Block

if TYPE_CHECKING:
    from attnkit.tiled.loop import Plan


def marked(name: str) -> contextlib.AbstractContextManager:
    """A profiler range: ``attnkit::tiled_{native,loop}_{forward,backward}`` say which path ran.
    A no-op under torch.compile, whose graphs drop such ranges (with a warning)."""
    if traced():
        return contextlib.nullcontext()
    return torch.profiler.record_function(name)


def _readable(x: Tensor) -> Tensor:
    """``x`` as the kernel reads it, with no copy where it can: rows of contiguous entries, any other
    strides (a transposed view of a module's projections is read as it lies). bf16 rows are read
    as pairs of entries: an even head dim (an odd one gets a zero column), even strides and 4-byte
    aligned data, else a contiguous copy."""
    if x.dtype == torch.bfloat16 and x.shape[-1] % 2:
        return torch.nn.functional.pad(x, (0, 1))
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        return x.contiguous()
    if x.dtype == torch.bfloat16 and not _pairs_aligned(x):
        return x.contiguous()
    return x


def _pairs_aligned(x: Tensor) -> bool:
    if x.data_ptr() % 4:
        return False
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):  # a loop: no generator per call
        if size != 1 and stride % 2:
            return False
    return True


def options(kernel: ModuleType, plan: Plan) -> object:  # the kernel's TiledOptions
    """The call as the C++ kernel's forward takes it: one ``TiledOptions`` (``tiled.cpp``),
    filled from the plan alone. Masks and slopes the call lacks stay the kernel's empty
    defaults."""
    return _filled(kernel.TiledOptions(), plan, tiles(plan))


def _filled(opts, plan: Plan, tiling: Tiles):
    call = plan.call
    shape = (plan.b, plan.h_kv * plan.groups, plan.t, plan.s)
    mask = call.masks.attn_mask
    if mask is not None and mask.dtype == torch.bool:
        opts.allowed = mask.expand(shape)
    elif mask is not None:
        opts.bias = mask.detach().to(torch.float32).expand(shape)
    if call.masks.key_mask is not None:
        opts.key_mask = call.masks.key_mask.contiguous()
    if call.alibi_slopes is not None:
        opts.alibi = call.alibi_slopes.to(torch.float32).contiguous()
    opts.softcap = call.softcap or 0.0
    opts.window_left, opts.window_right = call.masks.window or (-1, -1)
    opts.shift = call.masks.shift
    opts.block_q, opts.block_k = plan.block_q, plan.block_k
    opts.route = 1 if plan.route.pairs == "avx512_bf16" else 0  # how bf16 blocks multiply
    opts.tile_rows, opts.tile_keys, opts.mod_bias = tiling.rows, tiling.keys, tiling.mod_bias
    if plan.dropout is not None:
        opts.dropout_p, opts.dropout_seed = plan.dropout.p, plan.dropout.seed
    return opts


class Tiles(NamedTuple):
    """How the kernel cuts a call: panels of ``rows`` queries, tiles of ``keys`` keys; and the
    functions that give a ``score_mod``'s bias per tile and take its gradient (None without)."""

    rows: int
    keys: int
    mod_bias: Callable | None = None
    mod_bias_grad: Callable | None = None


def tiles(plan: Plan, mod_grads: list[Tensor | None] | None = None) -> Tiles:
    """One tile for a call without a ``score_mod``. With one that
    [adds to the score][attnkit.mods.adds_to_score], tiles of about ``plan.tile_bytes`` of its bias,
    with enough query blocks a panel to keep every thread busy. ``mod_grads`` (the backward): the
    gradients of the tensors the mod reads, accumulated tile by tile."""
    whole = Tiles(
        -(-plan.t // plan.block_q) * plan.block_q, -(-plan.s // plan.block_k) * plan.block_k
    )
    score_mod = plan.call.score_mod
    if score_mod is None:
        return whole
    heads = plan.h_kv * plan.groups
    rows = plan.block_q * -(-2 * torch.get_num_threads() // (plan.b * heads))  # items to share
    rows = min(rows, whole.rows)
    keys = plan.tile_bytes // (4 * plan.b * heads * rows) // plan.block_k * plan.block_k
    keys = min(max(keys, plan.block_k), whole.keys)
    compiled = plan.compile_mods

    def block(r0: int, r1: int, c0: int, c1: int) -> Block:
        return Block.of(range(plan.b), range(heads), range(r0, r1), range(c0, c1))

    def mod_bias(r0: int, r1: int, c0: int, c1: int) -> Tensor:
        return mods.bias(score_mod, block(r0, r1, c0, c1), compiled=compiled)

    tensors = plan.call.mod_tensors
    if mod_grads is None or not tensors:
        return Tiles(rows, keys, mod_bias)
    # The backward (tiled_backward.h) asks for a tile's bias, then hands back its gradient before
    # the next tile: the bias is evaluated once, with its graph, and kept until then (one tile's).
    held: dict[tuple[int, int, int, int], Tensor] = {}

    def mod_bias_with_graph(r0: int, r1: int, c0: int, c1: int) -> Tensor:
        if held:  # more would hold every tile's bias: a walk that breaks the order above
            raise RuntimeError(
                f"tiled: a tile's bias was asked for before {next(iter(held))}'s gradient"
            )
        with torch.enable_grad():
            held[r0, r1, c0, c1] = f = mods.bias(
                score_mod, block(r0, r1, c0, c1), compiled=compiled
            )
        return f.detach()

    def mod_bias_grad(r0: int, r1: int, c0: int, c1: int, dbias: Tensor) -> None:
        at = block(r0, r1, c0, c1)
        f = held.pop((r0, r1, c0, c1), None)  # (None if no bias was asked for: evaluated here)
        grads = mods.bias_grads(score_mod, at, dbias, tensors, compiled=compiled, evaluated=f)
        for i, grad in enumerate(grads):
            if grad is None:
                continue
            if mod_grads[i] is None:  # a copy: autograd may hand one tensor to two inputs
                mod_grads[i] = grad.clone()  # (t1 + t2)[...], or dbias, which the next tile reuses
            else:
                mod_grads[i].add_(grad)

    return Tiles(rows, keys, mod_bias_with_graph, mod_bias_grad)


def forward(
    kernel: ModuleType, operands: tuple[Tensor, Tensor, Tensor], plan: Plan, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` from the pre-scaled q, k and v: the output in ``dtype`` (float32, bf16 or
    float16), laid out as q (`_laid_out_as`), which the kernel writes directly; the lse float32."""
    out = _laid_out_as(operands[0], operands[2].shape[-1], dtype)
    with marked("attnkit::tiled_native_forward"):
        _, lse = kernel.forward(*map(_readable, operands), out, options(kernel, plan))
    return out, lse


def _laid_out_as(q: Tensor, width: int, dtype: torch.dtype) -> Tensor:
    """An empty ``(b, h, t, width)`` tensor, ``(b, t, h, width)`` in memory where q is a view of
    that layout (a module's projections split into heads), so that the heads merge back without a
    copy, as with torch's SDPA; else contiguous. Not a view (autograd would refuse in-place
    changes to an autograd function's output that is one)."""
    b, h, t, _ = q.shape
    if h > 1 and t > 1 and q.stride(1) < q.stride(2):
        strides = (t * h * width, width, h * width, 1)
        return torch.empty_strided((b, h, t, width), strides, dtype=dtype, device=q.device)
    return q.new_empty((b, h, t, width), dtype=dtype)


def backward(
    kernel: ModuleType,
    dout: Tensor,
    operands: tuple[Tensor, Tensor, Tensor],
    lse: Tensor,
    delta: Tensor,
    plan: Plan,
    slopes_grad: bool,
    mod_grads: list[Tensor | None] | None,
    dtypes: tuple[torch.dtype, ...],
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients of q (from the pre-scaled q), of k and of v, in ``dtypes`` and laid out as the
    operands, and of the slopes (if ``slopes_grad``); those of the tensors a ``score_mod`` reads
    are added into ``mod_grads`` (see `tiles`). ``delta`` is ``dO_i . O_i - dlse_i``; rows of
    ``lse`` at -inf (no key) are read as 0. The kernel takes the forward's options extended by
    what only the backward takes (``TiledBackwardOptions``)."""
    tiling = tiles(plan, mod_grads)  # the bias of a tile and its gradient's taker, as a pair
    opts = _filled(kernel.TiledBackwardOptions(), plan, tiling)
    opts.dq, opts.dk, opts.dv = (_laid_out_as(x, x.shape[-1], t) for x, t in zip(operands, dtypes))
    opts.dout = _readable(dout.to(operands[0].dtype))
    opts.lse = lse.to(torch.float32).masked_fill(lse == float("-inf"), 0.0).contiguous()
    opts.delta = delta.to(torch.float32).contiguous()
    opts.q_scale, opts.alibi_grad = plan.call.scale, slopes_grad
    opts.mod_bias_grad = tiling.mod_bias_grad
    with marked("attnkit::tiled_native_backward"):
        dq, dk, dv, dslopes = kernel.backward(*map(_readable, operands), opts)
    return dq, dk, dv, dslopes if slopes_grad else None
