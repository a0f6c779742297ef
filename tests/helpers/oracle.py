"""An independent float64 oracle for attention, written for the tests only.

It shares no code with attnkit: masks are built from explicit position comparisons, the softmax is
torch's own, and empty rows are handled by zeroing, so a bug in attnkit's masks or softmax cannot
hide behind the same bug here. Run it in a low precision to get the "naive path" error baseline.
It runs on the inputs' device (the masks it builds are moved there), so that a test on a GPU
compares with the oracle there.
"""

from __future__ import annotations

import torch
from torch import Tensor


def allowed_positions(
    t: int, s: int, causal: bool, window: tuple[int, int] | None, device=None
) -> Tensor:
    """(t, s) bool from the definition: p(i) = i + s - t, causal j <= p(i), window bounds; built on
    the CPU, then moved to ``device`` if one is given."""
    allowed = torch.ones(t, s, dtype=torch.bool)
    for i in range(t):
        p = i + s - t
        for j in range(s):
            if causal and j > p:
                allowed[i, j] = False
            if window is not None:
                left, right = window
                if left >= 0 and j < p - left:
                    allowed[i, j] = False
                if right >= 0 and j > p + right:
                    allowed[i, j] = False
    return allowed if device is None else allowed.to(device)


def naive_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None = None,
    key_mask: Tensor | None = None,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    alibi_slopes: Tensor | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (out, lse, weights) in the inputs' dtype, on their device; q (b, h, t, d), k/v
    (b, h_kv, s, d). ``sinks`` (h,): a logit per head, one more column of every row's softmax,
    dropped after it."""
    b, h, t, d = q.shape
    s = k.shape[-2]
    device = q.device
    kv_head = torch.arange(h, device=device) // (h // k.shape[1])
    k, v = k[:, kv_head], v[:, kv_head]
    scale = d**-0.5 if scale is None else scale
    scores = torch.einsum("bhtd,bhsd->bhts", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        pos = torch.arange(t, device=device)[:, None] + s - t
        dist = (pos - torch.arange(s, device=device)[None, :]).abs().to(q.dtype)
        scores = scores - alibi_slopes.to(q.dtype)[:, None, None] * dist
    allowed = allowed_positions(t, s, causal, window, device).expand(b, h, t, s).clone()
    if key_mask is not None:
        allowed &= key_mask[:, None, None, :]
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed &= attn_mask
        else:
            scores = scores + attn_mask
            allowed &= attn_mask > float("-inf")
    if sinks is not None:  # the sink column is always there: no row is empty
        column = sinks.to(q.dtype)[None, :, None, None].expand(b, h, t, 1)
        with_sink = torch.cat([scores.masked_fill(~allowed, float("-inf")), column], dim=-1)
        weights = torch.softmax(with_sink, dim=-1)[..., :-1]
        lse = torch.logsumexp(with_sink, dim=-1)
        return torch.einsum("bhts,bhsd->bhtd", weights, v), lse, weights
    has_key = allowed.any(-1, keepdim=True)
    # Empty rows: softmax over zeros (finite), then zeroed, so gradients stay finite.
    filled = scores.masked_fill(~allowed, float("-inf")).masked_fill(~has_key, 0.0)
    weights = torch.softmax(filled, dim=-1) * has_key
    lse = torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    out = torch.einsum("bhts,bhsd->bhtd", weights, v)
    return out, lse, weights


def projected_attention_reference(
    params: dict[str, Tensor], x: Tensor, memory: Tensor, h: int, h_kv: int, **options
) -> tuple[Tensor, Tensor]:
    """A multi-head module's forward from its parameters (``dict(module.named_parameters())``,
    e.g. float64 copies): returns (output, per-head weights).

    Works for attnkit's MultiHeadAttention and CrossAttention (W_query, W_key, W_value, out_proj).
    """

    def linear(name, inp):
        out = inp @ params[f"{name}.weight"].T
        bias = params.get(f"{name}.bias")
        return out if bias is None else out + bias

    b, t, _ = x.shape
    s = memory.shape[1]
    q = linear("W_query", x).view(b, t, h, -1).transpose(1, 2)
    k = linear("W_key", memory).view(b, s, h_kv, -1).transpose(1, 2)
    v = linear("W_value", memory).view(b, s, h_kv, -1).transpose(1, 2)
    out, _, weights = naive_attention(q, k, v, **options)
    merged = out.transpose(1, 2).reshape(b, t, -1)
    return linear("out_proj", merged), weights


def selected_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None = None,
    key_mask: Tensor | None = None,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    alibi_slopes: Tensor | None = None,
    softcap: float | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """attnkit's rule for non-finite values, from its definition, one query row at a time, in
    float64: a row *selects* the keys it may see (a key it may not see never enters its arithmetic);
    a score made infinite or NaN by the inputs is NaN (never a mask); a NaN or +inf in a float mask
    or a slope acts as a NaN score; a row with no key gives output 0, lse -inf and weights 0.

    Returns (out, lse, weights) in float64, on q's device (computed on the CPU). Tiny shapes
    only: it loops over every row."""
    device = q.device
    q, k, v = (x.detach().cpu().double() for x in (q, k, v))
    key_mask, attn_mask, alibi_slopes = (
        None if x is None else x.detach().cpu() for x in (key_mask, attn_mask, alibi_slopes)
    )
    b, h, t, d = q.shape
    s, d_v = k.shape[-2], v.shape[-1]
    groups = h // k.shape[1]
    scale = d**-0.5 if scale is None else scale
    sees = allowed_positions(t, s, causal, window).expand(b, h, t, s).clone()
    if key_mask is not None:
        sees &= key_mask[:, None, None, :]
    bias = None
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        sees &= attn_mask
    elif attn_mask is not None:
        bias = attn_mask.double().expand(b, h, t, s)
        sees &= bias != float("-inf")
    out = torch.zeros(b, h, t, d_v, dtype=torch.float64)
    lse = torch.full((b, h, t), float("-inf"), dtype=torch.float64)
    weights = torch.zeros(b, h, t, s, dtype=torch.float64)
    nan = float("nan")
    for bi in range(b):
        for hi in range(h):
            for i in range(t):
                keys = sees[bi, hi, i].nonzero().flatten()  # the selection
                if keys.numel() == 0:
                    continue
                scores = k[bi, hi // groups, keys] @ q[bi, hi, i] * scale
                scores = scores.where(torch.isfinite(scores), nan)
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                if alibi_slopes is not None:
                    distance = (i + s - t - keys).abs().double()
                    scores = scores - alibi_slopes.double()[hi] * distance
                if bias is not None:
                    scores = scores + bias[bi, hi, i, keys]
                scores = scores.where(torch.isfinite(scores), nan)
                w = torch.softmax(scores, dim=0)  # NaN everywhere if any score is NaN
                out[bi, hi, i] = w @ v[bi, hi // groups, keys]
                lse[bi, hi, i] = torch.logsumexp(scores, dim=0)
                weights[bi, hi, i, keys] = w
    return out.to(device), lse.to(device), weights.to(device)


def selection_of(indices, h, s):
    """(b, h, t, s) bool from the definition: True at each key a query's indices name."""
    if indices.dim() == 3:
        indices = indices[:, None]
    b, given, t, _ = indices.shape
    mask = torch.zeros(b, h, t, s, dtype=torch.bool)
    for bi in range(b):
        for head in range(h):
            for i in range(t):
                for j in indices[bi, head * given // h, i].tolist():
                    if j >= 0:
                        mask[bi, head, i, j] = True
    return mask


def max_error(x: Tensor, reference: Tensor) -> float:
    """The largest absolute difference from ``reference``, in float64."""
    return (x.detach().double() - reference.detach().double()).abs().max().item()


def assert_within_the_naive_error(outputs, leaves) -> None:
    """The bound for half precision: the tested output's error against the float64 one at most
    twice the naive path's in the same precision, and each gradient's (for one random cotangent)
    at most three times. ``outputs`` and ``leaves``: (tested, naive, float64) each, the leaves
    those the gradients are taken for."""
    out, naive_out, exact_out = outputs
    assert max_error(out, exact_out) <= 2 * max_error(naive_out, exact_out) + 1e-6
    dout = torch.randn_like(out)
    grads = [torch.autograd.grad(o, x, dout.to(o.dtype)) for o, x in zip(outputs, leaves)]
    for got, naive, exact in zip(*grads):
        assert max_error(got, exact) <= 3 * max_error(naive, exact) + 1e-6
