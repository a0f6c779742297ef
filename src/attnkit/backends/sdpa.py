"""The SDPA backend: torch's fused ``scaled_dot_product_attention``.

torch's ``is_causal=True`` aligns the mask top-left, attnkit bottom-right (see [`attnkit.masks`][attnkit.masks]);
the two agree only when ``t == s``, so ``is_causal`` is used only then; a single query sees every key
(no mask); on CUDA, torch's ``causal_lower_right`` takes ``t < s`` to its fused kernels; otherwise an
explicit mask.
ALiBi becomes a float mask added to the scores. SDPA has no soft-capping and returns neither weights
nor the log-sum-exp: asking for those raises in the dispatcher. Learned sinks run on torch's flash
or cuDNN kernel, whichever SDPA would pick, which returns the log-sum-exp the sinks join through,
where no mask but the causal one applies ([`attnkit.backends.sdpa_sinks`][attnkit.backends.sdpa_sinks]).

Three things around the call keep it to attnkit's rules:

- Padding (``key_mask`` False) is zeroed in k and v first: a masked key's weight of 0 times a NaN in
  its value would still be NaN.
- torch's fused CPU kernel treats a row whose scores are all NaN or ``-inf`` as a row with no key and
  returns zeros; attnkit's rule makes a row NaN as soon as a key it sees has a non-finite score
  ([`rows_made_nan`][attnkit.backends.sdpa.rows_made_nan]).
- torch's fused kernels have no double backward. Where one ran and a gradient is wanted, the output
  passes through `_TwiceDifferentiable`: the identity, whose backward with
  ``create_graph=True`` differentiates the reference backend's recomputation instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit._tracing import traced
from attnkit.backends.base import Backend, Route, result_bytes
from attnkit.backends.sdpa_sinks import attention_with_sinks
from attnkit.backends.sdpa_sinks import refuses as refuses_sinks
from attnkit.call import AttentionOutput, Call, forward_ad_active, gradient_levels, wants_grad
from attnkit.masks import alibi_bias
from attnkit.rules.exact import differentiable_grads
from attnkit.rules.nonfinite import (
    can_branch_on_data,
    inputs_finite,
    nonfinite_rows,
    zero_or_nan_rows,
)

_NAN = float("nan")

_TORCH_SDPA = F.scaled_dot_product_attention
"""torch's own function, held from import: a model may point ``torch.nn.functional``'s name at
attnkit's drop-in, which would then call itself through this backend."""


def sdpa(call: Call) -> AttentionOutput:
    """Shapes ``q (b, h, t, d)``, ``k (b, h_kv, s, d)``, ``v (b, h_kv, s, d_v)``."""
    q, k, v = call.q, call.k, call.v
    t, s = q.shape[-2], k.shape[-2]
    masks = call.masks
    keys, values = k, v  # padding zeroed by the registry
    causal_only = masks.is_causal_only
    is_causal = causal_only and t == s and call.alibi_slopes is None
    sees_all = causal_only and t == 1  # the one query, last, sees every key
    allowed = None if is_causal or sees_all else masks.allowed(t, s, q.device)
    attn_mask = lower_right(call) if allowed is not None else None
    by_bias = attn_mask is not None  # torch's causal bias, which calls fused kernels
    if by_bias:
        allowed = None
    else:
        attn_mask = allowed
    bias = masks.bias()
    if call.alibi_slopes is not None:
        alibi = alibi_bias(call.alibi_slopes.to(q.dtype), t, s)  # (h, t, s)
        bias = alibi if bias is None else bias + alibi
    if bias is not None:
        attn_mask = bias if allowed is None else bias.masked_fill(~allowed, float("-inf"))

    empty_rows = None if allowed is None else ~allowed.any(dim=-1, keepdim=True)
    if call.sinks is not None:  # no mask but the causal one: see sdpa_sinks.refuses
        out = attention_with_sinks(call)
    else:  # first: on a GPU the checks below queue behind it
        out = _TORCH_SDPA(
            q,
            keys,
            values,
            attn_mask=attn_mask,
            dropout_p=call.dropout_p,
            is_causal=is_causal,
            scale=call.scale,
            enable_gqa=bool(q.shape[1] != k.shape[1]),  # bool: under jit.trace sizes are tensors
        )
    fused = _fused(out) or by_bias
    twice = fused and wants_grad(q, k, v, call.alibi_slopes, masks.attn_mask)
    if bias is not None or call.finite is not True:  # the registry's look at q and k
        causal = is_causal or by_bias  # a row the rule may make NaN
        out = _nan_rule(out, q, keys, allowed, causal, call)
    if empty_rows is not None:  # rows with no allowed key are 0, whatever the kernel does
        out = torch.where(empty_rows, 0.0, out)
    if twice:  # torch's fused kernel made it, whose backward cannot run twice
        template = call.with_tensors(*[None] * 6)  # its tensors are saved apart
        out = _TwiceDifferentiable.apply(out, *call.tensors(), template)
    return AttentionOutput(out)


def _nan_rule(
    out: Tensor, q: Tensor, k: Tensor, allowed: Tensor | None, causal: bool, call: Call
) -> Tensor:
    """``out`` with NaN in the rows attnkit's rule makes NaN (see
    [`rows_made_nan`][attnkit.backends.sdpa.rows_made_nan]), in place where no gradient is
    recorded, else by a ``where``."""
    with torch.no_grad():  # which rows attnkit's rules overwrite (no gradient flows there)
        bias, slopes, known = call.masks.bias(), call.alibi_slopes, call.nonfinite_keys
        nan_rows = rows_made_nan(q, k, allowed, causal, bias, slopes, known)
    if can_branch_on_data(nan_rows) and not bool(nan_rows.any()):
        return out
    if out.requires_grad:  # one pass each way, where masked_fill copies first and fills again
        return torch.where(nan_rows, _NAN, out)
    return out.masked_fill_(nan_rows, _NAN)  # in place: no copy


def lower_right(call: Call) -> object | None:
    """Bottom-right causal alignment for ``t < s`` as torch's ``causal_lower_right`` (a
    ``CausalBias``), which its fused CUDA kernels apply without a dense mask; None where a dense
    mask is needed: on a CPU (whose fused kernel aligns top-left only), with other masks or ALiBi,
    or with GQA (torch's dispatch of the bias does not pass GQA on to its kernels). Its module is
    imported here, where a GPU call needs it: importing it imports TorchDynamo, which would double
    the time ``import attnkit`` takes."""
    q, k = call.q, call.k
    t, s = q.shape[-2], k.shape[-2]
    if not (call.masks.is_causal_only and t < s and q.is_cuda and call.alibi_slopes is None):
        return None
    if q.shape[1] != k.shape[1]:
        return None
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(t, s)


def nans_seen(q: Tensor, k: Tensor, causal: bool, nonfinite_keys: Tensor | None = None) -> Tensor:
    """``(b, h, t, 1)``: 0, or NaN for a row whose query is not finite or that sees a key that is
    not, where each query sees every key or, with ``causal`` (and ``t <= s``), the keys up to its
    own position (bottom-right). attnkit's rule with no look at the data: the path on a GPU and
    under ``torch.compile``, where one read of q and one of k (none where ``nonfinite_keys``
    records k's rows) are followed by operations on ``(b, h, t)`` values only (a sum of zeros and
    NaNs is exact)."""
    b, h, t, _ = q.shape
    h_kv, s = k.shape[1], k.shape[2]
    known = nonfinite_keys
    keys = zero_or_nan_rows(k) if known is None else torch.where(known, _NAN, 0.0)  # (b, h_kv, s)
    seen = keys.cumsum(dim=-1)[..., s - t :] if causal else keys.sum(dim=-1, keepdim=True)
    own = zero_or_nan_rows(q).reshape(b, h_kv, h // h_kv, t)  # query head i uses kv head i // g
    return (own + seen[:, :, None]).reshape(b, h, t, 1)


def rows_made_nan(
    q: Tensor,
    k: Tensor,
    allowed: Tensor | None,
    is_causal: bool,
    bias: Tensor | None,
    slopes: Tensor | None,
    nonfinite_keys: Tensor | None = None,
) -> Tensor:
    """``(b, h, t, 1)`` True for the rows that see a key whose score is not finite: a NaN or infinite
    query row, or key row (where ``nonfinite_keys`` ``(b, h_kv, s)`` says, if given), a NaN or
    +inf entry of the float mask ``bias``, or a non-finite ALiBi
    slope (whose ``-inf`` terms SDPA would take for a mask). attnkit makes those rows NaN; SDPA's
    fused CPU kernel returns zeros for a row whose every score is NaN or ``-inf``, and drops a key
    whose score is ``-inf``. (Values need nothing: SDPA multiplies them, so they spread.)

    One pass over q and k and, with a dense mask, over the mask: ``O((t + s) d + t s)`` next to the
    kernel's ``O(t s d)``; without one, the rows that see a bad key come from
    [`nans_seen`][attnkit.backends.sdpa.nans_seen], on ``(b, h, t)`` values only. Branches on data only where Python may (see
    [`can_branch_on_data`][attnkit.rules.nonfinite.can_branch_on_data]), so ``torch.compile`` and ``vmap`` stay
    whole."""
    h, h_kv = q.shape[1], k.shape[1]
    known = nonfinite_keys
    if allowed is None and inputs_finite(keys=k, nonfinite_keys=known):  # the usual case: no key
        bad = nonfinite_rows(q)[..., None]  # to see, only q's rows
    elif allowed is None:  # every key, or the causal ones: no look at the data needed
        bad = torch.isnan(nans_seen(q, k, is_causal, known))
    else:
        bad_q = nonfinite_rows(q)[..., None]  # (b, h, t, 1)
        bad_k = nonfinite_rows(k) if known is None else known  # (b, h_kv, s)
        if can_branch_on_data(bad_k) and not bool(bad_k.any()):
            bad = bad_q  # no key to see: the passes below would find nothing
        else:  # (.., t, s) x (b, h, s, 1): the number of bad keys a row sees
            b, s = bad_k.shape[0], bad_k.shape[-1]  # (b, h, s): query head i uses kv head i // g
            bad_k = bad_k[:, :, None].expand(b, h_kv, h // h_kv, s).reshape(b, h, s)
            bad = bad_q | (allowed.to(q.dtype) @ bad_k[..., None].to(q.dtype) > 0)
    if bias is not None:  # NaN or +inf added to a score a row sees (-inf masks)
        bad_bias = torch.isnan(bias) | torch.isposinf(bias)
        if allowed is not None:
            bad_bias = bad_bias & allowed
        bad = bad | bad_bias.any(dim=-1, keepdim=True)
    if slopes is not None:
        bad = bad | ~torch.isfinite(slopes)[:, None, None]  # (h, 1, 1)
    return bad


def _fused(out: Tensor) -> bool:
    """Whether one of torch's fused kernels made ``out`` (they have no double backward), rather than
    the composite one of ordinary operations (which torch's CPU dispatch picks for dropout or a mask
    that needs a gradient). Not under a transform, tracing or compilation, which differentiate
    SDPA themselves."""
    if torch.jit.is_tracing() or traced():  # first: dynamo cannot read a traced tensor's grad_fn
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    node = out.grad_fn
    return node is not None and type(node).__name__.startswith("ScaledDotProduct")


class _TwiceDifferentiable(torch.autograd.Function):
    """The identity on SDPA's output. A plain backward passes the gradient on to torch's fused
    backward; a backward with ``create_graph=True`` returns, for q, k, v and the slopes, the
    gradients of the reference backend's recomputation, which autograd can differentiate again (at
    the reference's ``O(t s)`` memory for that call)."""

    @staticmethod
    def forward(ctx, out, q, k, v, alibi_slopes, attn_mask, key_mask, template: Call):
        ctx.save_for_backward(q, k, v, alibi_slopes, attn_mask, key_mask)
        ctx.template = template
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        if not torch.is_grad_enabled():  # a first-order backward: torch's own kernel
            return dout, None, None, None, None, None, None, None
        if ctx.template.dropout_p > 0:
            raise ValueError(
                "backend 'sdpa' cannot differentiate twice through dropout: torch's fused kernel "
                "drew a dropout mask that a recomputation cannot repeat; use dropout_p=0, or "
                "backend='reference', for a backward with create_graph=True"
            )
        call = ctx.template.with_tensors(*ctx.saved_tensors)
        wanted = ctx.needs_input_grad[1:6]  # q, k, v, the slopes, a float mask
        grads = differentiable_grads(call, dout, None, wanted)
        return None, *grads, None, None


class SdpaBackend(Backend):
    """torch's ``scaled_dot_product_attention``: the fastest where it computes the call."""

    name = "sdpa"
    supports = frozenset(
        {"causal", "window", "attn_mask", "key_mask", "alibi_slopes", "dropout_p", "attn_mask_grad"}
        | {"sinks"}
    )
    looks_at_values = True  # its fused CPU kernel takes a row of NaN scores for an empty row

    def refuses(self, call: Call) -> str | None:
        if call.sinks is not None:
            if traced() or torch.jit.is_tracing() or torch._C._are_functorch_transforms_active():
                return (
                    "sinks while compiling, tracing or under a torch.func transform: they join "
                    "in an autograd function around torch's private fused kernels"
                )
            reason = refuses_sinks(call)
            if reason is not None:
                return reason
        if forward_ad_active():
            return "forward-mode AD (torch.func.jvp, jacfwd, forward_ad): torch's fused kernels have no jvp rule"
        if (
            torch._C._are_functorch_transforms_active()
            and gradient_levels(call.q, call.k, call.v, call.alibi_slopes) >= 2
        ):
            return (
                "nested torch.func gradients (grad of grad, or autograd around torch.func.grad): "
                "torch's fused kernels have no double backward"
            )
        return None

    def path(self, call: Call) -> Route:
        return Route("torch")

    def memory(self, call: Call) -> tuple[int, str]:
        b, h, t, _ = call.q.shape
        s = call.k.shape[2]
        masks = call.masks
        what, total = "the results", result_bytes(call)
        if not (masks.is_causal_only and t == s) and (masks.window, masks.key_mask) != (None, None):
            total += (b if masks.key_mask is not None else 1) * t * s  # a dense bool mask
            what += " and a dense mask"
        if call.alibi_slopes is not None or masks.bias() is not None:
            total += b * h * t * s * call.q.element_size()
            what += " and a dense float mask"
        if call.dropout_p > 0 or "attn_mask_grad" in call.options:  # torch's math path
            total += 3 * b * h * t * s * call.q.element_size()
            what += " and the scores, weights and dropout mask of torch's math path"
        return total, what

    def run(self, call: Call) -> AttentionOutput:
        return sdpa(call)


BACKEND = SdpaBackend()
