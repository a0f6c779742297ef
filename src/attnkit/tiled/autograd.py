"""The tiled backend's autograd function: one call's forward, its recomputing backward, its
``vmap`` rule, and the weights recomputed from the lse.

The forward and the backward run the C++ kernel (``tiled.cpp``, [`attnkit.tiled.native`][attnkit.tiled.native])
where it takes the call, else the PyTorch loop ([`attnkit.tiled.loop`][attnkit.tiled.loop]); the kernel
is built or loaded here, at the first run that needs it, never while a backend is chosen.

The call is split once into its tensors, which are the function's inputs (so that gradients and
``vmap`` see them), and its [`Plan`][attnkit.tiled.loop.Plan] without them (route, products,
block sizes, a block mask's tables, the dropout's seed), made once. Each pass puts the tensors it
is handed back into the call (`Call.with_tensors`) and binds the plan to them (`Plan.bound`).

Shapes: ``b`` batch, ``h`` query heads, ``h_kv`` key/value heads, ``g = h / h_kv``, ``t`` queries,
``s`` keys, ``d`` head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.call import AttentionOutput, Call, wants_grad
from attnkit.rules.dropout import Dropout
from attnkit.rules.exact import differentiable_grads
from attnkit.rules.nonfinite import all_finite, nan_rows
from attnkit.tiled import loop, native
from attnkit.tiled.loop import Plan
from attnkit.tiled.native import marked
from attnkit.tiled.plans import TiledRoute, route_of

_NEG_INF = float("-inf")


def plan_of(call: Call, route: TiledRoute | None = None) -> Plan:
    """The plan of one call on ``route`` (worked out now if not given), without the call's
    tensors: made once, for the forward, the backward and the weights; a dropout's seed is drawn
    here, once."""
    dropout = Dropout.drawn(call.dropout_p) if call.dropout_p else None
    route = route_of(call) if route is None else route
    return Plan.of(call, route, dropout).without_tensors()


class TiledAttention(torch.autograd.Function):
    """``(out, lse)`` of one call. Saves only q, k, v, the masks, the output and the lse (and the
    tensors a ``score_mod`` reads, in ``TiledAttentionWithMods``).

    Written with ``setup_context`` and a ``vmap`` rule, so that ``torch.func.grad`` and ``vmap``
    run it; forward-mode AD is refused before it gets here (no jvp rule)."""

    @staticmethod
    def forward(q, k, v, alibi_slopes, attn_mask, key_mask, plan: Plan):
        call = plan.call.with_tensors(q, k, v, alibi_slopes, attn_mask, key_mask)
        return forward(call, plan)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, alibi_slopes, attn_mask, key_mask, plan, *mod_tensors = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, alibi_slopes, attn_mask, key_mask, out, lse, *mod_tensors)
        ctx.plan = plan
        ctx.set_materialize_grads(False)  # an unused lse (or output) gets None, not zeros

    @staticmethod
    def backward(ctx, dout: Tensor | None, dlse: Tensor | None):
        q, k, v, slopes, attn_mask, key_mask, out, lse, *mod_tensors = ctx.saved_tensors
        wanted = ctx.needs_input_grad[:4]  # q, k, v, the slopes (a float mask has none here)
        call = ctx.plan.call.with_tensors(q, k, v, slopes, attn_mask, key_mask, tuple(mod_tensors))
        if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable
            wanted = (*wanted, False, *ctx.needs_input_grad[7:])
            grads = differentiable_grads(call, dout, dlse, wanted)
            return *grads[:4], None, None, None, *grads[5:]
        dq, dk, dv, dslopes, mod_grads = backward(
            call, out, lse, dout, dlse, ctx.plan, slopes_grad=wanted[3]
        )
        return dq, dk, dv, dslopes, None, None, None, *mod_grads

    @staticmethod
    def vmap(info, in_dims, q, k, v, alibi_slopes, attn_mask, key_mask, plan):
        """``vmap`` over the call: the mapped dim joins the batch dim (one kernel call), except for
        per-example ALiBi slopes, which are per head: then one call per example."""
        size = info.batch_size
        dims = in_dims[:6]
        args = (q, k, v, alibi_slopes, attn_mask, key_mask)
        if dims[3] is not None:
            results = [
                TiledAttention.apply(
                    *(x if dim is None else x.select(dim, i) for x, dim in zip(args, dims)), plan
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
        out, lse = TiledAttention.apply(q, k, v, alibi_slopes, attn_mask, key_mask, plan)
        return (out.unflatten(0, (size, b)), lse.unflatten(0, (size, b))), (0, 0)


class TiledAttentionWithMods(TiledAttention):
    """The same, for a call whose ``score_mod`` reads tensors that require grad: they follow the
    plan as inputs, so that autograd sends them their gradients. (A separate class: dynamo, which
    traces ``TiledAttention`` under ``torch.compile``, mishandles a forward with ``*args``.)"""

    @staticmethod
    def forward(q, k, v, alibi_slopes, attn_mask, key_mask, plan: Plan, *mod_tensors):
        call = plan.call.with_tensors(q, k, v, alibi_slopes, attn_mask, key_mask, mod_tensors)
        return forward(call, plan)


def forward(call: Call, plan: Plan, *, cast: bool = True) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of ``call`` on its ``plan`` (made by [`plan_of`][attnkit.tiled.autograd.plan_of]);
    ``cast=False`` leaves the output in the statistics' dtype."""
    q, k, v = call.q, call.k, call.v
    plan = plan.bound(call)
    # the C++ kernel (built or loaded now if need be), or None: the loop, also where a build failed
    kernel = None if plan.route.kernel is None else plan.route.kernel.load()
    dtype = q.dtype if cast else plan.stats_dtype
    if kernel is not None:
        operands = _native_operands(q, k, v, plan)
        out, lse = native.forward(kernel, operands, plan, dtype)
    else:
        with marked("attnkit::tiled_loop_forward"):
            q5, k5 = nan_rows(_prescaled(q, plan)), nan_rows(_operand(k, plan))
            out, lse = loop.forward(q5, k5, _operand(v, plan), plan)
        out = out.view((*q.shape[:-1], v.shape[-1])).to(dtype)
    return out, lse.view(q.shape[:-1])


def backward(
    call: Call,
    out: Tensor,
    lse: Tensor,
    dout: Tensor | None,
    dlse: Tensor | None,
    plan: Plan,
    *,
    slopes_grad: bool,
    cast: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, list[Tensor | None]]:
    """The gradients of q, k, v, the slopes (if ``slopes_grad``) and ``call.mod_tensors``, from
    the output and lse of the rows: this call's own, or those of attention over more keys than
    ``call.k`` holds (ring attention, whose every block of keys recomputes its weights from the
    rows' whole lse). ``dout``/``dlse`` None: no gradient reached that output. ``cast=False``
    leaves the gradients of q, k and v in the statistics' dtype, for a caller that sums them."""
    q, k, v = call.q, call.k, call.v
    plan = plan.bound(call)
    if dout is None:
        dout = torch.zeros_like(out)
    delta = (dout.to(plan.stats_dtype) * out.to(plan.stats_dtype)).sum(dim=-1)  # dO_i . O_i
    if dlse is not None:  # d lse_i / d S_ij = P_ij: the lse's gradient joins D
        delta = delta - dlse.to(plan.stats_dtype)
    b, h, t, d = q.shape
    mod_grads: list[Tensor | None] = [None] * len(call.mod_tensors)
    # the C++ kernel (built or loaded now if need be), or None: the loop, also where a build failed
    kernel = None if plan.route.kernel is None else plan.route.kernel.load()
    dtypes = (q.dtype, k.dtype, v.dtype) if cast else (plan.stats_dtype,) * 3
    if kernel is not None:  # the gradients in their dtypes, that of q times the scale
        operands = _native_operands(q, k, v, plan)
        dq, dk, dv, dslopes = native.backward(
            kernel, dout, operands, lse, delta, plan, slopes_grad, mod_grads, dtypes
        )
    else:
        grouped = (plan.b, plan.h_kv, plan.groups, t)
        with marked("attnkit::tiled_loop_backward"):
            dq, dk, dv, dslopes = loop.backward(
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
        dq = dq.mul_(call.scale).view(b, h, t, d)  # the scores used q * scale
        dq, dk, dv = (x.to(dtype) for x, dtype in zip((dq, dk, dv), dtypes))
    slopes = call.alibi_slopes
    dslopes = None if dslopes is None else dslopes.to(slopes.dtype)
    return dq, dk, dv, dslopes, mod_grads


def partial(call: Call) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` without autograd, the output in the statistics' dtype (float32; float64 for
    float64): part of a row that goes on to be merged with other parts (ring attention, whose
    pieces of keys and values travel with their padding zeroed), and is rounded to the inputs'
    dtype once, at the end."""
    return forward(call, plan_of(call), cast=False)


def run(call: Call, route: TiledRoute | None = None) -> AttentionOutput:
    """``call`` through the autograd function, on ``route`` (the backend's, chosen with it); the
    weights are recomputed from the lse after the pass (the output is the same bit for bit).
    Under autocast, the inputs come in autocast's dtype (``checked_call`` casts them) and every
    operation runs in it."""
    q, k, v = call.q, call.k, call.v
    with torch.autocast(q.device.type, enabled=False):
        masks = call.masks
        plan = plan_of(call, route)
        function = TiledAttentionWithMods if call.mod_tensors else TiledAttention
        out, lse = function.apply(
            q, k, v, call.alibi_slopes, masks.attn_mask, masks.key_mask, plan, *call.mod_tensors
        )
        weights = None
        if call.return_weights:
            weights = _weights(call, lse, plan.bound(call)).to(q.dtype)
    return AttentionOutput(out, lse if call.return_lse else None, weights)


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


def _native_operands(q: Tensor, k: Tensor, v: Tensor, plan: Plan) -> tuple[Tensor, Tensor, Tensor]:
    """q pre-scaled, k and v, in the matmul dtype (float32 or bf16), as they lie: the C++ kernel
    reads them in place where it can."""
    dtype = plan.matmul_dtype
    return _prescaled(q, plan).view(q.shape), k.to(dtype), v.to(dtype)


def _operand(x: Tensor, plan: Plan) -> Tensor:
    """k or v in the matmul dtype, contiguous so that each key block is a view, not a copy."""
    return x.to(plan.matmul_dtype).contiguous()


def _prescaled(q: Tensor, plan: Plan) -> Tensor:
    """``q * scale`` as ``(b, h_kv, g, t, d)`` in the matmul dtype (scaling q, not the scores),
    each product in the statistics' dtype, rounded once; in one pass where q has the matmul dtype
    (torch multiplies a half-precision tensor by a number in float32)."""
    q5 = q.view(plan.b, plan.h_kv, plan.groups, plan.t, q.shape[-1])
    if q.dtype == plan.matmul_dtype:
        return q5 * plan.call.scale
    return (q5.to(plan.stats_dtype) * plan.call.scale).to(plan.matmul_dtype)


def _weights(call: Call, lse: Tensor, plan: Plan) -> Tensor:
    """The softmax weights ``(b, h, t, s)`` from the lse: block by block without gradients; where
    q, k, the slopes or the lse need one, as one block of ordinary differentiable operations (the
    weights are ``t x s`` anyway), whose gradient reaches the lse's and through it the kernel's."""
    q, k = call.q, call.k
    b, h, t, _ = q.shape
    differentiable = wants_grad(q, k, lse, call.alibi_slopes, *call.mod_tensors)
    q5, k = nan_rows(_prescaled(q, plan)), nan_rows(_operand(k, plan))
    lse = lse.view(plan.b, plan.h_kv, plan.groups, t)
    lse = lse.masked_fill(lse == _NEG_INF, 0.0)
    # exp(-inf - lse) is 0 where the lse is finite; a row that a NaN made NaN needs the mask
    careful = not all_finite(lse)
    dropped = plan.dropout is not None and call.return_weights == "dropped"
    if differentiable:
        scores, _, _ = plan.scores(
            plan.grouped_rows(q5, 0, t), k, 0, t, 0, plan.s, True, whole=True
        )
        probs = (scores - lse[..., None]).exp_()
        if careful:
            probs = probs.masked_fill(scores == _NEG_INF, 0.0)
        if dropped:
            probs = probs * plan.keep_scale(0, t, 0, plan.s, q.device)
        return probs.view(b, h, t, plan.s)
    weights = q.new_zeros(b, plan.h_kv, plan.groups, t, plan.s)
    with torch.no_grad():
        for i0, i1 in plan.query_blocks():
            q_blk = plan.grouped_rows(q5, i0, i1)
            for j0, j1, window in plan.key_blocks(i0, i1):
                scores, _, _ = plan.scores(q_blk, k[:, :, j0:j1], i0, i1, j0, j1, window)
                masked = scores == _NEG_INF if careful else None
                probs = loop.exp_(scores.sub_(lse[:, :, :, i0:i1, None]))
                if masked is not None:  # 0 even in a row that a NaN score makes NaN
                    probs.masked_fill_(masked, 0.0)
                if dropped:
                    probs.mul_(plan.keep_scale(i0, i1, j0, j1, q.device))
                weights[:, :, :, i0:i1, j0:j1] = probs
    return weights.view(b, h, t, plan.s)
