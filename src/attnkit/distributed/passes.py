"""Ring attention's passes: the forward and backward that send the pieces of keys and values
around the ring, merge each pair's partial results, and bring the keys' gradients home; and the
autograd function around them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attnkit import masks
from attnkit.distributed.layout import Piece
from attnkit.tiled import autograd

if TYPE_CHECKING:
    from attnkit.distributed.plan import RingPlan

_NEG_INF = float("-inf")


def _merge(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """Join a block's ``(out_b, lse_b)`` into the rows' running ``(out, lse)``, in place (``out_b``
    is spent). A row that has seen no allowed key on either side stays 0 and -inf (the usual
    sigmoid form of this merge gives NaN there); a NaN lse spreads."""
    both = torch.logaddexp(lse, lse_b)
    base = both.masked_fill(both == _NEG_INF, 0.0)
    out.mul_(torch.exp(lse - base)[..., None]).add_(out_b.mul_(torch.exp(lse_b - base)[..., None]))
    lse.copy_(both)


def forward_pass(q, k, v, slopes, key_mask, plan: RingPlan) -> tuple[Tensor, Tensor]:
    with torch.autocast(q.device.type, enabled=False):  # in the inputs' dtype, as in one process
        return _ring_forward(q, k, v, slopes, key_mask, plan)


def _ring_forward(q, k, v, slopes, key_mask, plan: RingPlan) -> tuple[Tensor, Tensor]:
    ring = plan.ring
    stats = torch.promote_types(q.dtype, torch.float32)
    b, h, t, _ = q.shape
    out = q.new_zeros(b, h, t, v.shape[-1], dtype=stats)
    lse = q.new_full((b, h, t), _NEG_INF, dtype=stats)

    def attend(held: list[Tensor], src: int, j: int) -> None:
        """Merge this rank's queries' attention to piece ``j`` of rank ``src``'s keys into the
        rows' running output and lse."""
        k_src, v_src, mask_src = _received(held)
        for qc, kc in plan.pairs(src, j):
            qi, ki, vi = q[:, :, qc.rows], k_src[:, :, kc.rows], v_src[:, :, kc.rows]
            mi = None if mask_src is None else mask_src[:, kc.rows]
            pair = plan.pair(qi, ki, vi, mi, slopes, (), qc, kc)
            out_b, lse_b = autograd.partial(pair)  # in `stats`: rounded at the end
            _merge(out[:, :, qc.rows], lse[:, :, qc.rows], out_b, lse_b)

    held: list[Tensor] = []
    for j, step, src in plan.schedule():
        if step == 0:
            held = _travelling(k, v, key_mask, plan.k_pieces[ring.rank][j])
        goes_on = step < ring.size - 1  # to the next rank, which computes with it next step
        incoming = [torch.empty_like(x) for x in held] if goes_on else []
        arrived = ring.exchange(held if goes_on else [], incoming, "keys and values")
        attend(held, src, j)
        arrived()
        held = incoming
    return out.to(q.dtype), lse


def backward_pass(q, k, v, slopes, key_mask, out, lse, dout, dlse, mod_tensors, plan: RingPlan):
    """The gradients of this rank's q, k, v (and of the slopes and the mod's tensors: this rank's
    part). The pieces of keys and values go around as in the forward. Each step computes the
    gradients of the piece it holds from this rank's queries while the sum of the ranks before it
    for that piece arrives; the sum then goes on, and after a round reaches the piece's own rank
    (during the next round's first step, or after the last round)."""
    ring = plan.ring
    stats = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros_like(q, dtype=stats)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)  # each row placed once, when its sum is home
    slopes_grad = slopes is not None and slopes.requires_grad
    dslopes = torch.zeros_like(slopes) if slopes_grad else None
    mod_grads: list[Tensor | None] = [None] * len(mod_tensors)

    def gradients(held: list[Tensor], src: int, j: int) -> list[Tensor]:
        """dK and dV of piece ``j`` of rank ``src``'s keys from this rank's queries, in `stats`;
        adds this rank's queries' part into dq, dslopes and mod_grads."""
        nonlocal dslopes, mod_grads
        k_src, v_src, mask_src = _received(held)
        dk_piece = k_src.new_zeros(k_src.shape, dtype=stats)
        dv_piece = v_src.new_zeros(v_src.shape, dtype=stats)
        for qc, kc in plan.pairs(src, j):
            qi, ki, vi = q[:, :, qc.rows], k_src[:, :, kc.rows], v_src[:, :, kc.rows]
            mi = None if mask_src is None else mask_src[:, kc.rows]
            pair = plan.pair(qi, ki, vi, mi, slopes, mod_tensors, qc, kc)
            rows = (slice(None), slice(None), qc.rows)
            gq, gk, gv, gs, gm = autograd.backward(
                pair,
                out[rows],
                lse[rows],
                None if dout is None else dout[rows],
                None if dlse is None else dlse[rows],
                autograd.plan_of(pair),
                slopes_grad=slopes_grad,
                cast=False,
            )
            dq[rows] += gq
            dk_piece[:, :, kc.rows] += gk
            dv_piece[:, :, kc.rows] += gv
            if gs is not None:
                dslopes += gs
            mod_grads = [
                a if b is None else b if a is None else a + b for a, b in zip(mod_grads, gm)
            ]
        return [dk_piece, dv_piece]

    def home(j: int, sums: list[Tensor]) -> None:
        """The sums over every rank of this rank's piece ``j``: its keys' and values' gradients."""
        piece = plan.k_pieces[ring.rank][j]
        piece.place(sums[0], dk, 2)
        piece.place(sums[1], dv, 2)

    held: list[Tensor] = []
    sums: list[Tensor] = []  # of the piece computed last step, for the next rank
    for j, step, src in plan.schedule():
        if step == 0:
            held = _travelling(k, v, key_mask, plan.k_pieces[ring.rank][j])
        goes_on = step < ring.size - 1
        incoming = [torch.empty_like(x) for x in held] if goes_on else []
        before = [torch.empty_like(x) for x in sums]  # step 0: this rank's piece j - 1, home
        arrived = ring.exchange(
            (held if goes_on else []) + sums, incoming + before, "keys, values and gradients"
        )
        grads = gradients(held, src, j)
        arrived()
        if step > 0:  # the sums of the ranks before this one for the piece held
            grads = [g.add_(x) for g, x in zip(grads, before)]
        elif before:
            home(j - 1, before)
        sums, held = grads, incoming
    back = [torch.empty_like(x) for x in sums]  # the last piece's sums go home
    ring.exchange(sums, back, "gradients of keys and values")()
    home(len(plan.k_pieces[ring.rank]) - 1, back)
    return dq.to(q.dtype), dk, dv, dslopes, mod_grads


def _travelling(k: Tensor, v: Tensor, key_mask: Tensor | None, piece: Piece) -> list[Tensor]:
    """What goes around the ring of this rank's ``piece``: its keys and values, contiguous, their
    padding zeroed (it may hold anything, and 0 times a NaN there would reach the gradients), and
    its key mask as bytes."""
    mask = None if key_mask is None else piece.cut(key_mask, 1)
    held = [masks.zero_padding(piece.cut(x, 2), mask) for x in (k, v)]
    if mask is not None:
        held.append(mask.to(torch.uint8))
    return held


def _received(held: list[Tensor]) -> tuple[Tensor, Tensor, Tensor | None]:
    key_mask = held[2].bool() if len(held) > 2 else None
    return held[0], held[1], key_mask


class RingAttention(torch.autograd.Function):
    """``(out, lse)`` of this rank's queries over every rank's keys; saves only this rank's
    shards, its output and its lse."""

    @staticmethod
    def forward(ctx, q, k, v, slopes, key_mask, plan: RingPlan):
        out, lse = forward_pass(q, k, v, slopes, key_mask, plan)
        ctx.save_for_backward(q, k, v, slopes, key_mask, out, lse)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "ring attention has no second derivative: its backward cannot run with "
                "create_graph=True"
            )
        q, k, v, slopes, key_mask, out, lse, *mod_tensors = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv, dslopes, mod_grads = backward_pass(
                q, k, v, slopes, key_mask, out, lse, dout, dlse, tuple(mod_tensors), ctx.plan
            )
        return dq, dk, dv, dslopes, None, None, *mod_grads


class RingAttentionWithMods(RingAttention):
    """The same, for a ``score_mod`` that reads tensors requiring grad: they follow as inputs."""

    @staticmethod
    def forward(ctx, q, k, v, slopes, key_mask, plan: RingPlan, *mod_tensors):
        out, lse = forward_pass(q, k, v, slopes, key_mask, plan)
        ctx.save_for_backward(q, k, v, slopes, key_mask, out, lse, *mod_tensors)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return out, lse
