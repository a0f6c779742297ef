"""The flex backend: torch's own FlexAttention, compiled by ``torch.compile``, on CUDA tensors.

torch compiles ``flex_attention`` into Triton kernels, forward and backward, that skip the blocks a
``BlockMask`` leaves out. A call becomes the two functions FlexAttention takes:

- a ``score_mod``: soft-capping, ALiBi, the caller's ``score_mod`` and a float ``attn_mask``, in
  attnkit's order, with its rule for non-finite scores (a score made infinite by the inputs is NaN,
  never a mask; ``-inf`` from the caller's mod or a float mask masks the key), at the cost of one
  comparison per score;
- a ``BlockMask``: causal and window masks, a caller's block mask and the tensor masks
  ([`attnkit.backends.torch_flex_masks`][attnkit.backends.torch_flex_masks]).

As in the SDPA backend, padding is zeroed in k and v first (0 times a NaN value would still be NaN)
and a query with no key gets 0. The kernel runs on leaves of its own, whose graph a plain backward
runs (torch's compiled backward); a backward with ``create_graph=True``, which that cannot take,
differentiates the reference backend's recomputation. Sinks join through FlexAttention's lse, which
torch's backward differentiates ([`attnkit.rules.sinks`][attnkit.rules.sinks]). Inside
``torch.compile`` already, ``flex_attention`` itself is called, for that compile to trace.

torch compiles at the first call with new options or lengths (static shapes: torch's kernels for
dynamic lengths failed to compile with captured tensors). Past torch's recompile limit (8 by
default, ``torch._dynamo.config.recompile_limit``) it runs FlexAttention uncompiled, which
materialises the scores: calls of many lengths want that limit raised.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention import flex_attention as torch_flex

from attnkit._tracing import traced
from attnkit.backends import base, tiled, torch_flex_masks
from attnkit.backends.base import Backend, Route
from attnkit.call import AttentionOutput, Call, forward_ad_active, wants_grad
from attnkit.mods import MaskMod, ScoreMod
from attnkit.rules.exact import differentiable_grads
from attnkit.rules.nonfinite import can_branch_on_data, nonfinite_rows
from attnkit.rules.sinks import join as join_sinks

DEVICES = frozenset({"cuda"})
"""Where it runs: where torch's FlexAttention has a backward. (The tests add ``"cpu"``, where it
computes the forward without gradients or lse, to check the mapping on any machine.)"""

GRAPH_DEVICES = frozenset({"cuda"})
"""Where torch's kernel returns an lse and has a backward, which attnkit differentiates. (The
tests add ``"cpu"``, where they run torch's FlexAttention uncompiled, to check that on any
machine.)"""

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes it runs (torch's kernels have no float64 path worth taking)."""

HEAD_DIMS = (16, 256)
"""The smallest and largest head dims (of q and k, and of v) it takes: torch's Triton kernels
multiply blocks at least 16 deep (``tl.dot``) and are tuned up to 256."""

OVER_SDPA_SCORES = 2**20
"""The fewest scores ``t * s`` from which ``auto`` takes it over SDPA on CUDA where SDPA would need
a dense mask (ALiBi, a window, causal with ``t != s``)."""

_NAN, _INF = float("nan"), float("inf")


@functools.cache
def _compiled() -> Callable:
    """``torch.compile(flex_attention)`` for static shapes, made at the first call that runs it.
    (torch 2.11 failed to lower its kernels with dynamic lengths for captured tensors and block
    masks: its ``ShapeAsConstantBuffer`` and ``unbacked_bindings`` errors.)"""
    return torch.compile(torch_flex.flex_attention, dynamic=False)


def _ieee_float32() -> bool:
    """Whether torch's settings ask for IEEE float32 matrix products (its default), which attnkit
    keeps to: some torch releases let FlexAttention's kernels multiply float32 in TF32 then."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
    highest = precision == "none" and torch.get_float32_matmul_precision() == "highest"
    return precision == "ieee" or highest


def _score_mod(call: Call, hidden: MaskMod | None, bad_rows: Tensor | None) -> ScoreMod:
    """Soft-capping, ALiBi, the caller's mod and a float mask as one ``score_mod``, in the order
    of the reference backend; ``hidden``: more keys to mask. Of attnkit's rule for non-finite
    scores FlexAttention keeps the rest itself (a NaN or ``+inf`` score makes its row NaN, a
    ``-inf`` one masks): an infinite product ``q . k`` becomes NaN here, and a slope that is not
    finite a NaN slope, so that neither hides as ``-inf`` or under ``tanh``."""
    b, h, t, _ = call.q.shape
    s = call.k.shape[2]
    softcap, user = call.softcap, call.score_mod
    slopes = None if call.alibi_slopes is None else call.alibi_slopes.float()
    if slopes is not None:
        slopes = slopes.where(torch.isfinite(slopes), _NAN)
        offset = torch_flex_masks.offset_tensor(s - t + call.masks.shift, call.q.device)
    bias = call.masks.bias()
    bias = None if bias is None else torch_flex_masks.full_view(bias, (b, h, t, s))

    def score_mod(score, b, h, q_idx, kv_idx):  # no cast: torch traces it at q's dtype
        if bad_rows is not None:  # made NaN after the kernel, where the row sees a key
            score = torch.where(bad_rows[b, h, q_idx], 0.0, score)
        score = torch.where(score.abs() == _INF, _NAN, score)
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if slopes is not None:
            score = score - slopes[h] * (q_idx + offset - kv_idx).abs()
        if user is not None:
            score = user(score, b, h, q_idx, kv_idx)
        if bias is not None:  # -inf in the float mask or from the mod masks, whatever the other
            added = bias[b, h, q_idx, kv_idx]
            masked = (added == -_INF) if user is None else (added == -_INF) | (score == -_INF)
            score = torch.where(masked, -_INF, score + added)
        if hidden is not None:
            score = torch.where(hidden(b, h, q_idx, kv_idx), score, -_INF)
        return score

    return score_mod


def _kernel_options(call: Call) -> dict:
    options = {}
    if call.q.dtype == torch.float32 and call.q.is_cuda and _ieee_float32():
        options["FLOAT32_PRECISION"] = "'ieee'"  # the kernels' default in torch 2.13, not in all
    groups = call.q.shape[1] // call.k.shape[1]
    if groups & (groups - 1):  # torch's decoding kernel takes groups that are powers of two
        options["FORCE_USE_FLEX_ATTENTION"] = True
    return options


def _run_kernel(
    call: Call, small_blocks: bool = False
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """FlexAttention's ``(out, lse)`` for the call (lse None on a CPU, whose kernel has none), and
    the ``(b, h, t)`` rows of q that are not finite (None where Python saw none), whose scores
    entered the kernel as 0 and whose output [`_rows_fixed`][attnkit.backends.torch_flex._rows_fixed]
    makes NaN."""
    q = call.q
    keys, values = call.k, call.v  # padding zeroed by the registry
    block_mask, hidden = torch_flex_masks.masks_of(call)
    bad_rows = None if call.finite else nonfinite_rows(q.detach())  # (b, h, t)
    if can_branch_on_data(bad_rows) and not bool(bad_rows.any()):
        bad_rows = None
    with_lse = q.device.type in GRAPH_DEVICES
    options = _kernel_options(call) | (SMALL_BLOCKS if small_blocks else {})
    result = (torch_flex.flex_attention if traced() else _compiled())(
        q,
        keys,
        values,
        score_mod=_score_mod(call, hidden, bad_rows),
        block_mask=block_mask,
        scale=call.scale,
        enable_gqa=bool(q.shape[1] != call.k.shape[1]),
        kernel_options=options or None,
        return_aux=torch_flex.AuxRequest(lse=True) if with_lse else None,
    )
    out, lse = (result[0], result[1].lse) if with_lse else (result, None)
    return out, lse, bad_rows


def _rows_fixed(
    out: Tensor, lse: Tensor | None, bad_rows: Tensor | None, hiding: bool
) -> tuple[Tensor, Tensor | None]:
    """``out`` and ``lse`` with attnkit's rows: NaN where a query that is not finite sees a key,
    0 where a row has no key (``hiding``: where a mask can leave one none), in one pass over
    ``out`` (a ``where`` whose backward is one pass too; two fills took four each way)."""
    if lse is None:  # the CPU of the tests: no lse, every bad row is NaN
        if bad_rows is not None:
            out = out.masked_fill(bad_rows[..., None], _NAN)
        return out, None
    no_key = lse == -_INF if hiding else None
    if bad_rows is None and no_key is None:
        return out, lse
    if bad_rows is None:
        return torch.where(no_key[..., None], 0.0, out), lse
    bad_rows = bad_rows & (lse != -_INF)  # torch's kernel gives a row of NaN scores no key
    fill = torch.zeros_like(bad_rows, dtype=out.dtype).masked_fill_(bad_rows, _NAN)
    fixed = bad_rows if no_key is None else bad_rows | no_key
    return torch.where(fixed[..., None], fill[..., None], out), lse.masked_fill(bad_rows, _NAN)


SMALL_BLOCKS = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1}
SMALL_BLOCKS |= {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32}
"""The kernel options of a second try where Triton finds no configuration of torch's kernels
that fits the GPU's shared memory (a ``score_mod`` that reads tables can need more than a
default block holds): smaller blocks, one stage."""

_NEEDS_SMALL_BLOCKS: set = set()  # the calls' kinds (see _kind) whose kernels did not fit


def _kind(call: Call) -> tuple:
    mod = call.score_mod
    return call.q.dtype, call.q.shape[-1], call.v.shape[-1], getattr(mod, "__code__", mod)


def _out_of_resources(error: Exception) -> bool:
    """Whether torch's compile failed for want of shared memory (Triton's ``OutOfResources``,
    reported by inductor as "No valid triton configs")."""
    return "out of resource" in str(error) or "No valid triton configs" in str(error)


def _fitting(call: Call, attempt: Callable[[bool], Any]) -> Any:
    """``attempt(small_blocks)``, with smaller blocks for the kinds of call whose default blocks
    did not fit the GPU (found at a first failure, then remembered)."""
    small = _kind(call) in _NEEDS_SMALL_BLOCKS
    try:
        return attempt(small)
    except Exception as error:  # inductor wraps Triton's error in several types
        if small or traced() or not _out_of_resources(error):
            raise
    _NEEDS_SMALL_BLOCKS.add(_kind(call))
    return attempt(True)


def flex(call: Call) -> AttentionOutput:
    """Shapes ``q (b, h, t, d)``, ``k (b, h_kv, s, d)``, ``v (b, h_kv, s, d_v)``."""
    masks = call.masks
    with_graph = not traced() and call.q.device.type in GRAPH_DEVICES
    if with_graph and wants_grad(*call.tensors(), *call.mod_tensors):
        template = call._replace(sinks=None).with_tensors(*[None] * 6)  # tensors saved apart
        out, lse, bad_rows = _Flex.apply(template, *call.tensors(), *call.mod_tensors)
    else:
        out, lse, bad_rows = _fitting(call, functools.partial(_run_kernel, call))
    hiding = (call.block_mask, call.score_mod, masks.window, masks.attn_mask, masks.key_mask)
    hiding = any(x is not None for x in hiding)  # what can leave a row no key
    out, lse = _rows_fixed(out, lse, bad_rows, hiding)
    if call.sinks is not None:
        return join_sinks(AttentionOutput(out, lse), call.sinks, call.return_lse)
    return AttentionOutput(out, lse if call.return_lse else None)


def _leaf(x: Tensor | None) -> Tensor | None:
    """``x`` cut from the caller's graph, a leaf that requires grad where ``x`` does."""
    return None if x is None else x.detach().requires_grad_(x.requires_grad)


class _Flex(torch.autograd.Function):
    """FlexAttention on leaves of its own, whose graph (torch's compiled backward) this function
    runs in a plain backward. A backward with ``create_graph=True``, which torch's compiled
    backward cannot take, returns for q, k, v, the slopes and the tensors a ``score_mod`` reads
    the gradients of the reference backend's recomputation, which autograd differentiates again
    (at the reference's ``O(t s)`` memory for that call). Its outputs are ``out``, ``lse`` and the
    rows of q that are not finite (see `_run_kernel`)."""

    @staticmethod
    def forward(ctx, template: Call, q, k, v, slopes, attn_mask, key_mask, *mods):
        leaves = [_leaf(x) for x in (q, k, v, slopes)]
        ctx.call = template.with_tensors(*leaves, attn_mask, key_mask, tuple(mods))
        ctx.inputs = [*leaves[:4], *mods]
        _fitting(ctx.call, functools.partial(_Flex.run, ctx))
        ctx.save_for_backward(q, k, v, slopes, attn_mask, key_mask, *mods)
        ctx.template = template
        ctx.set_materialize_grads(False)
        if ctx.bad_rows is not None:
            ctx.mark_non_differentiable(ctx.bad_rows)
        return ctx.out.detach(), ctx.lse.detach(), ctx.bad_rows

    @staticmethod
    def run(ctx, small_blocks: bool) -> None:
        """The kernel on the leaves, its graph kept in ``ctx``."""
        with torch.enable_grad():  # the caller's mod tensors join this graph as its inputs
            ctx.out, ctx.lse, ctx.bad_rows = _run_kernel(ctx.call, small_blocks)
        ctx.small_blocks = small_blocks

    @staticmethod
    def backward(ctx, dout, dlse, _bad_rows):
        needs = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph=True: the reference's recomputation
            q, k, v, slopes, attn_mask, key_mask, *mods = ctx.saved_tensors
            call = ctx.template.with_tensors(q, k, v, slopes, attn_mask, key_mask, tuple(mods))
            grads = differentiable_grads(call, dout, dlse, (*needs[1:5], False, *needs[7:]))
            return None, *grads[:4], None, None, *grads[5:]
        wanted = (*needs[1:5], *needs[7:])  # of ctx.inputs: q, k, v, the slopes, the mods'
        inputs = [x for x, w in zip(ctx.inputs, wanted) if w]
        if not inputs or (dout is None and dlse is None):
            return (None,) * len(needs)

        def torchs_backward(small_blocks: bool) -> tuple[Tensor, ...]:
            # again where the default blocks' backward did not fit, or where a backward before
            # this one freed the graph (torch's compiled backward frees what it can: it takes
            # retain_graph=False only)
            if ctx.out is None or small_blocks != ctx.small_blocks:
                _Flex.run(ctx, small_blocks)
            pairs = [(o, g) for o, g in ((ctx.out, dout), (ctx.lse, dlse)) if g is not None]
            outputs, cotangents = zip(*pairs)
            ctx.out = ctx.lse = None
            return torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)

        found = iter(_fitting(ctx.call, torchs_backward))
        grads = [next(found) if w else None for w in wanted]
        return None, *grads[:4], None, None, *grads[4:]


class FlexBackend(Backend):
    """torch's compiled FlexAttention: a fused forward and backward for what SDPA cannot do."""

    name = "flex"
    supports = frozenset(
        {"causal", "window", "attn_mask", "key_mask", "alibi_slopes", "softcap", "return_lse"}
        | {"score_mod", "block_mask", "shift", "sinks"}
    )
    looks_at_values = True  # a NaN query row enters the kernel as 0 (see _run_kernel)
    runs = "torch's FlexAttention (torch.nn.attention.flex_attention), compiled by torch.compile"
    """What runs, as which_backend's reason says."""

    def refuses(self, call: Call) -> str | None:
        q = call.q
        if torch.jit.is_tracing():
            return "under torch.jit.trace, which cannot record torch.compile's kernels"
        if q.device.type not in DEVICES:
            return f"{q.device.type} tensors: torch's FlexAttention has a backward on CUDA only"
        if q.dtype not in DTYPES:
            return f"{q.dtype} tensors: it runs float32, bfloat16 and float16"
        low, high = HEAD_DIMS
        dims = (q.shape[-1], call.v.shape[-1])
        if min(dims) < low or max(dims) > high:
            return (
                f"head dims {dims[0]} (q, k) and {dims[1]} (v): torch's FlexAttention kernels "
                f"take {low} to {high}"
            )
        if forward_ad_active():
            return "forward-mode AD (torch.func.jvp, jacfwd, forward_ad): FlexAttention has no jvp rule"
        if torch._C._are_functorch_transforms_active():
            return (
                "under a torch.func transform (vmap, grad, jacrev): torch.compile runs outside them"
            )
        user = call.block_mask
        if (
            user is not None
            and torch_flex_masks.grid(user) != tuple(user.BLOCK_SIZE)
            and (traced() or torch_flex_masks.grid(user) is None)
        ):
            return (
                f"a block_mask of BLOCK_SIZE {tuple(user.BLOCK_SIZE)}: torch's kernels take blocks "
                f"that are multiples of {torch_flex_masks.BLOCK}; blocks that divide {torch_flex_masks.BLOCK} are regridded, but not "
                "inside torch.compile"
            )
        from torch.utils._triton import has_triton  # cached by torch

        if q.device.type == "cuda" and not has_triton():
            return "without Triton, whose kernels torch's FlexAttention compiles on CUDA"
        return None

    def may_be_faster(self, call: Call) -> bool:
        return call.q.is_cuda  # its rules are CUDA's

    def faster_than(self, other: Backend, call: Call, plan: None = None) -> str | None:
        """Over SDPA, on CUDA only, where SDPA would be given a dense mask: from
        [`OVER_SDPA_SCORES`][attnkit.backends.torch_flex.OVER_SDPA_SCORES] scores, or where the tiled
        backend's own rule would take the call (its PyTorch loop, on CUDA, is slower than this
        compiled kernel)."""
        if other.name != "sdpa" or not call.q.is_cuda:
            return None
        _, h, t, _ = call.q.shape
        s, masks = call.k.shape[2], call.masks
        # causal alone needs no mask with t == s, a single query, or (MHA) torch's lower-right bias
        causal = masks.is_causal_only and (t in (1, s) or (t < s and call.k.shape[1] == h))
        positional = masks.window is not None and not causal
        if (positional or call.alibi_slopes is not None) and t * s >= OVER_SDPA_SCORES:
            return (
                f"SDPA would read a dense mask of {t} x {s} scores; FlexAttention skips the blocks "
                "a window empties and adds ALiBi per score"
            )
        reason = tiled.BACKEND.faster_than(other, call)  # on CUDA its loop is slower than this
        return None if reason is None else f"{reason} (the tiled backend's rule)"

    def path(self, call: Call) -> Route:
        return Route("compiled")

    def memory(self, call: Call) -> tuple[int, str]:
        b, h, t, _ = call.q.shape
        s = call.k.shape[2]
        total, what = base.result_bytes(call), "the results"
        if call.masks.key_mask is not None:
            total += (call.k.numel() + call.v.numel()) * call.k.element_size()
            what += " and k and v with their padding zeroed"
        if call.masks.window is not None or call.block_mask is not None:
            heads = 1 if call.block_mask is None else b * h
            total += (
                16 * heads * -(-t // torch_flex_masks.BLOCK) * -(-s // torch_flex_masks.BLOCK)
            )  # 4 int32 tables
            what += " and the block tables"
        return total, what

    def run(self, call: Call) -> AttentionOutput:
        return flex(call)


BACKEND = FlexBackend()
