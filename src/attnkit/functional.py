"""``attention(q, k, v, ...)``: the one entry point that every attnkit module calls.

It checks the inputs once into one [`Call`][attnkit.call.Call] (the tensors, the masks
gathered into one [`Masks`][attnkit.masks.Masks], the options), then runs the backend that
[`choose_backend`][attnkit.backends.choose_backend] picks. Semantics, with queries aligned bottom-right
(query ``i`` sits at ``p(i) = i + s - t``):

- score = ``(q . k) * scale``, ``scale = 1 / sqrt(d)`` by default;
- ``softcap``: score = ``softcap * tanh(score / softcap)``;
- ``alibi_slopes`` ``(h,)``: score += ``-slope * |p(i) - j|``;
- ``sinks`` ``(h,)``: a logit per query head joins every query's softmax denominator and brings
  no value (GPT-OSS's learned sinks): the weights of a row sum to ``1 - p_sink``;
- ``attn_mask``: bool (True = may attend) or float (added to the score; masked where -inf);
  ``key_mask`` ``(b, s)``: True = real token;
- ``causal``: key ``j`` allowed iff ``j <= p(i)``; ``window=(left, right)`` (-1 unbounded):
  ``p(i) - left <= j <= p(i) + right``;
- ``indices`` ``(b, t, n)`` or ``(b, h_kv, t, n)``: query ``i`` attends to the keys it names
  alone (top-k sparse attention), intersected with the masks above;
- a query with no allowed key gets output 0, lse ``-inf`` and zero gradients;
- non-finite values: a query selects the keys it may see; a score made NaN or infinite by q, k,
  v, a float mask or the slopes is NaN (never a mask) and spreads to what it touches; padding
  (``key_mask`` False) never reaches a result on any backend, keys hidden by the other masks never
  in attnkit's own kernels (``reference``, ``tiled``, ``decode``).

Every returned tensor carries gradients to every input that needs one, also twice
(``create_graph=True``); [`which_backend`][attnkit.functional.which_backend] says which backend and path a call runs, and why.

Shapes: ``b`` batch, ``h`` query heads, ``h_kv`` key/value heads, ``t`` query length, ``s`` key
length, ``d`` head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from attnkit import _checks, mods
from attnkit._tracing import traced
from attnkit.backends import BackendChoice, choose_backend, run
from attnkit.block_mask import create_block_mask, window_of
from attnkit.call import DEFAULT_OPTIONS, TENSOR_KEYWORDS, AttentionOutput, Call, Options, call_of
from attnkit.masks import Masks, both_windows, merge_window
from attnkit.mods import MaskMod, ScoreMod
from attnkit.rules.nonfinite import can_branch_on_data
from attnkit.rules.sinks import join as join_sinks


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None = None,
    key_mask: Tensor | None = None,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    return_weights: bool | str = False,
    score_mod: ScoreMod | None = None,
    block_mask: BlockMask | None = None,
    mask_mod: MaskMod | None = None,
    nonfinite_keys: Tensor | None = None,
    indices: Tensor | None = None,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, ...]:
    """Scaled dot-product attention with every mask and score modifier, on any backend.

    Args:
        q: ``(b, h, t, d)`` queries.
        k: ``(b, h_kv, s, d)`` keys; ``h % h_kv == 0`` and query head ``i`` uses key/value head
            ``i // (h // h_kv)`` (grouped-query attention; ``h_kv = 1`` is multi-query).
        v: ``(b, h_kv, s, d_v)`` values.
        attn_mask: bool (True = may attend) or float of q's dtype (added to the scores),
            broadcastable to ``(b, h, t, s)``.
        key_mask: ``(b, s)`` bool, True for a real token, False for padding.
        causal: key ``j`` is visible to query ``i`` iff ``j <= i + s - t`` (bottom-right aligned).
        window: ``(left, right)`` positions around ``p(i)`` that a query sees; -1 is unbounded.
        alibi_slopes: ``(h,)`` ALiBi slopes (see [`attnkit.alibi_slopes`][attnkit.masks.alibi_slopes]).
        sinks: ``(h,)`` learned logits, one per query head (any float dtype): each joins the
            softmax denominator of every query of its head as an extra score that brings no value
            (GPT-OSS). It is not scaled, capped, ALiBi'd or given to a mod; the returned weights
            leave it out (a row sums to ``1 - p_sink``), the lse takes it in; a query with no
            visible key still gets 0. Gradients reach it.
        softcap: caps scores smoothly to ``(-softcap, softcap)`` (Gemma 2).
        scale: multiplies ``q . k``; defaults to ``1 / sqrt(d)``.
        dropout_p: dropout probability on the weights, applied whenever > 0 (pass 0 in eval).
        return_lse: also return the log-sum-exp of the (modified, masked) scores, ``(b, h, t)``,
            float32 (float64 for float64 inputs), ``-inf`` for a query with no key.
        return_weights: also return the softmax weights, ``(b, h, t, s)``, q's dtype: before
            dropout, or with ``"dropped"`` after it (the weights the values were multiplied by,
            as torch's ``nn.MultiheadAttention`` and Hugging Face's eager attention return them).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, torch FlexAttention's
            signature, with ``q_idx`` in ``0..t-1`` and ``kv_idx`` in ``0..s-1``: changes each
            score after ``scale``, ``softcap`` and ALiBi, before the masks; ``-inf`` masks the key.
            Gradients reach the tensors it reads (see [`attnkit.mods`][attnkit.mods]).
        block_mask: a torch ``BlockMask`` for ``(t, s)`` (from
            [`create_block_mask`][attnkit.block_mask.create_block_mask] or torch's): keys outside
            its blocks are masked, its ``mask_mod`` decides inside its partial blocks.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool``, a shorthand for
            ``block_mask=create_block_mask(mask_mod, b, h, t, s)``.
        nonfinite_keys: ``(b, h_kv, s)`` bool, True where a row of ``k`` holds a NaN or an
            infinity, when the caller knows it already
            ([`KVCache.nonfinite_keys`][attnkit.cache.KVCache.nonfinite_keys]): a backend that
            would read ``k`` to find them takes it instead (SDPA, which on a GPU would read a whole
            cache each decoding step). It must be right: attnkit trusts it (and leaves it out
            where autocast casts ``k``).
        indices: top-k sparse attention (DeepSeek's DSA): ``(b, t, n)`` int32 or int64, the ``n``
            keys each query may attend to, shared by every head (as DSA's indexer gives them), or
            ``(b, h_kv, t, n)``, one selection per key/value head; -1 marks an unused slot. Query
            ``i`` attends to these keys alone, where the other masks allow them too (a key beyond
            the causal limit is masked, as a dense mask made from the indices would be); a key
            named twice counts once. An index outside ``-1..s-1`` is an error where its values
            can be read without a synchronisation (CPU tensors, eagerly); elsewhere (CUDA,
            ``torch.compile``) it selects no key. The ``sparse`` backend gathers them, in ``O(t * n * d)``;
            the weights, when asked for, are ``(b, h, t, s)``, zero off the selection.
        backend: ``"auto"`` (the fastest backend that computes exactly this request), or a name in
            [`attnkit.backends.BACKENDS`][attnkit.backends.BACKENDS].

    Returns:
        ``out`` ``(b, h, t, d_v)``, or a tuple ``(out, lse)``, ``(out, weights)`` or
        ``(out, lse, weights)`` when those are asked for.

    Raises:
        TypeError: a tensor of the wrong dtype, or an argument of the wrong type.
        ValueError: shapes that do not fit, an option out of range, an unknown backend, or a backend
            that cannot do an option in use.

    Example:
        >>> import torch
        >>> q = torch.randn(2, 8, 5, 64); k = v = torch.randn(2, 2, 7, 64)  # GQA: 8 q heads, 2 kv
        >>> attention(q, k, v, causal=True).shape
        torch.Size([2, 8, 5, 64])
    """
    options = Options(
        causal,
        window,
        softcap,
        scale,
        dropout_p,
        return_lse,
        return_weights,
        score_mod,
        mask_mod,
        backend,
    )
    call = checked_call(
        q,
        k,
        v,
        options,
        attn_mask=attn_mask,
        key_mask=key_mask,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        block_mask=block_mask,
        nonfinite_keys=nonfinite_keys,
        indices=indices,
    )
    if 0 in (q.shape[2], k.shape[2]):  # no query, or no key: a query with no key gets 0
        out, lse, weights = _empty(call)
        if call.sinks is not None:  # the sink alone: the lse is its logit
            out, lse, weights = join_sinks(AttentionOutput(out, lse, weights), call.sinks, True)
    else:
        out, lse, weights = run(backend, call)
    if not (return_lse or return_weights):
        return out
    extras = [x for x, asked in ((lse, return_lse), (weights, return_weights)) if asked]
    return (out, *extras)


def _empty(call: Call) -> tuple[Tensor, Tensor, Tensor]:
    """The results of a call with no query or no key: output 0, lse ``-inf``, weights of no key;
    zeros computed from q, k and v (sums over nothing), so that gradients reach them, as zeros."""
    q, k, v = call.q, call.k, call.v
    b, h, t, _ = q.shape
    nothing = q[..., :0].sum(-1, keepdim=True) + (k[:, :1, :0].sum() + v[:, :1, :0].sum())
    stats = torch.promote_types(q.dtype, torch.float32)
    lse = nothing.squeeze(-1).to(stats) - float("inf")
    return nothing.expand(b, h, t, v.shape[-1]), lse, nothing.expand(b, h, t, k.shape[2])


def which_backend(q: Tensor, k: Tensor, v: Tensor, **keywords: Any) -> BackendChoice:
    """What [`attention`][attnkit.functional.attention] would run for these arguments (its
    keywords, as it takes them), without running it: the backend, the
    path inside it (its C++ kernel or its PyTorch loop), why, and its block products (float32, or
    bf16 with AVX512-BF16, ...; they depend on the CPU, see `attnkit.kernels.cpu`). The same checks run, and the same
    errors are raised, as in [`attention`][attnkit.functional.attention]; the answer depends on the tensors' dtype, device and
    ``requires_grad``, on grad mode and on transforms in effect, as the call's would.

    Returns:
        A [`BackendChoice`][attnkit.backends.BackendChoice] ``(backend, path, reason, products)``.

    Example:
        >>> import torch
        >>> q = k = v = torch.randn(1, 8, 128, 64)
        >>> which_backend(q, k, v, causal=True).backend
        'sdpa'
        >>> which_backend(q, k, v, softcap=30.0).backend  # SDPA has no soft-capping
        'tiled'
    """
    options, tensors = split_keywords(keywords, "which_backend")
    return choose_backend(options.backend, checked_call(q, k, v, options, **tensors))


def checked_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    options: Options = DEFAULT_OPTIONS,
    *,
    attn_mask: Tensor | None = None,
    key_mask: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    block_mask: BlockMask | None = None,
    nonfinite_keys: Tensor | None = None,
    indices: Tensor | None = None,
    shift: int = 0,
    **keywords: Any,
) -> Call:
    """Check the arguments of [`attention`][attnkit.functional.attention] and gather them into one
    [`Call`][attnkit.call.Call]: the only place they are checked. The options come as an
    [`Options`][attnkit.call.Options] or as ``attention``'s keywords (``keywords``, which replace
    those of ``options``). ``shift``: the queries sit that many positions right of bottom-right
    alignment ([`Masks`][attnkit.masks.Masks]); ring attention's chunks, never a user's call."""
    if keywords:
        options = _replaced(options, keywords, "checked_call")
    (
        causal,
        window,
        softcap,
        scale,
        dropout_p,
        return_lse,
        return_weights,
        score_mod,
        mask_mod,
        _,
    ) = options
    keys_as_given = k
    # Autocast's flag covers the CPU's and CUDA's; other devices are asked in _autocast.
    if not (isinstance(q, Tensor) and (q.is_cpu or q.is_cuda)) or (
        torch._C._is_any_autocast_enabled()
    ):
        q, k, v = _autocast(q, k, v)
    _checks.check_qkv(q, k, v)
    b, h, t, _ = q.shape
    s = k.shape[-2]
    if key_mask is not None:
        _checks.check_key_mask(key_mask, b, s, q.device)
    if attn_mask is not None:
        _checks.check_attn_mask(attn_mask, q.dtype, (b, h, t, s), q.device)
    if alibi_slopes is not None:
        _checks.check_alibi_slopes(alibi_slopes, h, q.device)
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be a function, got {type(score_mod).__name__}")
    if type(causal) is not bool or type(return_lse) is not bool:  # say which is not a bool
        _checks.check_flag(causal, "causal")
        _checks.check_flag(return_lse, "return_lse")
    if not (isinstance(return_weights, bool) or return_weights == "dropped"):
        raise TypeError(
            "return_weights must be a bool or 'dropped', got "
            f"{type(return_weights).__name__} {return_weights!r}"
        )
    if window is not None:
        window = _checks.check_window(window)
    # A block mask that is a window score for score (a causal one, a sliding one) runs as that
    # window: the kernels skip blocks by position and need no mask per score.
    blocks = None
    if mask_mod is not None:
        _checks.check_mask_mod(mask_mod, block_mask)
        blocks = create_block_mask(mask_mod, b, h, t, s, device=q.device)
    elif block_mask is not None:
        blocks = _checks.check_block_mask(block_mask, b, h, t, s, q.device)
    if blocks is not None and (as_window := window_of(blocks, b, h)) is not None:
        window, blocks = both_windows(window, as_window), None
    masks = Masks(merge_window(causal, window, t, s, shift), key_mask, attn_mask, shift)
    # Only the options the caller set are checked and passed on; the others keep the defaults of
    # call_of, so that a plain call spends no time on options it does not use.
    extras = {}
    if softcap is not None:
        extras["softcap"] = _checks.check_positive_number(softcap, "softcap")
    if alibi_slopes is not None:
        extras["alibi_slopes"] = alibi_slopes
    if sinks is not None:
        extras["sinks"] = _checks.check_sinks(sinks, h, q.device)
    if not (type(dropout_p) is float and dropout_p == 0.0):
        extras["dropout_p"] = _checks.check_probability(dropout_p, "dropout_p")
    if blocks is not None:
        extras["block_mask"] = blocks
    if nonfinite_keys is not None:
        _checks.check_nonfinite_keys(nonfinite_keys, (b, k.shape[1], s), k.device)
        if k is keys_as_given:  # (autocast's cast may have made a large key infinite)
            extras["nonfinite_keys"] = nonfinite_keys
    if indices is not None:
        h_kv = k.shape[1]
        # the values are read where a look costs no synchronisation (CPU tensors, eagerly)
        look = isinstance(indices, Tensor) and can_branch_on_data(indices)
        extras["indices"] = _checks.check_indices(indices, b, h_kv, t, s, q.device, look=look)
    if score_mod is not None:
        extras["score_mod"] = score_mod
        extras["mod_tensors"] = mods.tensors_to_train(score_mod, q)
        extras["mod_adds"] = _adds_to_score(score_mod, q)
    return call_of(
        q,
        k,
        v,
        masks,
        q.shape[-1] ** -0.5 if scale is None else _checks.check_positive_number(scale, "scale"),
        return_lse=return_lse,
        return_weights=return_weights,
        **extras,
    )


def split_keywords(keywords: dict[str, Any], caller: str) -> tuple[Options, dict[str, Any]]:
    """``attention``'s keywords as an [`Options`][attnkit.call.Options] and the tensors'."""
    tensors = {name: keywords.pop(name) for name in TENSOR_KEYWORDS if name in keywords}
    return _replaced(DEFAULT_OPTIONS, keywords, caller), tensors


def _replaced(options: Options, keywords: dict[str, Any], caller: str) -> Options:
    unknown = sorted(keywords.keys() - Options._fields)
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    return options._replace(**keywords)


def _autocast(q, k, v):
    """q, k and v in autocast's dtype where it is on for their device, as torch's SDPA takes
    them (a model's rotary embedding may have left q and k in float32 and v in bf16)."""
    if not isinstance(q, Tensor):  # the checks that follow name it
        return q, k, v
    # A quick look first: torch's flag covers the CPU's and CUDA's autocast, not every device's.
    if (q.is_cpu or q.is_cuda) and not torch._C._is_any_autocast_enabled():
        return q, k, v
    device = q.device.type
    # Asked only off the CPU and CUDA (meta tensors, say): dynamo (2.11) cannot trace the question.
    available = device in ("cpu", "cuda") or torch.amp.is_autocast_available(device)
    if not (available and torch.is_autocast_enabled(device)):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    return tuple(
        x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x for x in (q, k, v)
    )


def _adds_to_score(score_mod: ScoreMod, q: Tensor) -> bool:
    """Whether a mod that a CPU kernel may run adds to the score (found once per function:
    `attnkit.mods.memo`)."""
    if q.device.type != "cpu" or traced():
        return False
    return mods.adds_to_score(score_mod)
