"""The tiled backend's PyTorch loop: FlashAttention-2's online softmax, block by block, forward and
recomputing backward, in ordinary tensor operations. It is the readable shape of the algorithm and
the path for float64, half-precision block products, ``torch.compile`` (which traces it into one
graph), ``torch.func`` transforms, block masks and ``score_mod`` functions other than those that
add to the score; ``tiled.cpp`` runs the same algorithm where the products are float32 on a CPU. [`attnkit.backends.tiled`][attnkit.backends.tiled] chooses between them and holds the autograd function.

Shapes: ``b`` batch, ``h_kv`` key/value heads, ``g`` query heads per key/value head, ``t``
queries, ``s`` keys, ``d`` head dim, ``bq``/``bk`` block sizes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from attnkit import mods
from attnkit.block_mask import allowed as dense_allowed
from attnkit.call import Call
from attnkit.rules.dropout import Dropout, keep_scale
from attnkit.rules.nonfinite import NAN, may_hold_nonfinite
from attnkit.tiled.plans import BlockPlan, TiledRoute

_NEG_INF = float("-inf")


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the scores, softmax statistics and accumulators: float32, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _by_group(m: Tensor, h_kv: int, groups: int) -> Tensor:
    """A tensor broadcastable to ``(b, h, bq, bk)`` -> broadcastable to ``(b, h_kv, g, bq, bk)``."""
    while m.dim() < 4:
        m = m.unsqueeze(0)
    return m.unsqueeze(2) if m.shape[1] == 1 else m.unflatten(1, (h_kv, groups))


@dataclass(frozen=True)
class Plan:
    """What one call needs, shared by the forward, the backward and the weights: made once per
    call ([`Plan.of`][attnkit.tiled.loop.Plan.of]), kept without the call's tensors by the
    autograd function, and bound to the tensors each pass is handed
    ([`bound`][attnkit.tiled.loop.Plan.bound])."""

    call: Call
    b: int
    h_kv: int
    groups: int
    t: int
    s: int
    matmul_dtype: torch.dtype  # dtype of the block products
    stats_dtype: torch.dtype  # dtype of scores, softmax statistics and accumulators
    block_q: int
    block_k: int
    tile_bytes: int  # the most a tile of a score_mod's bias takes (the C++ kernel's)
    route: TiledRoute  # the route it was planned on (the kernel's way with bf16 blocks)
    blocks: BlockPlan | None = None  # the block mask's tables, if one is given
    compile_mods: bool = False  # evaluate score_mod and mask_mod compiled (mods.compile_block)
    dropout: Dropout | None = None  # the weights' dropout, its seed drawn for the call

    @staticmethod
    def of(call: Call, route: TiledRoute, dropout: Dropout | None = None) -> Plan:
        """The plan of ``call`` on ``route``: its products and block sizes."""
        q, k = call.q, call.k
        block_q, block_k = route.block_q, route.block_k
        blocks = None
        compile_mods = q.shape[2] * k.shape[2] >= mods.COMPILE_FROM
        if call.block_mask is not None:  # whole blocks of the mask's, to skip the empty ones
            mask_q, mask_k = call.block_mask.BLOCK_SIZE
            most = (max(1, block_q // mask_q), max(1, block_k // mask_k))
            b, h = q.shape[:2]
            blocks = BlockPlan(call.block_mask, b, h, most, compiled=compile_mods)
            block_q, block_k = blocks.block_size
        return Plan(
            call=call,
            b=q.shape[0],
            h_kv=k.shape[1],
            groups=q.shape[1] // k.shape[1],
            t=q.shape[2],
            s=k.shape[2],
            matmul_dtype=route.products,
            stats_dtype=_stats_dtype(q.dtype),
            block_q=block_q,
            block_k=block_k,
            tile_bytes=route.tile_bytes,
            route=route,
            blocks=blocks,
            compile_mods=compile_mods,
            dropout=dropout,
        )

    def bound(self, call: Call) -> Plan:
        """This plan on the tensors of ``call``, the same call's as handed to a pass (under
        ``vmap``, with the mapped dim folded into the batch)."""
        q, k = call.q, call.k
        b, h, t, _ = q.shape
        h_kv, s = k.shape[1], k.shape[2]
        stats = _stats_dtype(q.dtype)
        return replace(
            self, call=call, b=b, h_kv=h_kv, groups=h // h_kv, t=t, s=s, stats_dtype=stats
        )

    def without_tensors(self) -> Plan:
        """This plan, its call without its tensors: what the autograd function keeps."""
        return replace(self, call=self.call.with_tensors(*[None] * 6))

    def query_blocks(self) -> Iterator[tuple[int, int]]:
        for i0 in range(0, self.t, self.block_q):
            yield i0, min(i0 + self.block_q, self.t)

    def key_blocks(self, i0: int, i1: int) -> Iterator[tuple[int, int, bool]]:
        """``(j0, j1, needs_window_mask)`` for the key blocks that queries ``i0..i1-1`` can see:
        those in the window's range, and with a block mask, those it lists for these rows."""
        left, right = self.call.masks.window or (-1, -1)
        diagonal = self.s - self.t + self.call.masks.shift  # p(i) = i + diagonal
        first, last = i0 + diagonal, i1 - 1 + diagonal  # p(i0), p(i1 - 1)
        lo = max(0, first - left) if left >= 0 else 0
        hi = min(self.s, last + right + 1) if right >= 0 else self.s
        if self.blocks is None:
            spans = ((j0, min(j0 + self.block_k, hi)) for j0 in range(lo, hi, self.block_k))
        else:
            listed = self.blocks.key_blocks[i0 // self.block_q]
            spans = (
                (max(kb * self.block_k, lo), min((kb + 1) * self.block_k, hi)) for kb in listed
            )
        for j0, j1 in spans:
            if j0 >= j1:
                continue
            inside = (left < 0 or j0 >= last - left) and (right < 0 or j1 - 1 <= first + right)
            yield j0, j1, not inside

    def distance(self, i0: int, i1: int, j0: int, j1: int, device: torch.device) -> Tensor:
        """``|p(i) - j|`` over the block, ``(bq, bk)`` in ``stats_dtype`` (ALiBi's distances)."""
        factory = {"device": device, "dtype": self.stats_dtype}
        q_pos = torch.arange(i0, i1, **factory) + (self.s - self.t + self.call.masks.shift)
        return (q_pos[:, None] - torch.arange(j0, j1, **factory)).abs_()

    def scores(
        self,
        q_blk: Tensor,
        k_blk: Tensor,
        i0: int,
        i1: int,
        j0: int,
        j1: int,
        window: bool,
        *,
        tape: bool = False,
        whole: bool = False,
    ) -> tuple[Tensor, Tensor | None, tuple[Tensor, Tensor] | None]:
        """The masked scores of one block, ``(b, h_kv, g, bq, bk)`` in ``stats_dtype``;
        ``tanh(u / softcap)`` (for the backward) when soft-capping; and with ``tape``, the scores
        before and after ``score_mod`` with the mod's graph between them (for its gradients).
        ``q_blk`` and ``k_blk`` come through
        [`nan_rows`][attnkit.rules.nonfinite.nan_rows] and the slopes are NaN where not finite,
        so a score made non-finite by the inputs is NaN; only a mask (or ``score_mod``) gives -inf
        (a +inf bias makes the row's max +inf, hence NaN). ``whole``: the block is every row and
        key, and a block mask applies densely."""
        call = self.call
        b, h_kv, g = self.b, self.h_kv, self.groups
        raw = torch.matmul(q_blk, k_blk.transpose(-2, -1))  # (b, h_kv, g*bq, d) x (b, h_kv, d, bk)
        scores = raw.to(self.stats_dtype).view(b, h_kv, g, i1 - i0, j1 - j0)
        capped = None
        if call.softcap is not None:
            capped = torch.tanh(scores / call.softcap)
            scores = capped * call.softcap
        if call.alibi_slopes is not None:
            slopes = call.alibi_slopes.to(self.stats_dtype)
            neg_slopes = -slopes.where(torch.isfinite(slopes), NAN).view(h_kv, g, 1, 1)
            distance = self.distance(i0, i1, j0, j1, q_blk.device)  # (bq, bk)
            scores = scores.addcmul_(neg_slopes, distance)  # one pass: score -= slope |p(i) - j|
        recorded = None
        if call.score_mod is not None:
            scores, recorded = self._score_mod(scores, i0, i1, j0, j1, tape)
        bias = call.masks.bias((i0, i1), (j0, j1))
        if bias is not None:
            scores = scores + _by_group(bias.to(self.stats_dtype), h_kv, g)
        allowed = call.masks.allowed(
            self.t, self.s, q_blk.device, (i0, i1), (j0, j1), with_window=window
        )
        if allowed is not None:
            scores = scores.masked_fill(~_by_group(allowed, h_kv, g), _NEG_INF)
        if self.blocks is not None:
            if whole:
                allowed = dense_allowed(self.blocks.block_mask, b, h_kv * g)
            else:
                qb, kb = i0 // self.block_q, j0 // self.block_k
                allowed = self.blocks.allowed(qb, kb, range(i0, i1), range(j0, j1))
            if allowed is not None:
                scores = scores.masked_fill(~_by_group(allowed, h_kv, g), _NEG_INF)
        return scores, capped, recorded

    def _score_mod(
        self, scores: Tensor, i0: int, i1: int, j0: int, j1: int, tape: bool
    ) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """``score_mod`` over one block, seen as ``(b, h, bq, bk)`` with the absolute indices of
        its batches, heads, rows and keys; with ``tape``, also ``(before, after)`` with the mod's
        graph between them."""
        shape = scores.shape
        at = mods.Block.of(
            range(self.b),
            range(self.h_kv * self.groups),
            range(i0, i1),
            range(j0, j1),
            scores.device,
        )
        four_d = (self.b, self.h_kv * self.groups, i1 - i0, j1 - j0)
        compiled = self.compile_mods
        if not tape:
            out = mods.score(self.call.score_mod, scores.view(four_d), at, compiled=compiled)
            return out.view(shape), None
        before = scores.detach().view(four_d).requires_grad_()
        with torch.enable_grad():
            after = mods.score(self.call.score_mod, before, at, compiled=compiled)
        return after.detach().view(shape), (before, after)  # the loop never writes into it

    def keep_scale(self, i0: int, i1: int, j0: int, j1: int, device: torch.device) -> Tensor:
        """The dropout's factors over the block, ``(b, h_kv, g, bq, bk)`` in ``stats_dtype``:
        ``1 / (1 - p)`` for a kept weight, 0 for a dropped one."""
        heads = self.h_kv * self.groups
        factors = keep_scale(
            self.dropout, self.b, heads, self.t, i0, i1, j0, j1, device, self.stats_dtype
        )
        return factors.view(self.b, self.h_kv, self.groups, i1 - i0, j1 - j0)

    def grouped_rows(self, x: Tensor, i0: int, i1: int) -> Tensor:
        """Rows ``i0..i1`` of a ``(b, h_kv, g, t, n)`` tensor as one ``(b, h_kv, g*bq, n)`` block."""
        return x[:, :, :, i0:i1].reshape(self.b, self.h_kv, self.groups * (i1 - i0), x.shape[-1])


def _through_score_mod(
    recorded: tuple[Tensor, Tensor],
    dscores: Tensor,
    tensors: tuple[Tensor, ...],
    mod_grads: list[Tensor | None],
    masked: Tensor | None,
) -> Tensor:
    """The gradient of the scores before ``score_mod`` given that after it (``dscores``), adding
    the gradients of the tensors the mod reads into ``mod_grads``."""
    before, after = recorded
    if not after.requires_grad:  # a constant: neither the score nor a tensor reaches it
        return torch.zeros_like(dscores)
    grads = torch.autograd.grad(
        after, (before, *tensors), dscores.view(after.shape), allow_unused=True
    )
    for i, grad in enumerate(grads[1:]):
        if grad is not None:
            mod_grads[i] = grad if mod_grads[i] is None else mod_grads[i] + grad
    if grads[0] is None:  # the mod's result does not depend on the score
        return torch.zeros_like(dscores)
    dbefore = grads[0].view(dscores.shape)
    return dbefore if masked is None else dbefore.masked_fill_(masked, 0.0)


def exp_(x: Tensor) -> Tensor:
    """``x.exp_()`` for scores minus their row's max, with exponents below -87 made -inf first in
    float32: their results are subnormal floats (under 1.2e-38, nothing next to the max's 1),
    which x86 CPUs handle many times slower than normal ones. ALiBi over long rows is full of
    them: there the exponentials took four times as long. NaN stays NaN."""
    if x.dtype == torch.float32:
        x.masked_fill_(x < _SUBNORMAL_EXPONENT, _NEG_INF)
    return x.exp_()


_SUBNORMAL_EXPONENT = -87.0  # exp(-87.34) is float32's smallest normal number


def _flat(x: Tensor) -> Tensor:
    """``(b, h_kv, n, m) -> (b * h_kv, n, m)``, a view where the strides allow."""
    return x.reshape(-1, *x.shape[-2:])


def _add_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` for 3-D tensors, in place; no temporary when the dtypes agree."""
    if a.dtype == acc.dtype:
        acc.baddbmm_(a, b)
    else:  # half-precision products into a float32 accumulator
        acc.add_(torch.bmm(a, b))


def online_softmax_(
    scores: Tensor,
    values: Tensor,
    row_max: Tensor,
    row_sum: Tensor,
    acc: Tensor,
    kept: Tensor | None = None,
) -> Tensor:
    """One key block's step of the online softmax: the running sum ``row_sum`` and the
    unnormalised output ``acc`` take the block's ``scores`` ``(b, h_kv, g, bq, bk)`` and
    ``values`` ``(b, h_kv, bk, d_v)`` in place; returns the new running max (-inf until the row
    meets a key). ``kept``: the dropout's factors of the block (the sum takes every weight, the
    output only the kept ones). ``scores`` are overwritten. Long calls run it compiled
    ([`compiled_or_eager`][attnkit.mods.compiled_or_eager]): its half-dozen passes over the
    block become two (docs/bench/choices.md)."""
    b, h_kv, g, bq, bk = scores.shape
    new_max = torch.maximum(row_max, scores.amax(dim=-1, keepdim=True))
    shift = new_max.masked_fill(new_max == _NEG_INF, 0.0)  # a row with no key yet: 0
    probs = exp_(scores.sub_(shift))  # unnormalised
    rescale = torch.exp(row_max - shift)  # how much the old terms shrink
    row_sum.mul_(rescale).add_(probs.sum(dim=-1, keepdim=True))
    if kept is not None:
        probs = probs.mul_(kept)
    acc.mul_(rescale)
    p_3d = probs.view(b * h_kv, g * bq, bk).to(values.dtype)
    _add_matmul(acc.view(b * h_kv, g * bq, -1), p_3d, _flat(values))  # += P V
    return new_max


def softmax_backward_(
    scores: Tensor, lse: Tensor, dprobs: Tensor, delta: Tensor, masked: Tensor | None
) -> tuple[Tensor, Tensor]:
    """One block's weights ``P = exp(S - lse)`` and ``dS = P (dP - D)``, both in ``scores``'
    dtype; 0 where ``masked`` (a NaN row's or a hidden key's NaN times 0). Long calls run it
    compiled, as [`online_softmax_`][attnkit.tiled.loop.online_softmax_]: written out of
    place, it becomes one pass that reads two blocks and writes two, several times faster than
    its eager passes (docs/bench/choices.md)."""
    probs = exp_(scores - lse)  # not in place: a score_mod's graph may hold the scores
    dscores = probs * (dprobs.to(scores.dtype) - delta)
    if masked is not None:
        probs.masked_fill_(masked, 0.0)
        dscores.masked_fill_(masked, 0.0)
    return probs, dscores


def forward(q5: Tensor, k: Tensor, v: Tensor, plan: Plan) -> tuple[Tensor, Tensor]:
    """``q5`` ``(b, h_kv, g, t, d)`` pre-scaled, in the matmul dtype; returns the output
    ``(b, h_kv, g, t, d_v)`` in ``stats_dtype`` and lse ``(b, h_kv, g, t)``. A row with a NaN score
    gets a NaN max, which spreads through its sum and output."""
    b, h_kv, g, t, _ = q5.shape
    out = q5.new_empty(b, h_kv, g, t, v.shape[-1], dtype=plan.stats_dtype)
    lse = q5.new_empty(b, h_kv, g, t, dtype=plan.stats_dtype)
    # With a non-finite value about, a block that masks keys takes the values with their
    # non-finite entries zeroed (a masked key's weight is 0, and 0 * NaN is NaN) and `touched`
    # counts, per row and column, the non-finite values the row does see.
    careful = may_hold_nonfinite(v)
    if careful:
        finite = torch.isfinite(v)
        clean_v, bad_v = v.where(finite, 0.0), (~finite).to(plan.matmul_dtype)
    call = plan.call  # masks that may hide keys inside a block (key_mask padding is zero already)
    masked_blocks = any(
        x is not None for x in (call.masks.attn_mask, call.score_mod, call.block_mask)
    )
    step = mods.compiled_or_eager(online_softmax_) if plan.compile_mods else online_softmax_
    for i0, i1 in plan.query_blocks():
        bq = i1 - i0
        q_blk = plan.grouped_rows(q5, i0, i1)  # (b, h_kv, g*bq, d)
        row_max = q5.new_full((b, h_kv, g, bq, 1), _NEG_INF, dtype=plan.stats_dtype)  # m
        row_sum = q5.new_zeros((b, h_kv, g, bq, 1), dtype=plan.stats_dtype)  # l
        acc = q5.new_zeros((b, h_kv, g, bq, v.shape[-1]), dtype=plan.stats_dtype)  # sum_j p_j v_j
        touched = torch.zeros_like(acc)  # (b, h_kv, g, bq, d_v)
        touched_3d = touched.view(b * h_kv, g * bq, -1)
        for j0, j1, window in plan.key_blocks(i0, i1):
            scores, _, _ = plan.scores(q_blk, k[:, :, j0:j1], i0, i1, j0, j1, window)
            values = v
            if careful and (window or masked_blocks):
                values = clean_v
                seen = (scores != _NEG_INF).view(b * h_kv, g * bq, -1).to(plan.matmul_dtype)
                _add_matmul(touched_3d, seen, _flat(bad_v[:, :, j0:j1]))
            kept = None if plan.dropout is None else plan.keep_scale(i0, i1, j0, j1, q5.device)
            row_max = step(scores, values[:, :, j0:j1], row_max, row_sum, acc, kept)
        empty = row_sum == 0  # no allowed key: output 0, lse -inf
        out[:, :, :, i0:i1] = (acc / row_sum.masked_fill(empty, 1.0)).masked_fill(touched > 0, NAN)
        lse[:, :, :, i0:i1] = (row_max + row_sum.log()).masked_fill(empty, _NEG_INF).squeeze(-1)
    return out, lse


def backward(
    dout5: Tensor,
    q5: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    delta: Tensor,
    plan: Plan,
    *,
    slopes_grad: bool,
    mod_grads: list[Tensor | None] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients of q (w.r.t. the pre-scaled q), k, v and the ALiBi slopes (if ``slopes_grad``), in
    ``stats_dtype``. ``delta`` ``(b, h_kv, g, t)`` is ``D_i = dO_i . O_i - dlse_i``. With a
    ``score_mod``, ``mod_grads`` (one entry per tensor of ``call.mod_tensors``, None at first)
    accumulates the gradients of the tensors it reads."""
    b, h_kv, g, _t, d = q5.shape
    lse = lse.masked_fill(lse == _NEG_INF, 0.0)  # empty rows: their scores are -inf, exp() = 0
    # A NaN row (NaN lse), a non-finite dP or D would put 0 * NaN at masked keys: select them out.
    careful = may_hold_nonfinite(lse, v, dout5, delta)  # delta holds the lse's gradient
    # Contiguous accumulators: the per-block slices below must be views, not copies.
    dq5 = q5.new_zeros(q5.shape, dtype=plan.stats_dtype)
    dk = k.new_zeros(k.shape, dtype=plan.stats_dtype)
    dv = v.new_zeros(v.shape, dtype=plan.stats_dtype)
    dslopes = q5.new_zeros((h_kv, g), dtype=plan.stats_dtype) if slopes_grad else None
    dout5 = dout5.to(plan.matmul_dtype)
    softmax_backward = (
        mods.compiled_or_eager(softmax_backward_) if plan.compile_mods else softmax_backward_
    )
    for i0, i1 in plan.query_blocks():
        bq = i1 - i0
        q_blk = plan.grouped_rows(q5, i0, i1)  # (b, h_kv, g*bq, d)
        do_blk = plan.grouped_rows(dout5, i0, i1)  # (b, h_kv, g*bq, d_v)
        lse_blk = lse[:, :, :, i0:i1, None]  # (b, h_kv, g, bq, 1)
        delta_blk = delta[:, :, :, i0:i1, None]
        dq_blk = q5.new_zeros((b * h_kv, g * bq, d), dtype=plan.stats_dtype)
        q_3d, do_3d = _flat(q_blk), _flat(do_blk)
        for j0, j1, window in plan.key_blocks(i0, i1):
            k_blk, v_blk = k[:, :, j0:j1], v[:, :, j0:j1]
            scores, capped, recorded = plan.scores(
                q_blk, k_blk, i0, i1, j0, j1, window, tape=mod_grads is not None
            )
            masked = scores == _NEG_INF if careful else None  # P and dS are exactly 0 there
            dprobs = torch.bmm(do_3d, _flat(v_blk).transpose(-2, -1)).view(scores.shape)
            kept = None if plan.dropout is None else plan.keep_scale(i0, i1, j0, j1, q5.device)
            if kept is not None:  # the values met P Z, Z the dropout's factors: dP = dO V^T Z
                dprobs = dprobs.to(plan.stats_dtype).mul_(kept)
            probs, dscores = softmax_backward(scores, lse_blk, dprobs, delta_blk, masked)
            p_3d = (probs if kept is None else probs * kept).view(b * h_kv, g * bq, -1)
            p_3d = p_3d.to(plan.matmul_dtype)
            _add_matmul(_flat(dv[:, :, j0:j1]), p_3d.transpose(-2, -1), do_3d)  # dV += P^T dO
            if recorded is not None:  # through score_mod, to its input and the tensors it reads
                dscores = _through_score_mod(
                    recorded, dscores, plan.call.mod_tensors, mod_grads, masked
                )
            if dslopes is not None:  # score -= slope |p(i) - j|, added after the soft-cap
                distance = plan.distance(i0, i1, j0, j1, q5.device)
                dslopes.sub_((dscores * distance).sum(dim=(0, 3, 4)))
            if capped is not None:
                slope = 1.0 - capped * capped  # d(c tanh(u / c)) / du
                dscores.mul_(slope if masked is None else slope.masked_fill_(masked, 0.0))
            ds_3d = dscores.view(b * h_kv, g * bq, -1).to(plan.matmul_dtype)
            _add_matmul(dq_blk, ds_3d, _flat(k_blk))  # dQ += dS K
            _add_matmul(_flat(dk[:, :, j0:j1]), ds_3d.transpose(-2, -1), q_3d)  # dK += dS^T Q
        dq5[:, :, :, i0:i1] = dq_blk.view(b, h_kv, g, bq, d)
    return dq5, dk, dv, None if dslopes is None else dslopes.view(-1)
