"""The tiled backend: FlashAttention-2's online softmax, block by block.

Two implementations of one algorithm: the PyTorch loop below, the readable shape of it, and
``tiled.cpp``, which runs where the block products are float32 on a CPU (see ``KERNEL``): there a
dozen tensor operations per block, each a pass over the block in memory, become a few passes over a
row that is in cache. Both are tested against the float64 oracle, option by option.

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
products run in the input dtype where the hardware has fast half-precision products (CUDA, or CPUs
with AVX512-BF16/AMX); elsewhere half-precision blocks are multiplied in float32, which is both faster
and more accurate there (bf16 GEMM without hardware support is ~400x slower than fp32 on AVX2).

Shapes: ``b`` batch, ``h`` query heads, ``h_kv`` key/value heads, ``g = h / h_kv``, ``t`` queries,
``s`` keys, ``d`` head dim, ``bq``/``bk`` block sizes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor

from attnkit.backends._native import Kernel
from attnkit.backends.base import (
    AttentionOutput,
    Request,
    differentiating_backward,
    forward_ad_active,
)
from attnkit.backends.nonfinite import may_hold_nonfinite, nan_rows
from attnkit.backends.reference import differentiable_grads
from attnkit.masks import Masks, zero_padding

BLOCK_Q = 256  # query rows per block
BLOCK_K = 512  # keys per block: a (12 heads, 256, 512) fp32 score block is 6 MB, cache-resident

_NEG_INF = float("-inf")
_NAN = float("nan")


def _fast_half_matmul(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``dtype`` matrix products are fast on ``device`` (else blocks go through float32)."""
    if device.type != "cpu":
        return True
    probe = {
        torch.bfloat16: ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
        torch.float16: ("_is_amx_fp16_supported",),
    }.get(dtype, ())
    return any(getattr(torch.cpu, name, lambda: False)() for name in probe)


def _matmul_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the block products for inputs of ``dtype``."""
    return dtype if _fast_half_matmul(dtype, device) else torch.promote_types(dtype, torch.float32)


def _by_group(m: Tensor, h_kv: int, groups: int) -> Tensor:
    """A tensor broadcastable to ``(b, h, bq, bk)`` -> broadcastable to ``(b, h_kv, g, bq, bk)``."""
    while m.dim() < 4:
        m = m.unsqueeze(0)
    return m.unsqueeze(2) if m.shape[1] == 1 else m.unflatten(1, (h_kv, groups))


class _Spec(NamedTuple):
    """The part of a call that is not a tensor. The tensors (masks, slopes) are arguments of the
    autograd function in their own right, so that gradients and ``vmap`` see them."""

    window: tuple[int, int] | None
    scale: float
    softcap: float | None
    block_q: int
    block_k: int


@dataclass(frozen=True)
class _Plan:
    """What one call needs, shared by the forward, the backward and the weights."""

    request: Request
    b: int
    h_kv: int
    groups: int
    t: int
    s: int
    matmul_dtype: torch.dtype  # dtype of the block products
    stats_dtype: torch.dtype  # dtype of scores, softmax statistics and accumulators
    block_q: int
    block_k: int

    @staticmethod
    def of(q: Tensor, k: Tensor, request: Request, block_q: int, block_k: int) -> _Plan:
        return _Plan(
            request=request,
            b=q.shape[0],
            h_kv=k.shape[1],
            groups=q.shape[1] // k.shape[1],
            t=q.shape[2],
            s=k.shape[2],
            matmul_dtype=_matmul_dtype(q.dtype, q.device),
            stats_dtype=torch.promote_types(q.dtype, torch.float32),
            block_q=block_q,
            block_k=block_k,
        )

    def query_blocks(self) -> Iterator[tuple[int, int]]:
        for i0 in range(0, self.t, self.block_q):
            yield i0, min(i0 + self.block_q, self.t)

    def key_blocks(self, i0: int, i1: int) -> Iterator[tuple[int, int, bool]]:
        """``(j0, j1, needs_window_mask)`` for the key blocks that queries ``i0..i1-1`` can see."""
        left, right = self.request.masks.window or (-1, -1)
        first, last = i0 + self.s - self.t, i1 - 1 + self.s - self.t  # p(i0), p(i1 - 1)
        lo = max(0, first - left) if left >= 0 else 0
        hi = min(self.s, last + right + 1) if right >= 0 else self.s
        for j0 in range(lo, hi, self.block_k):
            j1 = min(j0 + self.block_k, hi)
            inside = (left < 0 or j0 >= last - left) and (right < 0 or j1 - 1 <= first + right)
            yield j0, j1, not inside

    def distance(self, i0: int, i1: int, j0: int, j1: int, device: torch.device) -> Tensor:
        """``|p(i) - j|`` over the block, ``(bq, bk)`` in ``stats_dtype`` (ALiBi's distances)."""
        factory = {"device": device, "dtype": self.stats_dtype}
        q_pos = torch.arange(i0, i1, **factory) + (self.s - self.t)  # p(i)
        return (q_pos[:, None] - torch.arange(j0, j1, **factory)).abs_()

    def scores(
        self, q_blk: Tensor, k_blk: Tensor, i0: int, i1: int, j0: int, j1: int, window: bool
    ) -> tuple[Tensor, Tensor | None]:
        """The masked scores of one block, ``(b, h_kv, g, bq, bk)`` in ``stats_dtype``, and
        ``tanh(u / softcap)`` (for the backward) when soft-capping. ``q_blk`` and ``k_blk`` come
        through :func:`~attnkit.backends.nonfinite.nan_rows` and the slopes are NaN where not
        finite, so a score made non-finite by the inputs is NaN; only a mask gives -inf (a +inf
        bias makes the row's max +inf, hence NaN)."""
        req = self.request
        b, h_kv, g = self.b, self.h_kv, self.groups
        raw = torch.matmul(q_blk, k_blk.transpose(-2, -1))  # (b, h_kv, g*bq, d) x (b, h_kv, d, bk)
        scores = raw.to(self.stats_dtype).view(b, h_kv, g, i1 - i0, j1 - j0)
        capped = None
        if req.softcap is not None:
            capped = torch.tanh(scores / req.softcap)
            scores = capped * req.softcap
        if req.alibi_slopes is not None:
            slopes = req.alibi_slopes.to(self.stats_dtype)
            neg_slopes = -slopes.where(torch.isfinite(slopes), _NAN).view(h_kv, g, 1, 1)
            distance = self.distance(i0, i1, j0, j1, q_blk.device)  # (bq, bk)
            scores = scores.addcmul_(neg_slopes, distance)  # one pass: score -= slope |p(i) - j|
        bias = req.masks.bias(slice(i0, i1), slice(j0, j1))
        if bias is not None:
            scores = scores + _by_group(bias.to(self.stats_dtype), h_kv, g)
        allowed = req.masks.allowed(
            self.t, self.s, q_blk.device, slice(i0, i1), slice(j0, j1), with_window=window
        )
        if allowed is not None:
            scores = scores.masked_fill(~_by_group(allowed, h_kv, g), _NEG_INF)
        return scores, capped

    def grouped_rows(self, x: Tensor, i0: int, i1: int) -> Tensor:
        """Rows ``i0..i1`` of a ``(b, h_kv, g, t, n)`` tensor as one ``(b, h_kv, g*bq, n)`` block."""
        return x[:, :, :, i0:i1].reshape(self.b, self.h_kv, -1, x.shape[-1])


def _flat(x: Tensor) -> Tensor:
    """``(b, h_kv, n, m) -> (b * h_kv, n, m)``, a view where the strides allow."""
    return x.reshape(-1, *x.shape[-2:])


def _add_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` for 3-D tensors, in place; no temporary when the dtypes agree."""
    if a.dtype == acc.dtype:
        acc.baddbmm_(a, b)
    else:  # half-precision products into a float32 accumulator
        acc.add_(torch.bmm(a, b))


def _forward(q5: Tensor, k: Tensor, v: Tensor, plan: _Plan) -> tuple[Tensor, Tensor]:
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
    masked_blocks = plan.request.masks.attn_mask is not None  # key_mask padding is zero already
    for i0, i1 in plan.query_blocks():
        bq = i1 - i0
        q_blk = plan.grouped_rows(q5, i0, i1)  # (b, h_kv, g*bq, d)
        row_max = q5.new_full((b, h_kv, g, bq, 1), _NEG_INF, dtype=plan.stats_dtype)  # m
        row_sum = q5.new_zeros((b, h_kv, g, bq, 1), dtype=plan.stats_dtype)  # l
        acc = q5.new_zeros((b, h_kv, g, bq, v.shape[-1]), dtype=plan.stats_dtype)  # sum_j p_j v_j
        acc_3d = acc.view(b * h_kv, g * bq, -1)  # the same memory, for baddbmm
        touched = torch.zeros_like(acc)  # (b, h_kv, g, bq, d_v)
        touched_3d = touched.view(b * h_kv, g * bq, -1)
        for j0, j1, window in plan.key_blocks(i0, i1):
            scores, _ = plan.scores(q_blk, k[:, :, j0:j1], i0, i1, j0, j1, window)
            values = v
            if careful and (window or masked_blocks):
                values = clean_v
                seen = (scores != _NEG_INF).view(b * h_kv, g * bq, -1).to(plan.matmul_dtype)
                _add_matmul(touched_3d, seen, _flat(bad_v[:, :, j0:j1]))
            new_max = torch.maximum(row_max, scores.amax(dim=-1, keepdim=True))
            shift = new_max.masked_fill(new_max == _NEG_INF, 0.0)  # a row with no key yet: 0
            probs = scores.sub_(shift).exp_()  # (b, h_kv, g, bq, bk), unnormalised
            rescale = torch.exp(row_max - shift)  # how much the old terms shrink
            row_sum.mul_(rescale).add_(probs.sum(dim=-1, keepdim=True))
            acc.mul_(rescale)
            p_3d = probs.view(b * h_kv, g * bq, -1).to(plan.matmul_dtype)
            _add_matmul(acc_3d, p_3d, _flat(values[:, :, j0:j1]))  # += P V
            row_max = new_max  # stays -inf until the row meets a key
        empty = row_sum == 0  # no allowed key: output 0, lse -inf
        out[:, :, :, i0:i1] = (acc / row_sum.masked_fill(empty, 1.0)).masked_fill(touched > 0, _NAN)
        lse[:, :, :, i0:i1] = (row_max + row_sum.log()).masked_fill(empty, _NEG_INF).squeeze(-1)
    return out, lse


def _backward(
    dout5: Tensor,
    q5: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    delta: Tensor,
    plan: _Plan,
    *,
    slopes_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients of q (w.r.t. the pre-scaled q), k, v and the ALiBi slopes (if ``slopes_grad``), in
    ``stats_dtype``. ``delta`` ``(b, h_kv, g, t)`` is ``D_i = dO_i . O_i - dlse_i``."""
    b, h_kv, g, _t, d = q5.shape
    lse = lse.masked_fill(lse == _NEG_INF, 0.0)  # empty rows: their scores are -inf, exp() = 0
    # A NaN row (NaN lse) or a non-finite dP would put 0 * NaN at masked keys: select them out.
    careful = may_hold_nonfinite(lse, v, dout5)
    # Contiguous accumulators: the per-block slices below must be views, not copies.
    dq5 = q5.new_zeros(q5.shape, dtype=plan.stats_dtype)
    dk = k.new_zeros(k.shape, dtype=plan.stats_dtype)
    dv = v.new_zeros(v.shape, dtype=plan.stats_dtype)
    dslopes = q5.new_zeros((h_kv, g), dtype=plan.stats_dtype) if slopes_grad else None
    dout5 = dout5.to(plan.matmul_dtype)
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
            scores, capped = plan.scores(q_blk, k_blk, i0, i1, j0, j1, window)
            masked = scores == _NEG_INF if careful else None  # P and dS are exactly 0 there
            probs = scores.sub_(lse_blk).exp_()  # P, (b, h_kv, g, bq, bk)
            if masked is not None:
                probs.masked_fill_(masked, 0.0)
            p_3d = probs.view(b * h_kv, g * bq, -1).to(plan.matmul_dtype)
            _add_matmul(_flat(dv[:, :, j0:j1]), p_3d.transpose(-2, -1), do_3d)  # dV += P^T dO
            dprobs = torch.bmm(do_3d, _flat(v_blk).transpose(-2, -1))  # dP = dO V^T
            # dS = P (dP - D), in place over dP
            dscores = dprobs.to(plan.stats_dtype).view(probs.shape).sub_(delta_blk).mul_(probs)
            if masked is not None:
                dscores.masked_fill_(masked, 0.0)  # 0 * a NaN dP from a hidden key's value
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


def _marked(name: str) -> contextlib.AbstractContextManager:
    """A profiler range: ``attnkit::tiled_{native,loop}_{forward,backward}`` say which path ran.
    A no-op under torch.compile, whose graphs drop such ranges (with a warning)."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch.profiler.record_function(name)


def _request(spec: _Spec, slopes: Tensor | None, attn_mask: Tensor | None, key_mask: Tensor | None):
    masks = Masks(spec.window, key_mask, attn_mask)
    return Request(masks=masks, scale=spec.scale, softcap=spec.softcap, alibi_slopes=slopes)


class _TiledAttention(torch.autograd.Function):
    """``(out, lse)`` of one call. Saves only q, k, v, the masks, the output and the lse.

    Written with ``setup_context`` and a ``vmap`` rule, so that ``torch.func.grad`` and ``vmap``
    run it; forward-mode AD is refused before it gets here (no jvp rule)."""

    @staticmethod
    def forward(q, k, v, alibi_slopes, attn_mask, key_mask, spec: _Spec):
        plan = _Plan.of(q, k, _request(spec, alibi_slopes, attn_mask, key_mask), *spec[-2:])
        kernel = _native_kernel(q.device, plan.matmul_dtype)
        if kernel is not None:
            out, lse = _native_forward(kernel, q, k, v, plan)
        else:
            with _marked("attnkit::tiled_loop_forward"):
                q5, k5 = nan_rows(_prescaled(q, plan)), nan_rows(_operand(k, plan))
                out, lse = _forward(q5, k5, _operand(v, plan), plan)
        return out.view((*q.shape[:-1], v.shape[-1])).to(q.dtype), lse.view(q.shape[:-1])

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, alibi_slopes, attn_mask, key_mask, spec = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, alibi_slopes, attn_mask, key_mask, out, lse)
        ctx.spec = spec
        ctx.set_materialize_grads(False)  # an unused lse (or output) gets None, not zeros

    @staticmethod
    def backward(ctx, dout: Tensor | None, dlse: Tensor | None):
        q, k, v, slopes, attn_mask, key_mask, out, lse = ctx.saved_tensors
        wanted = ctx.needs_input_grad[:4]  # q, k, v, the slopes (a float mask has none here)
        if differentiating_backward():  # create_graph=True: the gradients must be differentiable
            request = _request(ctx.spec, slopes, attn_mask, key_mask)
            grads = differentiable_grads(q, k, v, request, dout, dlse, wanted)
            return *grads, None, None, None
        plan = _Plan.of(q, k, _request(ctx.spec, slopes, attn_mask, key_mask), *ctx.spec[-2:])
        if dout is None:
            dout = torch.zeros_like(out)
        delta = (dout.to(plan.stats_dtype) * out.to(plan.stats_dtype)).sum(dim=-1)  # dO_i . O_i
        if dlse is not None:  # d lse_i / d S_ij = P_ij: the lse's gradient joins D
            delta = delta - dlse.to(plan.stats_dtype)
        b, h, t, d = q.shape
        kernel = _native_kernel(q.device, plan.matmul_dtype)
        if torch._C._are_functorch_transforms_active():  # wrapped tensors: C++ cannot read them
            kernel = None
        if kernel is not None:
            dq, dk, dv, dslopes = _native_backward(
                kernel, dout, q, k, v, lse, delta, plan, wanted[3]
            )
        else:
            grouped = (plan.b, plan.h_kv, plan.groups, t)
            with _marked("attnkit::tiled_loop_backward"):
                dq, dk, dv, dslopes = _backward(
                    dout.reshape(*grouped, -1),
                    nan_rows(_prescaled(q, plan)),
                    nan_rows(_operand(k, plan)),
                    _operand(v, plan),
                    lse.view(grouped),
                    delta.view(grouped),
                    plan,
                    slopes_grad=wanted[3],
                )
        dq = (dq * plan.request.scale).view(b, h, t, d)  # the scores used q * scale
        dslopes = None if dslopes is None else dslopes.to(slopes.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dslopes, None, None, None

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


# The C++ kernel (tiled.cpp): the same algorithm with each block's score work fused. It runs where
# the block products are float32 on a CPU (every CPU dtype but float64, unless the CPU has fast
# half-precision products), outside torch.compile's tracing, and when it could be built.
KERNEL = Kernel("tiled.cpp", ("-O3", "-fno-math-errno", "-fno-trapping-math"))
_EMPTY = {dtype: torch.empty(0, dtype=dtype) for dtype in (torch.float32, torch.bool)}


def _native_kernel(device: torch.device, matmul_dtype: torch.dtype) -> ModuleType | None:
    """The C++ kernel if it can run a call with these block products, else None (the loop runs)."""
    if device.type != "cpu" or matmul_dtype != torch.float32:
        return None
    if torch.compiler.is_compiling():  # dynamo traces the PyTorch loop; it cannot trace C++
        return None
    return KERNEL.load()


def runs_native(q: Tensor) -> bool:
    """Whether a tiled call on ``q`` runs the C++ kernel (building it, the first time)."""
    dtype = q.dtype
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
    return _native_kernel(q.device, _matmul_dtype(dtype, q.device)) is not None


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
    return None


def _native_options(plan: _Plan) -> tuple:
    """The request as the C++ kernel takes it: bias, allowed, key_mask, alibi, softcap, window."""
    req = plan.request
    shape = (plan.b, plan.h_kv * plan.groups, plan.t, plan.s)
    bias, allowed = _EMPTY[torch.float32], _EMPTY[torch.bool]
    mask = req.masks.attn_mask
    if mask is not None and mask.dtype == torch.bool:
        allowed = mask.expand(shape)
    elif mask is not None:
        bias = mask.detach().to(torch.float32).expand(shape)
    key_mask = req.masks.key_mask
    key_mask = _EMPTY[torch.bool] if key_mask is None else key_mask.contiguous()
    slopes = req.alibi_slopes
    slopes = _EMPTY[torch.float32] if slopes is None else slopes.to(torch.float32).contiguous()
    left, right = req.masks.window or (-1, -1)
    return bias, allowed, key_mask, slopes, req.softcap or 0.0, left, right


def _native_operands(q: Tensor, k: Tensor, v: Tensor, plan: _Plan) -> tuple[Tensor, Tensor, Tensor]:
    """q pre-scaled, k and v, as the C++ kernel takes them: contiguous float32 ``(b, heads, n, d)``."""
    return _prescaled(q, plan).view(q.shape).contiguous(), _operand(k, plan), _operand(v, plan)


def _native_forward(
    kernel: ModuleType, q: Tensor, k: Tensor, v: Tensor, plan: _Plan
) -> tuple[Tensor, Tensor]:
    operands = _native_operands(q, k, v, plan)
    with _marked("attnkit::tiled_native_forward"):
        return kernel.forward(*operands, *_native_options(plan), plan.block_q, plan.block_k)


def _native_backward(
    kernel: ModuleType,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    delta: Tensor,
    plan: _Plan,
    slopes_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients of the pre-scaled q, of k, of v and of the slopes (if ``slopes_grad``), float32."""
    dout = dout.to(torch.float32).contiguous()
    lse = lse.masked_fill(lse == _NEG_INF, 0.0).contiguous()
    q, k, v = _native_operands(q, k, v, plan)
    with _marked("attnkit::tiled_native_backward"):
        dq, dk, dv, dslopes = kernel.backward(
            dout,
            q,
            k,
            v,
            lse,
            delta.contiguous(),
            *_native_options(plan),
            plan.block_q,
            plan.block_k,
            slopes_grad,
        )
    return dq, dk, dv, dslopes if slopes_grad else None


def _operand(x: Tensor, plan: _Plan) -> Tensor:
    """k or v in the matmul dtype, contiguous so that each key block is a view, not a copy."""
    return x.to(plan.matmul_dtype).contiguous()


def _prescaled(q: Tensor, plan: _Plan) -> Tensor:
    """``q * scale`` as ``(b, h_kv, g, t, d)`` in the matmul dtype (scaling q, not the scores)."""
    q5 = q.view(plan.b, plan.h_kv, plan.groups, plan.t, q.shape[-1])
    return (q5.to(plan.stats_dtype) * plan.request.scale).to(plan.matmul_dtype)


def _weights(q: Tensor, k: Tensor, lse: Tensor, plan: _Plan) -> Tensor:
    """The softmax weights ``(b, h, t, s)`` from the lse: block by block without gradients; where
    q, k, the slopes or the lse need one, as one block of ordinary differentiable operations (the
    weights are ``t x s`` anyway), whose gradient reaches the lse's and through it the kernel's."""
    b, h, t, _ = q.shape
    differentiable = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, lse, plan.request.alibi_slopes)
    )
    q5, k = nan_rows(_prescaled(q, plan)), nan_rows(_operand(k, plan))
    lse = lse.view(plan.b, plan.h_kv, plan.groups, t)
    lse = lse.masked_fill(lse == _NEG_INF, 0.0)
    if differentiable:
        scores, _ = plan.scores(plan.grouped_rows(q5, 0, t), k, 0, t, 0, plan.s, True)
        probs = (scores - lse[..., None]).exp().masked_fill(scores == _NEG_INF, 0.0)
        return probs.view(b, h, t, plan.s)
    weights = q.new_zeros(b, plan.h_kv, plan.groups, t, plan.s)
    with torch.no_grad():
        for i0, i1 in plan.query_blocks():
            q_blk = plan.grouped_rows(q5, i0, i1)
            for j0, j1, window in plan.key_blocks(i0, i1):
                scores, _ = plan.scores(q_blk, k[:, :, j0:j1], i0, i1, j0, j1, window)
                masked = scores == _NEG_INF  # 0 even in a row that a NaN score makes NaN
                probs = scores.sub_(lse[:, :, :, i0:i1, None]).exp_().masked_fill_(masked, 0.0)
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
        spec = _Spec(masks.window, request.scale, request.softcap, BLOCK_Q, BLOCK_K)
        out, lse = _TiledAttention.apply(
            q, k, v, request.alibi_slopes, masks.attn_mask, masks.key_mask, spec
        )
        weights = None
        if request.return_weights:
            plan = _Plan.of(q, k, request, BLOCK_Q, BLOCK_K)
            weights = _weights(q, k, lse, plan).to(q.dtype)
    return AttentionOutput(out, lse if request.return_lse else None, weights)
