"""The tiled backend: FlashAttention-2's online softmax, block by block.

Two implementations of one algorithm: the PyTorch loop of [`attnkit.backends.tiled_loop`][attnkit.backends.tiled_loop], the
readable shape of it, and ``tiled.cpp`` ([`attnkit.backends.tiled_native`][attnkit.backends.tiled_native]), which runs where the
block products are float32 on a CPU: there a dozen tensor operations per block, each a pass over
the block in memory, become a few passes over a row that is in cache. Both are tested against the
float64 oracle, option by option. This module chooses between them (`_native_kernel`) and
holds what they share: the autograd function, its ``vmap`` rule and the weights.

The forward walks over blocks of ``block_q`` queries; for each it streams blocks of ``block_k`` keys,
keeping a running max ``m``, a running sum ``l`` and an unnormalised output ``acc``, and stores only
the output and the log-sum-exp ``lse = m + log(l)``. The backward recomputes each block's
probabilities from ``lse`` (Dao, 2023, Algorithm 2), so no ``(t, s)`` tensor is ever kept: the
peak extra memory is ``O((t + s) * d + block_q * block_k)`` per head.

Blocks that the causal mask or a window empties are never computed: each query block visits only the
key range its positions can see, and blocks lying wholly inside the window skip the positional mask.

Grouped-query attention costs nothing extra: the ``g = h / h_kv`` query heads that share a key/value
head are stacked into one ``(g * block_q)``-row block, so each key block is multiplied once.

Gradients reach every input and every output: the lse (its gradient enters the backward as
``D_i - dlse_i``), the weights (recomputed from the lse, differentiably when they need a gradient)
and learnable ALiBi slopes. A backward run with ``create_graph=True`` (a gradient penalty) instead
differentiates the reference backend's materialised recomputation, so second derivatives are exact,
at the reference's ``O(t * s)`` memory for that call.

Precision: softmax statistics and accumulators are float32 (float64 for float64 inputs). The matrix
products run in the input dtype where the hardware has fast half-precision products (CUDA; on a CPU,
bf16 with AVX512-BF16 or AMX and fp16 with AMX-FP16, as `attnkit._cpu` reports); elsewhere
half-precision blocks are multiplied in float32, which is both faster and more accurate there (bf16
GEMM without hardware support is ~400x slower than fp32 on AVX2). Where its build has AVX512-BF16,
the C++ kernel multiplies bf16 blocks itself with float32 sums, so scores are never rounded to bf16;
other half-precision products run in the loop.

Shapes: ``b`` batch, ``h`` query heads, ``h_kv`` key/value heads, ``g = h / h_kv``, ``t`` queries,
``s`` keys, ``d`` head dim, ``bq``/``bk`` block sizes.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from attnkit import _cpu, mods
from attnkit.backends import tiled_loop, tiled_native
from attnkit.backends.base import (
    AttentionOutput,
    Request,
    forward_ad_active,
    gradient_levels,
    wants_grad,
)
from attnkit.backends.nonfinite import nan_rows
from attnkit.backends.reference import differentiable_grads
from attnkit.backends.tiled_loop import Plan
from attnkit.backends.tiled_native import marked
from attnkit.masks import Masks, zero_padding
from attnkit.mods import ScoreMod

BLOCK_Q = 256  # query rows per block
BLOCK_K = 512  # keys per block: a (12 heads, 256, 512) fp32 score block is 6 MB, cache-resident

_NEG_INF = float("-inf")
_NAN = float("nan")


def _fast_half_matmul(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``dtype`` matrix products are fast on ``device`` (else blocks go through float32):
    on a CPU, from `attnkit._cpu.fast_half_products`."""
    return device.type != "cpu" or _cpu.fast_half_products(dtype)


def _matmul_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the block products for inputs of ``dtype``."""
    return dtype if _fast_half_matmul(dtype, device) else torch.promote_types(dtype, torch.float32)


class _Spec(NamedTuple):
    """The part of a call that is not a tensor. The tensors (masks, slopes) are arguments of the
    autograd function in their own right, so that gradients and ``vmap`` see them."""

    window: tuple[int, int] | None
    scale: float
    softcap: float | None
    block_q: int
    block_k: int
    score_mod: ScoreMod | None = None
    block_mask: BlockMask | None = None
    shift: int = 0  # Masks.shift


def spec_of(request: Request) -> _Spec:
    """What the autograd function keeps of ``request`` besides its tensors."""
    masks = request.masks
    return _Spec(
        masks.window,
        request.scale,
        request.softcap,
        BLOCK_Q,
        BLOCK_K,
        request.score_mod,
        request.block_mask,
        masks.shift,
    )


def _plan(q: Tensor, k: Tensor, request: Request, spec: _Spec) -> Plan:
    return Plan.of(q, k, request, _matmul_dtype(q.dtype, q.device), spec.block_q, spec.block_k)


def _request(
    spec: _Spec,
    slopes: Tensor | None,
    attn_mask: Tensor | None,
    key_mask: Tensor | None,
    mod_tensors: tuple[Tensor, ...] = (),
) -> Request:
    return Request(
        masks=Masks(spec.window, key_mask, attn_mask, spec.shift),
        scale=spec.scale,
        softcap=spec.softcap,
        alibi_slopes=slopes,
        score_mod=spec.score_mod,
        block_mask=spec.block_mask,
        mod_tensors=mod_tensors,
    )


class _TiledAttention(torch.autograd.Function):
    """``(out, lse)`` of one call. Saves only q, k, v, the masks, the output and the lse (and the
    tensors a ``score_mod`` reads, in ``_TiledAttentionWithMods``).

    Written with ``setup_context`` and a ``vmap`` rule, so that ``torch.func.grad`` and ``vmap``
    run it; forward-mode AD is refused before it gets here (no jvp rule)."""

    @staticmethod
    def forward(q, k, v, alibi_slopes, attn_mask, key_mask, spec: _Spec):
        return _forward(q, k, v, alibi_slopes, attn_mask, key_mask, spec, ())

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, alibi_slopes, attn_mask, key_mask, spec, *mod_tensors = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, alibi_slopes, attn_mask, key_mask, out, lse, *mod_tensors)
        ctx.spec = spec
        ctx.set_materialize_grads(False)  # an unused lse (or output) gets None, not zeros

    @staticmethod
    def backward(ctx, dout: Tensor | None, dlse: Tensor | None):
        q, k, v, slopes, attn_mask, key_mask, out, lse, *mod_tensors = ctx.saved_tensors
        wanted = ctx.needs_input_grad[:4]  # q, k, v, the slopes (a float mask has none here)
        request = _request(ctx.spec, slopes, attn_mask, key_mask, tuple(mod_tensors))
        if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable
            wanted = (*wanted, False, *ctx.needs_input_grad[7:])
            grads = differentiable_grads(q, k, v, request, dout, dlse, wanted)
            return *grads[:4], None, None, None, *grads[5:]
        dq, dk, dv, dslopes, mod_grads = backward(
            q, k, v, out, lse, dout, dlse, request, ctx.spec, slopes_grad=wanted[3]
        )
        return dq, dk, dv, dslopes, None, None, None, *mod_grads

    @staticmethod
    def vmap(info, in_dims, q, k, v, alibi_slopes, attn_mask, key_mask, spec):
        """``vmap`` over the call: the mapped dim joins the batch dim (one kernel call), except for
        per-example ALiBi slopes, which are per head: then one call per example."""
        size = info.batch_size
        dims = in_dims[:6]
        args = (q, k, v, alibi_slopes, attn_mask, key_mask)
        if dims[3] is not None:
            results = [
                _TiledAttention.apply(
                    *(x if dim is None else x.select(dim, i) for x, dim in zip(args, dims)), spec
                )
                for i in range(size)
            ]
            return tuple(torch.stack(r) for r in zip(*results)), (0, 0)
        q, k, v = (_fold_batch(x, dim, size) for x, dim in zip((q, k, v), dims))
        b = q.shape[0] // size
        if key_mask is not None:
            key_mask = _fold_batch(key_mask, dims[5], size)
        if attn_mask is not None:
            attn_mask = _fold_mask(attn_mask, dims[4], size, b)
        out, lse = _TiledAttention.apply(q, k, v, alibi_slopes, attn_mask, key_mask, spec)
        return (out.unflatten(0, (size, b)), lse.unflatten(0, (size, b))), (0, 0)


class _TiledAttentionWithMods(_TiledAttention):
    """The same, for a call whose ``score_mod`` reads tensors that require grad: they follow the
    spec as inputs, so that autograd sends them their gradients. (A separate class: dynamo, which
    traces ``_TiledAttention`` under ``torch.compile``, mishandles a forward with ``*args``.)"""

    @staticmethod
    def forward(q, k, v, alibi_slopes, attn_mask, key_mask, spec: _Spec, *mod_tensors):
        return _forward(q, k, v, alibi_slopes, attn_mask, key_mask, spec, mod_tensors)


def backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor | None,
    dlse: Tensor | None,
    request: Request,
    spec: _Spec,
    *,
    slopes_grad: bool,
    cast: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, list[Tensor | None]]:
    """The gradients of q, k, v, the slopes (if ``slopes_grad``) and ``request.mod_tensors``, from
    the output and lse of the rows: this call's own, or those of attention over more keys than
    ``k`` holds (ring attention, whose every block of keys recomputes its weights from the rows'
    whole lse). ``dout``/``dlse`` None: no gradient reached that output. ``cast=False`` leaves
    the gradients of q, k and v in the statistics' dtype, for a caller that sums them."""
    plan = _plan(q, k, request, spec)
    if dout is None:
        dout = torch.zeros_like(out)
    delta = (dout.to(plan.stats_dtype) * out.to(plan.stats_dtype)).sum(dim=-1)  # dO_i . O_i
    if dlse is not None:  # d lse_i / d S_ij = P_ij: the lse's gradient joins D
        delta = delta - dlse.to(plan.stats_dtype)
    b, h, t, d = q.shape
    mod_grads: list[Tensor | None] = [None] * len(request.mod_tensors)
    kernel = _kernel(q.device, plan.matmul_dtype, request)
    if kernel is not None:
        operands = _native_operands(q, k, v, plan)
        dq, dk, dv, dslopes = tiled_native.backward(
            kernel, dout, operands, lse, delta, plan, slopes_grad, mod_grads
        )
    else:
        grouped = (plan.b, plan.h_kv, plan.groups, t)
        with marked("attnkit::tiled_loop_backward"):
            dq, dk, dv, dslopes = tiled_loop.backward(
                dout.reshape(*grouped, -1),
                nan_rows(_prescaled(q, plan)),
                nan_rows(_operand(k, plan)),
                _operand(v, plan),
                lse.view(grouped),
                delta.view(grouped),
                plan,
                slopes_grad=slopes_grad,
                mod_grads=mod_grads,
            )
    dq = dq.mul_(plan.request.scale).view(b, h, t, d)  # the scores used q * scale
    slopes = request.alibi_slopes
    dslopes = None if dslopes is None else dslopes.to(slopes.dtype)
    if cast:
        dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    return dq, dk, dv, dslopes, mod_grads


def _forward(q, k, v, alibi_slopes, attn_mask, key_mask, spec: _Spec, mod_tensors, *, cast=True):
    """The forward of both autograd functions: ``(out, lse)``; ``cast=False`` leaves the output
    in the statistics' dtype."""
    plan = _plan(q, k, _request(spec, alibi_slopes, attn_mask, key_mask, mod_tensors), spec)
    kernel = _kernel(q.device, plan.matmul_dtype, plan.request)
    if kernel is not None:
        out, lse = tiled_native.forward(kernel, _native_operands(q, k, v, plan), plan)
    else:
        with marked("attnkit::tiled_loop_forward"):
            q5, k5 = nan_rows(_prescaled(q, plan)), nan_rows(_operand(k, plan))
            out, lse = tiled_loop.forward(q5, k5, _operand(v, plan), plan)
    out = out.view((*q.shape[:-1], v.shape[-1]))
    return out.to(q.dtype) if cast else out, lse.view(q.shape[:-1])


def partial(q: Tensor, k: Tensor, v: Tensor, request: Request) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` without autograd, the output in the statistics' dtype (float32; float64 for
    float64): part of a row that goes on to be merged with other parts (ring attention), and is
    rounded to the inputs' dtype once, at the end."""
    masks = request.masks
    k, v = zero_padding(k, masks.key_mask), zero_padding(v, masks.key_mask)
    slopes, mods_ = request.alibi_slopes, request.mod_tensors
    spec = spec_of(request)
    return _forward(q, k, v, slopes, masks.attn_mask, masks.key_mask, spec, mods_, cast=False)


def _fold_batch(x: Tensor, dim: int | None, size: int) -> Tensor:
    """``x`` ``(b, ...)`` with a vmapped dim at ``dim`` (None: shared) -> ``(size * b, ...)``."""
    x = x.expand(size, *x.shape) if dim is None else x.movedim(dim, 0)
    return x.flatten(0, 1)


def _fold_mask(mask: Tensor, dim: int | None, size: int, b: int) -> Tensor:
    """An attn_mask broadcastable to ``(b, h, t, s)``, vmapped at ``dim`` -> broadcastable to
    ``(size * b, h, t, s)``."""
    if dim is None:
        if mask.dim() < 4 or mask.shape[0] == 1:  # the same for every batch row: broadcasts as is
            return mask
        return _fold_batch(mask, None, size)
    mask = mask.movedim(dim, 0)
    mask = mask.view(size, *[1] * (5 - mask.dim()), *mask.shape[1:])  # (size, b or 1, h, t, s)
    return mask.expand(size, b, *mask.shape[2:]).flatten(0, 1)


def _native_kernel(device: torch.device, matmul_dtype: torch.dtype) -> ModuleType | None:
    """The C++ kernel if it can run a call with these block products, else None (the loop runs):
    the one switch between the two paths (the tests turn it to force the loop)."""
    return tiled_native.kernel_for(device, matmul_dtype)


def _kernel(device: torch.device, matmul_dtype: torch.dtype, request: Request):
    """The C++ kernel if it can run this call, else None. A ``score_mod`` and a ``block_mask`` are
    Python functions, which the kernel cannot call per score: a mod that adds to the score
    ([`adds_to_score`][attnkit.mods.adds_to_score]) runs in the kernel, which asks for its bias a
    tile at a time; other mods and block masks run in the loop."""
    if request.block_mask is not None:
        return None
    kernel = _native_kernel(device, matmul_dtype)
    if kernel is None or request.score_mod is None or mods.adds_to_score(request.score_mod):
        return kernel
    return None


def _call_dtype(q: Tensor) -> torch.dtype:
    """The dtype the kernel sees: q's, or the autocast dtype."""
    if torch.is_autocast_enabled(q.device.type):
        return torch.get_autocast_dtype(q.device.type)
    return q.dtype


def runs_native(q: Tensor, request: Request) -> bool:
    """Whether a tiled call on ``q`` runs the C++ kernel (building it, the first time)."""
    return _kernel(q.device, _matmul_dtype(_call_dtype(q), q.device), request) is not None


def products(q: Tensor, request: Request) -> str:
    """The block products of a tiled call on ``q``: in the C++ kernel ``"float32"``,
    ``"bf16-avx512_bf16"`` or ``"bf16-portable"`` ([`attnkit.backends.tiled_native.products`][attnkit.backends.tiled_native.products]);
    in the loop, the dtype torch multiplies in (``"float32"``, ``"float64"``, ``"bfloat16"``, ...)."""
    matmul_dtype = _matmul_dtype(_call_dtype(q), q.device)
    kernel = _kernel(q.device, matmul_dtype, request)
    if kernel is not None:
        return tiled_native.products(kernel, matmul_dtype)
    return str(matmul_dtype).removeprefix("torch.")


def refuses(request: Request, q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """Why the tiled backend cannot run this call (None if it can)."""
    if torch.jit.is_tracing():
        return (
            "under torch.jit.trace (its block loop would be frozen into the trace at these lengths)"
        )
    if forward_ad_active():
        return (
            "forward-mode AD (torch.func.jvp, jacfwd, forward_ad): the tiled kernel has no jvp rule"
        )
    if (request.score_mod or request.block_mask) is not None and (
        torch._C._are_functorch_transforms_active()
    ):
        return (
            "score_mod or block_mask under a torch.func transform (the reference backend runs it)"
        )
    if gradient_levels(q, k, v, request.alibi_slopes):
        return (
            "under torch.func.grad, vjp or jacrev: its recomputing backward does not compose with "
            "them (the reference backend does, and auto takes it or SDPA)"
        )
    return None


def _native_operands(q: Tensor, k: Tensor, v: Tensor, plan: Plan) -> tuple[Tensor, Tensor, Tensor]:
    """q pre-scaled, k and v, as the C++ kernel takes them: contiguous ``(b, heads, n, d)`` in the
    matmul dtype (float32 or bf16)."""
    return _prescaled(q, plan).view(q.shape).contiguous(), _operand(k, plan), _operand(v, plan)


def _operand(x: Tensor, plan: Plan) -> Tensor:
    """k or v in the matmul dtype, contiguous so that each key block is a view, not a copy."""
    return x.to(plan.matmul_dtype).contiguous()


def _prescaled(q: Tensor, plan: Plan) -> Tensor:
    """``q * scale`` as ``(b, h_kv, g, t, d)`` in the matmul dtype (scaling q, not the scores)."""
    q5 = q.view(plan.b, plan.h_kv, plan.groups, plan.t, q.shape[-1])
    return (q5.to(plan.stats_dtype) * plan.request.scale).to(plan.matmul_dtype)


def _weights(q: Tensor, k: Tensor, lse: Tensor, plan: Plan) -> Tensor:
    """The softmax weights ``(b, h, t, s)`` from the lse: block by block without gradients; where
    q, k, the slopes or the lse need one, as one block of ordinary differentiable operations (the
    weights are ``t x s`` anyway), whose gradient reaches the lse's and through it the kernel's."""
    b, h, t, _ = q.shape
    differentiable = wants_grad(q, k, lse, plan.request.alibi_slopes, *plan.request.mod_tensors)
    q5, k = nan_rows(_prescaled(q, plan)), nan_rows(_operand(k, plan))
    lse = lse.view(plan.b, plan.h_kv, plan.groups, t)
    lse = lse.masked_fill(lse == _NEG_INF, 0.0)
    if differentiable:
        scores, _, _ = plan.scores(
            plan.grouped_rows(q5, 0, t), k, 0, t, 0, plan.s, True, whole=True
        )
        probs = (scores - lse[..., None]).exp().masked_fill(scores == _NEG_INF, 0.0)
        return probs.view(b, h, t, plan.s)
    weights = q.new_zeros(b, plan.h_kv, plan.groups, t, plan.s)
    with torch.no_grad():
        for i0, i1 in plan.query_blocks():
            q_blk = plan.grouped_rows(q5, i0, i1)
            for j0, j1, window in plan.key_blocks(i0, i1):
                scores, _, _ = plan.scores(q_blk, k[:, :, j0:j1], i0, i1, j0, j1, window)
                masked = scores == _NEG_INF  # 0 even in a row that a NaN score makes NaN
                probs = tiled_loop.exp_(scores.sub_(lse[:, :, :, i0:i1, None]))
                probs.masked_fill_(masked, 0.0)
                weights[:, :, :, i0:i1, j0:j1] = probs
    return weights.view(b, h, t, plan.s)


def tiled(q: Tensor, k: Tensor, v: Tensor, request: Request) -> AttentionOutput:
    """Shapes ``q (b, h, t, d)``, ``k (b, h_kv, s, d)``, ``v (b, h_kv, s, d_v)``.

    The weights are recomputed from the lse after the pass (the output is the same bit for bit).
    Under autocast, the inputs are cast to the autocast dtype and the kernel runs on them as such.
    """
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        q, k, v = (x.to(dtype) for x in (q, k, v))
    with torch.autocast(device, enabled=False):
        masks = request.masks
        k, v = zero_padding(k, masks.key_mask), zero_padding(v, masks.key_mask)
        spec = spec_of(request)
        function = _TiledAttentionWithMods if request.mod_tensors else _TiledAttention
        out, lse = function.apply(
            q,
            k,
            v,
            request.alibi_slopes,
            masks.attn_mask,
            masks.key_mask,
            spec,
            *request.mod_tensors,
        )
        weights = None
        if request.return_weights:
            plan = _plan(q, k, request, spec)
            weights = _weights(q, k, lse, plan).to(q.dtype)
    return AttentionOutput(out, lse if request.return_lse else None, weights)
