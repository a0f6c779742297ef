"""attnkit.nn.functional.scaled_dot_product_attention against torch's own, on the same inputs:
outputs and every gradient, for the shapes, masks and flags torch takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit.nn.functional import scaled_dot_product_attention

SHAPES = {  # query, key/value (value's last dim may differ)
    "4-D": ((2, 3, 5, 8), (2, 3, 7, 8)),
    "4-D t = s": ((2, 3, 6, 8), (2, 3, 6, 8)),
    "4-D t > s": ((1, 2, 9, 8), (1, 2, 4, 8)),
    "3-D": ((3, 5, 8), (3, 7, 8)),
    "2-D": ((5, 8), (7, 8)),
    "5-D": ((2, 2, 3, 5, 8), (2, 2, 3, 7, 8)),
    "one query": ((2, 3, 1, 8), (2, 3, 7, 8)),
}


def inputs(shape_q, shape_k, dv=8, device="cpu"):
    q = torch.randn(shape_q, device=device, requires_grad=True)
    k = torch.randn(shape_k, device=device, requires_grad=True)
    v = torch.randn((*shape_k[:-1], dv), device=device, requires_grad=True)
    return q, k, v


def both(q, k, v, **options):
    """(attnkit's output and gradients, torch's output and gradients) on the same leaves."""
    results = []
    for fn in (scaled_dot_product_attention, F.scaled_dot_product_attention):
        leaves = [x.detach().clone().requires_grad_(x.requires_grad) for x in (q, k, v)]
        mask = options.get("attn_mask")
        extra = {}
        if mask is not None and mask.requires_grad:
            extra["attn_mask"] = mask.detach().clone().requires_grad_()
        out = fn(*leaves, **{**options, **extra})
        out.backward(torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out))
        grads = [x.grad for x in leaves] + [m.grad for m in extra.values()]
        results.append((out, grads))
    return results


def mask_of(kind, q_shape, s, device="cpu"):
    t = q_shape[-2]
    if kind == "bool (L, S)":
        mask = torch.rand(t, s, device=device) > 0.4
        mask[:, 0] = True
        return mask
    if kind == "bool with an empty row":
        mask = torch.rand(t, s, device=device) > 0.4
        mask[0] = False
        return mask
    if kind == "float (L, S)":
        return torch.randn(t, s, device=device)
    if kind == "float per batch and head":
        return torch.randn((*q_shape[:-1], s), device=device)
    if kind == "float that trains":
        return torch.randn(t, s, device=device, requires_grad=True)
    raise AssertionError(kind)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_outputs_and_gradients_equal_torchs(shape, is_causal, device):
    q, k, v = inputs(*SHAPES[shape], device=device)
    (out, grads), (want, want_grads) = both(q, k, v, is_causal=is_causal)
    torch.testing.assert_close(out, want)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize(
    "kind",
    [
        "bool (L, S)",
        "bool with an empty row",
        "float (L, S)",
        "float per batch and head",
        "float that trains",
    ],
)
@pytest.mark.parametrize("shape", ["4-D", "4-D t = s", "4-D t > s", "3-D", "5-D"])
def test_masks_as_torch_applies_them_and_never_with_is_causal(shape, kind, device):
    """A mask alone as torch's; with is_causal, refused as torch's documentation says (torch's
    math kernel refuses it too, its fused CPU kernel does not)."""
    q, k, v = inputs(*SHAPES[shape], device=device)
    mask = mask_of(kind, q.shape, k.shape[-2], device)
    (out, grads), (want, want_grads) = both(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, want)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)
    for error in (ValueError, RuntimeError):
        with pytest.raises(error, match="Explicit attn_mask should not be set when is_causal=True"):
            scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)


@pytest.mark.parametrize("enable_gqa", [True])
def test_grouped_query_attention_and_scale_and_another_value_width(enable_gqa, device):
    q = torch.randn(2, 6, 5, 8, device=device, requires_grad=True)
    k = torch.randn(2, 2, 7, 8, device=device, requires_grad=True)
    v = torch.randn(2, 2, 7, 12, device=device, requires_grad=True)
    options = {"enable_gqa": enable_gqa, "scale": 0.3, "is_causal": True}
    (out, grads), (want, want_grads) = both(q, k, v, **options)
    assert out.shape == (2, 6, 5, 12)
    torch.testing.assert_close(out, want)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


def test_dropout_draws_torchs_mask_from_the_same_seed():
    q, k, v = inputs((2, 3, 6, 8), (2, 3, 6, 8))
    torch.manual_seed(1)
    out = scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(1)
    want = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.testing.assert_close(out, want)
    assert not torch.allclose(out, F.scaled_dot_product_attention(q, k, v))


def test_bad_arguments_are_named():
    q, k, v = inputs((2, 4, 5, 8), (2, 2, 7, 8))
    with pytest.raises(ValueError, match="query has 4 heads and key 2: pass enable_gqa=True"):
        scaled_dot_product_attention(q, k, v)
    with pytest.raises(ValueError, match="batch dimensions that broadcast together"):
        scaled_dot_product_attention(q, torch.randn(3, 2, 7, 8), v, enable_gqa=True)
    with pytest.raises(ValueError, match="as many dimensions"):
        scaled_dot_product_attention(q, k[0], v[0])
    with pytest.raises(TypeError, match=r"query must be a torch\.Tensor, got list"):
        scaled_dot_product_attention([1.0], k, v)
    five = torch.randn(1, 2, 2, 5, 8)
    with pytest.raises(ValueError, match=r"does not broadcast"):
        scaled_dot_product_attention(five, five, five, attn_mask=torch.ones(3, 5, 5) > 0)


def test_dropout_statistics_over_seeds_match_torchs():
    """Over many seeds, the mean and the variance of each output value with dropout are torch's
    (whichever generator draws attnkit's mask)."""
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    mask = torch.rand(4, 4) > 0.3  # a mask: attnkit may run another kernel than torch's
    mask[:, 0] = True
    runs = {"ours": [], "torch": []}
    for seed in range(400):
        torch.manual_seed(seed)
        runs["ours"].append(scaled_dot_product_attention(q, k, v, mask, dropout_p=0.3))
        torch.manual_seed(10_000 + seed)
        runs["torch"].append(F.scaled_dot_product_attention(q, k, v, mask, dropout_p=0.3))
    ours, theirs = (torch.stack(r) for r in runs.values())
    plain = F.scaled_dot_product_attention(q, k, v, mask)
    spread = theirs.std(dim=0) / 400**0.5  # the standard error of a mean
    assert bool(((ours.mean(0) - plain).abs() <= 5 * spread + 1e-6).all())
    assert bool(((theirs.mean(0) - plain).abs() <= 5 * spread + 1e-6).all())
    ratio = ours.var(dim=0) / theirs.var(dim=0)
    assert 0.7 < ratio.median() < 1.4


@pytest.mark.parametrize(
    "options",
    [{"scale": 0.0}, {"scale": -0.7}, {"dropout_p": 1.0}, {"broadcast": True}],
    ids=["scale 0", "negative scale", "every weight dropped", "keys of batch 1"],
)
def test_what_torch_takes_beyond_attentions_own_checks(options, device):
    """torch takes any scale, a dropout of 1 (every weight 0) and batch dimensions that
    broadcast; attention() itself asks for a positive scale and a dropout below 1."""
    options = dict(options)
    batch_k = 1 if options.pop("broadcast", False) else 2
    q, k, v = inputs((2, 4, 5, 8), (batch_k, 4, 7, 8), device=device)
    (out, grads), (want, want_grads) = both(q, k, v, **options)
    torch.testing.assert_close(out, want)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


def test_torchs_name_pointed_at_the_drop_in_does_not_call_itself(monkeypatch, device):
    """A model that replaces torch.nn.functional's SDPA with attnkit's: attnkit's own SDPA
    backend still reaches torch's kernel."""
    q, k, v = inputs((2, 4, 5, 8), (2, 4, 5, 8), device=device)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    monkeypatch.setattr(F, "scaled_dot_product_attention", scaled_dot_product_attention)
    layer = torch.nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True)
    with torch.no_grad():
        layer.to(device).eval()(torch.randn(2, 5, 16, device=device))
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, is_causal=True), want)
