"""The flex backend: torch's own FlexAttention, compiled by ``torch.compile``, on CUDA tensors.

torch compiles ``flex_attention`` into Triton kernels, forward and backward, that skip the blocks a
``BlockMask`` leaves out. A call becomes the two functions FlexAttention takes:

- a ``score_mod``: soft-capping, ALiBi, the caller's ``score_mod`` and a float ``attn_mask``, in
  attnkit's order, with its rule for non-finite scores (a score made infinite by the inputs is NaN,
  never a mask; ``-inf`` from the caller's mod or a float mask masks the key), at the cost of one
  comparison per score;
- a ``BlockMask``: causal and window masks and a caller's block mask, their block tables combined
  and cached, with ``key_mask`` and a bool ``attn_mask`` indexed in its ``mask_mod`` (every listed
  block then partial, so that it runs in each). A caller's block mask alone passes as it is.

As in the SDPA backend, padding is zeroed in k and v first (0 times a NaN value would still be NaN),
a query with no key gets 0, and a backward with ``create_graph=True`` differentiates the reference
backend's recomputation. Sinks join through FlexAttention's lse, which torch's backward
differentiates ([`attnkit.backends.sinks`][attnkit.backends.sinks]).
Inside ``torch.compile`` already, ``flex_attention`` itself is called, for that compile to trace,
and every mask but a caller's block mask becomes ``-inf`` scores: no table is built while tracing.

torch compiles at the first call with new options, and once more at other lengths, for any: a
growing cache compiles twice. Past torch's recompile limit it runs FlexAttention uncompiled.
"""

from __future__ import annotations

import collections
import copy
import functools
import threading
from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention import flex_attention as torch_flex
from torch.nn.attention.flex_attention import BlockMask, noop_mask

from attnkit import block_mask as block_tables
from attnkit._tracing import traced
from attnkit.backends import base, tiled
from attnkit.backends.base import AttentionOutput, Backend, Call, Path
from attnkit.backends.reference import differentiable_grads
from attnkit.backends.sinks import join as join_sinks
from attnkit.masks import zero_padding
from attnkit.mods import MaskMod, ScoreMod

DEVICES = frozenset({"cuda"})
"""Where it runs: where torch's FlexAttention has a backward. (The tests add ``"cpu"``, where it
computes the forward without gradients or lse, to check the mapping on any machine.)"""

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes it runs (torch's kernels have no float64 path worth taking)."""

HEAD_DIMS = (16, 256)
"""The smallest and largest head dims (of q and k, and of v) it takes: torch's Triton kernels
multiply blocks at least 16 deep (``tl.dot``) and are tuned up to 256."""

BLOCK = 128
"""The block size of the block masks it builds: torch's default, a multiple of every block its
kernels take. A caller's block mask whose blocks divide it is regridded to it."""

OVER_SDPA_SCORES = 2**20
"""The fewest scores ``t * s`` from which ``auto`` takes it over SDPA on CUDA where SDPA would need
a dense mask (ALiBi, a window, causal with ``t != s``)."""

CACHE_SIZE = 16
"""The block masks kept, the least recently used dropped first."""

_NAN, _INF = float("nan"), float("inf")
_CACHE: collections.OrderedDict = collections.OrderedDict()  # key -> (owner, BlockMask)
_LOCK = threading.Lock()


@functools.cache
def _compiled() -> Callable:
    """``torch.compile(flex_attention)``, made at the first call that runs it: static lengths
    first, dynamic ones from the first change (``dynamic=False`` would compile every new length)."""
    return torch.compile(torch_flex.flex_attention)


def _ieee_float32() -> bool:
    """Whether torch's settings ask for IEEE float32 matrix products (its default), which attnkit
    keeps to: some torch releases let FlexAttention's kernels multiply float32 in TF32 then."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
    highest = precision == "none" and torch.get_float32_matmul_precision() == "highest"
    return precision == "ieee" or highest


def _grid(user: BlockMask) -> tuple[int, int] | None:
    """The blocks to combine ``user``'s tables at: its own where torch's kernels take them (a
    multiple of [`BLOCK`][attnkit.backends.flex.BLOCK]), else ``BLOCK`` where they divide it;
    None where neither."""
    sizes = []
    for n in user.BLOCK_SIZE:
        if n % BLOCK and BLOCK % n:
            return None
        sizes.append(n if n % BLOCK == 0 else BLOCK)
    return sizes[0], sizes[1]


def _full(mask: Tensor, shape: tuple[int, int, int, int]) -> Tensor:
    """A mask broadcastable to ``shape`` as a 4-D view of that shape (no copy)."""
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(shape)


def _offset(offset: int, device: torch.device) -> Tensor:
    """``offset`` as a 0-d tensor for a mod: an int of lengths that vary is symbolic inside
    torch.compile, which some torch versions cannot lower into the kernel (2.11)."""
    return torch.full((), offset, dtype=torch.int32, device=device)


def _positional(window: tuple[int, int], offset: Tensor) -> MaskMod:
    """The window (causal folded in) as a ``mask_mod``: ``p(i) - left <= j <= p(i) + right``,
    with ``p(i) = i + offset``."""
    left, right = window

    def positional(b, h, q_idx, kv_idx):
        distance = q_idx + offset - kv_idx  # p(i) - j
        if left < 0:
            return distance >= -right
        if right < 0:
            return distance <= left
        return (distance <= left) & (distance >= -right)

    return positional


def _listed(user: BlockMask) -> MaskMod:
    """What ``user`` allows, as a ``mask_mod`` on any grid: every score of its full blocks, and in
    its partial blocks those its own ``mask_mod`` allows."""
    partial, full = block_tables.tables(user)
    kind = full.to(torch.int8) * 2 + partial.to(torch.int8)  # 2 full, 1 partial, 0 left out
    nb, nh = kind.shape[:2]
    bq, bk = user.BLOCK_SIZE
    mask_mod = user.mask_mod

    def listed(b, h, q_idx, kv_idx):
        here = kind[b if nb > 1 else 0, h if nh > 1 else 0, q_idx // bq, kv_idx // bk]
        return (here == 2) | ((here == 1) & mask_mod(b, h, q_idx, kv_idx))

    return listed


def _regrid(user: BlockMask, grid: tuple[int, int], t: int, s: int) -> tuple[Tensor, Tensor]:
    """``(listed, full)`` of ``user``'s tables on ``grid``, whose blocks hold whole blocks of its:
    a block is listed where one of its blocks is, full where all are."""
    partial, full = block_tables.tables(user)
    fq, fk = grid[0] // user.BLOCK_SIZE[0], grid[1] // user.BLOCK_SIZE[1]
    nq, nk = -(-t // grid[0]), -(-s // grid[1])

    def group(table: Tensor, every: bool) -> Tensor:
        pad = (0, nk * fk - table.shape[-1], 0, nq * fq - table.shape[-2])
        table = torch.nn.functional.pad(table.to(torch.uint8), pad)
        table = table.view(*table.shape[:2], nq, fq, nk, fk)
        reduced = table.amin(dim=5).amin(dim=3) if every else table.amax(dim=5).amax(dim=3)
        return reduced.bool()

    return group(partial | full, every=False), group(full, every=True)


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """``(num_blocks, indices)`` of a bool table, the listed blocks first, as torch orders them."""
    dense = blocks.to(torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(dim=-1, dtype=torch.int32), indices.to(torch.int32)


def _build(call: Call, grid: tuple[int, int], all_partial: bool) -> BlockMask:
    """The block mask of the call's window and block mask, on ``grid``."""
    q, window, user = call.q, call.masks.window, call.block_mask
    t, s = q.shape[2], call.k.shape[2]
    nq, nk = -(-t // grid[0]), -(-s // grid[1])
    listed = torch.ones(1, 1, nq, nk, dtype=torch.bool, device=q.device)
    full, parts = listed, []
    if window is not None:
        positional = _positional(window, _offset(s - t + call.masks.shift, q.device))
        some, every = block_tables.block_counts(positional, 1, 1, t, s, *grid, q.device)
        listed, full = listed & (some | every), full & every
        parts.append(positional)
    if user is not None:
        user_listed, user_full = _regrid(user, grid, t, s)
        listed, full = listed & user_listed, full & user_full
        parts.append(_listed(user))
    mask_mod = (
        torch_flex.and_masks(*parts) if len(parts) > 1 else (parts[0] if parts else noop_mask)
    )
    return BlockMask.from_kv_blocks(
        *_ordered(listed if all_partial else listed & ~full),
        *((None, None) if all_partial else _ordered(full)),
        BLOCK_SIZE=grid,
        mask_mod=mask_mod,
        seq_lengths=(t, s),
    )


def _structure(call: Call, all_partial: bool) -> BlockMask | None:
    """The block mask of the call's window and block mask (every listed block partial where
    ``all_partial``), from the cache where it was built before; None where nothing masks."""
    window, user = call.masks.window, call.block_mask
    if window is None and user is None and not all_partial:
        return None
    grid = (BLOCK, BLOCK) if user is None else _grid(user)
    if window is None and not all_partial and grid == tuple(user.BLOCK_SIZE):
        return user  # as it is: torch's kernels take it
    t, s = call.q.shape[2], call.k.shape[2]
    key = (t, s, window, call.masks.shift, grid, call.q.device, all_partial, id(user))
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None and hit[0] is user:  # the entry holds user: its id is not reused
            _CACHE.move_to_end(key)
            return hit[1]
    built = _build(call, grid, all_partial)
    with _LOCK:
        _CACHE[key] = (user, built)
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    return built


def _with_tensors(base: MaskMod, key_mask: Tensor | None, allowed: Tensor | None) -> MaskMod:
    """``base`` and the call's tensor masks: ``key_mask`` ``(b, s)`` and a bool mask
    ``(b, h, t, s)`` (a broadcast view), indexed per score."""

    def mask_mod(b, h, q_idx, kv_idx):
        shown = base(b, h, q_idx, kv_idx)
        if key_mask is not None:
            shown = shown & key_mask[b, kv_idx]
        if allowed is not None:
            shown = shown & allowed[b, h, q_idx, kv_idx]
        return shown

    return mask_mod


def _masks(call: Call) -> tuple[BlockMask | None, MaskMod | None]:
    """The block mask to give FlexAttention, and what the ``score_mod`` must hide besides (while
    traced: the window and the tensor masks, as ``-inf`` scores)."""
    b, h, t, _ = call.q.shape
    masks = call.masks
    allowed = masks.attn_mask if masks.bias() is None else None
    if allowed is not None:
        allowed = _full(allowed, (b, h, t, call.k.shape[2]))
    tensors = masks.key_mask is not None or allowed is not None
    if traced():
        hidden = None
        if masks.window is not None or tensors:
            base = noop_mask
            if masks.window is not None:
                offset = _offset(call.k.shape[2] - t + masks.shift, call.q.device)
                base = _positional(masks.window, offset)
            hidden = _with_tensors(base, masks.key_mask, allowed)
        return call.block_mask, hidden
    structure = _structure(call, all_partial=tensors)
    if not tensors:
        return structure, None
    with_tensors = copy.copy(structure)
    with_tensors.mask_mod = _with_tensors(structure.mask_mod, masks.key_mask, allowed)
    return with_tensors, None


def _score_mod(call: Call, hidden: MaskMod | None) -> ScoreMod:
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
        offset = _offset(s - t + call.masks.shift, call.q.device)
    bias = call.masks.bias()
    bias = None if bias is None else _full(bias, (b, h, t, s))

    def score_mod(score, b, h, q_idx, kv_idx):  # no cast: torch traces it at q's dtype
        score = torch.where(score.abs() == _INF, _NAN, score)
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if slopes is not None:
            score = score - slopes[h] * (q_idx + offset - kv_idx).abs()
        if user is not None:
            score = user(score, b, h, q_idx, kv_idx)
        if bias is not None:  # -inf from the mod stays a mask whatever the float mask adds
            added = score + bias[b, h, q_idx, kv_idx]
            score = added if user is None else torch.where(score == -_INF, score, added)
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


def flex(call: Call) -> AttentionOutput:
    """Shapes ``q (b, h, t, d)``, ``k (b, h_kv, s, d)``, ``v (b, h_kv, s, d_v)``."""
    q, k, v, masks = call.q, call.k, call.v, call.masks
    keys, values = zero_padding(k, masks.key_mask), zero_padding(v, masks.key_mask)
    block_mask, hidden = _masks(call)
    with_lse = q.device.type != "cpu"  # torch's CPU kernel returns no lse
    result = (torch_flex.flex_attention if traced() else _compiled())(
        q,
        keys,
        values,
        score_mod=_score_mod(call, hidden),
        block_mask=block_mask,
        scale=call.scale,
        enable_gqa=bool(q.shape[1] != k.shape[1]),
        kernel_options=_kernel_options(call) or None,
        return_aux=torch_flex.AuxRequest(lse=True) if with_lse else None,
    )
    out, lse = (result[0], result[1].lse) if with_lse else (result, None)
    masking = any(x is not None for x in (block_mask, hidden, call.score_mod, masks.bias()))
    if masking and lse is not None:  # a row with no key is 0, whatever the kernel read
        out = out.masked_fill((lse == -_INF)[..., None], 0.0)
    if lse is not None and not traced() and base.wants_grad(*call.tensors(), *call.mod_tensors):
        template = call._replace(sinks=None).with_tensors(*[None] * 6)  # tensors saved apart
        out, lse = _TwiceDifferentiable.apply(
            out, lse, template, *call.tensors(), *call.mod_tensors
        )
    if call.sinks is not None:
        return join_sinks(AttentionOutput(out, lse), call.sinks, call.return_lse)
    return AttentionOutput(out, lse if call.return_lse else None)


class _TwiceDifferentiable(torch.autograd.Function):
    """The identity on FlexAttention's output and lse. A plain backward passes their gradients on
    to torch's backward; one with ``create_graph=True`` returns, for q, k, v, the slopes and the
    tensors a ``score_mod`` reads, the gradients of the reference backend's recomputation, which
    autograd can differentiate again (at the reference's ``O(t s)`` memory for that call)."""

    @staticmethod
    def forward(ctx, out, lse, template: Call, q, k, v, slopes, attn_mask, key_mask, *mods):
        ctx.save_for_backward(q, k, v, slopes, attn_mask, key_mask, *mods)
        ctx.template = template
        ctx.set_materialize_grads(False)
        return out.view_as(out), lse.view_as(lse)

    @staticmethod
    def backward(ctx, dout, dlse):
        n = len(ctx.needs_input_grad) - 3
        if not torch.is_grad_enabled():  # a first-order backward: torch's own
            return dout, dlse, *[None] * (n + 1)
        q, k, v, slopes, attn_mask, key_mask, *mods = ctx.saved_tensors
        call = ctx.template.with_tensors(q, k, v, slopes, attn_mask, key_mask, tuple(mods))
        wanted = (*ctx.needs_input_grad[3:7], False, *ctx.needs_input_grad[9:])
        grads = differentiable_grads(call, dout, dlse, wanted)
        return None, None, None, *grads[:4], None, None, *grads[5:]


class FlexBackend(Backend):
    """torch's compiled FlexAttention: a fused forward and backward for what SDPA cannot do."""

    name = "flex"
    supports = frozenset(
        {"causal", "window", "attn_mask", "key_mask", "alibi_slopes", "softcap", "return_lse"}
        | {"score_mod", "block_mask", "shift", "sinks"}
    )
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
        if base.forward_ad_active():
            return "forward-mode AD (torch.func.jvp, jacfwd, forward_ad): FlexAttention has no jvp rule"
        if torch._C._are_functorch_transforms_active():
            return (
                "under a torch.func transform (vmap, grad, jacrev): torch.compile runs outside them"
            )
        user = call.block_mask
        if (
            user is not None
            and _grid(user) != tuple(user.BLOCK_SIZE)
            and (traced() or _grid(user) is None)
        ):
            return (
                f"a block_mask of BLOCK_SIZE {tuple(user.BLOCK_SIZE)}: torch's kernels take blocks "
                f"that are multiples of {BLOCK}; blocks that divide {BLOCK} are regridded, but not "
                "inside torch.compile"
            )
        from torch.utils._triton import has_triton  # cached by torch

        if q.device.type == "cuda" and not has_triton():
            return "without Triton, whose kernels torch's FlexAttention compiles on CUDA"
        return None

    def faster_than(self, other: Backend, call: Call) -> str | None:
        """Over SDPA, on CUDA only, where SDPA would be given a dense mask: from
        [`OVER_SDPA_SCORES`][attnkit.backends.flex.OVER_SDPA_SCORES] scores, or where the tiled
        backend's own rule would take the call (its PyTorch loop, on CUDA, is slower than this
        compiled kernel)."""
        if other.name != "sdpa" or call.q.device.type != "cuda":
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

    def path(self, call: Call) -> Path:
        return Path("compiled")

    def memory(self, call: Call) -> tuple[int, str]:
        b, h, t, _ = call.q.shape
        s = call.k.shape[2]
        total, what = base.result_bytes(call), "the results"
        if call.masks.key_mask is not None:
            total += (call.k.numel() + call.v.numel()) * call.k.element_size()
            what += " and k and v with their padding zeroed"
        if call.masks.window is not None or call.block_mask is not None:
            heads = 1 if call.block_mask is None else b * h
            total += 16 * heads * -(-t // BLOCK) * -(-s // BLOCK)  # 4 int32 tables
            what += " and the block tables"
        return total, what

    def run(self, call: Call) -> AttentionOutput:
        return flex(call)


BACKEND = FlexBackend()
