"""[`ring_attention`][attnkit.distributed.ring_attention]: its checks, the ranks' agreement, and
the plan of one call (which pieces of queries and keys meet, and the call each pair makes)."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from attnkit import _checks, functional, mods
from attnkit.backends import choose_backend
from attnkit.call import AttentionOutput
from attnkit.distributed import passes
from attnkit.distributed.layout import LAYOUTS, chunks
from attnkit.distributed.plan import RingPlan, piece_sizes
from attnkit.distributed.transport import DEFAULT_TIMEOUT, Ring
from attnkit.rules.sinks import join as join_sinks


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    layout: str = "contiguous",
    key_mask: Tensor | None = None,
    window: tuple[int, int] | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    score_mod: mods.ScoreMod | None = None,
    return_lse: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    block_mask: BlockMask | None = None,
    mask_mod: mods.MaskMod | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """[`attention`][attnkit.functional.attention] over a sequence whose queries, keys and values
    are split along it over the ranks of ``group``: each rank passes its shard and gets its
    shard of the output (and of the lse). Every rank must call it, with shards of the same shape.
    It computes in the inputs' dtype, under autocast too. With one rank it is ``attention`` of
    the shard, the whole sequence (which, unlike a ring of several, takes a second derivative).

    Args:
        q: this rank's queries ``(b, h, t / P, d)``.
        k: this rank's keys ``(b, h_kv, s / P, d)`` (``h_kv`` divides ``h``: GQA, MQA).
        v: this rank's values ``(b, h_kv, s / P, d_v)``.
        group: the process group (the default group if None).
        causal: key ``j`` visible to query ``i`` iff ``j <= i + s - t``, in global positions.
        layout: how the sequence was cut, ``"contiguous"`` or ``"zigzag"`` (see
            [`shard`][attnkit.distributed.shard]); ``"zigzag"`` balances causal work.
        key_mask: this rank's part ``(b, s / P)`` of the key padding mask, True for a real token.
        window: ``(left, right)`` around each query's global position; -1 unbounded.
        alibi_slopes: ``(h,)``; the distances are global. Its gradient, like any tensor every rank
            holds a copy of, is this rank's part: sum it over the group (as DDP does).
        sinks: ``(h,)`` learned sink logits, as in [`attention`][attnkit.functional.attention],
            joined once to each row after the ring; their gradient is this rank's part.
        softcap: scores become ``softcap * tanh(score / softcap)``.
        scale: multiplies ``q . k``; ``1 / sqrt(d)`` by default.
        score_mod: as in [`attention`][attnkit.functional.attention], with global ``q_idx`` and
            ``kv_idx``; the gradients of the tensors it reads are this rank's part, as the
            slopes'.
        return_lse: also return this rank's lse ``(b, h, t / P)``, with gradients through it.
        timeout: seconds to wait for a peer before raising
            [`RingError`][attnkit.distributed.RingError].
        attn_mask: refused: a dense mask of the whole sequence is what ring attention avoids.
        dropout_p: refused (0 only).
        return_weights: refused: the weights are ``t x s``.
        block_mask: refused: its tables are for the whole sequence; pass its ``mask_mod``.
        mask_mod: as in [`attention`][attnkit.functional.attention], with global ``q_idx`` and
            ``kv_idx``; evaluated on each pair of pieces as they meet.

    Returns:
        This rank's output ``(b, h, t / P, d_v)``, or ``(out, lse)`` with ``return_lse``.

    Raises:
        ValueError: a refused option; shards whose shapes differ between ranks (on every rank);
            a length that does not fit the layout; no process group, or not a member of it.
        RingError: a peer died or did not answer within ``timeout`` seconds.
    """
    for name, given in (
        ("attn_mask", attn_mask is not None),
        ("dropout_p", dropout_p != 0.0),
        ("return_weights", return_weights),
        ("block_mask", block_mask is not None),
    ):
        if given:
            raise ValueError(f"ring_attention does not take {name}: {_REFUSED[name]}")
    ring = Ring.of(group, timeout)
    options = {
        "key_mask": key_mask,
        "causal": causal,
        "window": window,
        "alibi_slopes": alibi_slopes,
        "softcap": softcap,
        "scale": scale,
        "score_mod": score_mod,
        "mask_mod": mask_mod,
    }
    shard_call = functional.checked_call(q, k, v, **options)  # this shard's own checks
    if sinks is not None:
        _checks.check_sinks(sinks, q.shape[1], q.device)
    t, s = _agree(
        ring,
        q,
        k,
        v,
        layout,
        causal=causal,
        key_mask=key_mask is not None,
        window=window,
        alibi_slopes=None if alibi_slopes is None else alibi_slopes.tolist(),
        sinks=None if sinks is None else sinks.tolist(),
        softcap=softcap,
        scale=scale,
        score_mod=mods.name_of(score_mod) if score_mod is not None else None,
        mask_mod=mods.name_of(mask_mod) if mask_mod is not None else None,
        key_piece=piece_sizes()[0],  # the pieces that travel: the same sizes everywhere
    )
    if ring.size == 1:  # the shard is the whole sequence: attention of it, in the inputs' dtype
        with torch.autocast(q.device.type, enabled=False):
            return functional.attention(
                q, k, v, return_lse=return_lse, sinks=sinks, backend="tiled", **options
            )
    plan = RingPlan.of(ring, t, s, layout, shard_call, causal, window, mask_mod)
    piece = plan.k_pieces[ring.rank][0]  # any pair: the tiled kernel's refusals
    qc, kc = plan.q_pieces[0], piece.parts[0]
    rows = (slice(None), slice(None), qc.rows)
    k_first, v_first = (x.narrow(2, piece.homes[0], kc.length) for x in (k, v))
    first = plan.pair(q[rows], k_first, v_first, None, alibi_slopes, (), qc, kc)
    choose_backend("tiled", first)  # raises if it cannot, saying why
    mod_tensors = shard_call.mod_tensors
    function = passes.RingAttentionWithMods if mod_tensors else passes.RingAttention
    out, lse = function.apply(q, k, v, alibi_slopes, key_mask, plan, *mod_tensors)
    if sinks is not None:  # once, after the ring: one more piece of every row, with output 0
        out, lse, _ = join_sinks(AttentionOutput(out, lse), sinks, True)
    return (out, lse) if return_lse else out


_REFUSED = {
    "attn_mask": "a dense (t, s) mask of the whole sequence is what ring attention avoids; use "
    "causal, window, key_mask or score_mod",
    "dropout_p": "dropout on the weights is not supported across the ring (pass 0.0)",
    "return_weights": "the weights are t x s, which no rank holds",
    "block_mask": "a BlockMask's tables are for the whole sequence; pass its mask_mod instead",
}


_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _agree(ring: Ring, q, k, v, layout: str, **options) -> tuple[int, int]:
    """Check that every rank holds shards of one shape, dtype and device and asked for the same
    options; return the global query and key lengths. The ranks compare what each holds, so all
    of them raise the same error."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    t = q.shape[2]
    described = {
        "q": tuple(q.shape),
        "k": tuple(k.shape),
        "v": tuple(v.shape),
        "dtype": str(q.dtype).removeprefix("torch."),
        "device": q.device.type,
        "layout": layout,
        **options,
    }
    mine = [float(x) for x in (*q.shape, *k.shape, *v.shape)]
    mine += [_DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1, q.is_cuda, LAYOUTS.index(layout)]
    mine += [zlib.crc32(repr(value).encode()) for value in options.values()]  # one number each
    everyone = ring.all_gather(torch.tensor(mine, dtype=torch.float64, device=q.device), "shards")
    if any(not torch.equal(x, everyone[0]) for x in everyone):
        raise ValueError(
            f"ring_attention: the ranks' shards or options differ (rank {ring.rank} has "
            f"{described}); every rank must pass shards of one shape, dtype and device, and the "
            "same options"
        )
    t_all, s_all = t * ring.size, k.shape[2] * ring.size
    chunks(t_all, ring.size, layout), chunks(s_all, ring.size, layout)  # raise if they do not fit
    return t_all, s_all
