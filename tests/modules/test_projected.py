"""attnkit.modules.projected: what MultiHeadAttention and CrossAttention share (the checks of their
sizes, the projections' shapes, one attention call and the output projection, the checks of a
cache), so that the two agree wherever they describe the same computation."""

from __future__ import annotations

import pytest
import torch

from attnkit import CrossAttention, KVCache, MultiHeadAttention
from attnkit.modules.projected import ProjectedAttention

DEFAULTS = {
    "num_kv_heads": None,
    "dropout": 0.0,
    "qkv_bias": True,
    "out_bias": True,
    "device": None,
    "dtype": None,
}


def projected(d_q=12, d_kv=20, d_out=16, heads=4, **options):
    return ProjectedAttention(d_q, d_kv, d_out, heads, **(DEFAULTS | options))


def test_the_projections_take_each_side_to_its_heads():
    module = projected(num_kv_heads=2)
    assert (module.head_dim, module.num_heads, module.num_kv_heads) == (4, 4, 2)
    assert module.W_query.weight.shape == (16, 12)
    assert module.W_key.weight.shape == module.W_value.weight.shape == (8, 20)  # 2 heads of 4
    assert module.out_proj.weight.shape == (16, 16)
    assert module.W_key.bias is not None and module.out_proj.bias is not None
    plain = projected(qkv_bias=False, out_bias=False, dtype=torch.float64)
    assert plain.W_query.bias is None and plain.out_proj.bias is None
    assert plain.W_value.weight.dtype == torch.float64
    assert isinstance(MultiHeadAttention(8, 8, None, 0.0, 2), ProjectedAttention)
    assert isinstance(CrossAttention(8, 6, 8, 2), ProjectedAttention)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"d_q": 0}, ValueError, "d_in must be >= 1, got 0"),
        ({"d_kv": 2.0}, TypeError, "d_kv must be an int, got float"),
        ({"heads": 3}, ValueError, r"d_out \(16\) must be divisible by num_heads \(3\)"),
        ({"num_kv_heads": 3}, ValueError, r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"),
        ({"num_kv_heads": 0}, ValueError, "num_kv_heads must be >= 1, got 0"),
        ({"dropout": 1.0}, ValueError, r"dropout must be in \[0, 1\), got 1.0"),
        ({"qkv_bias": 1}, TypeError, "qkv_bias must be a bool, got int 1"),
        ({"out_bias": None}, TypeError, "out_bias must be a bool, got NoneType None"),
        ({"dtype": torch.int64}, TypeError, "dtype must be a floating-point torch.dtype or None"),
    ],
)  # fmt: skip
def test_both_modules_sizes_are_checked_in_one_place(options, error, message):
    with pytest.raises(error, match=message):
        projected(**options)


def copy_weights(into, source):
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value", "out_proj"):
            getattr(into, name).weight.copy_(getattr(source, name).weight)
            getattr(into, name).bias.copy_(getattr(source, name).bias)


def test_cross_attention_over_its_own_input_is_non_causal_self_attention(device):
    """The same projections, one call and the output projection: the same numbers, weights too."""
    mha = MultiHeadAttention(12, 16, None, 0.0, 4, causal=False, qkv_bias=True).to(device)
    cross = CrossAttention(12, 12, 16, 4, qkv_bias=True).to(device)
    copy_weights(cross, mha)
    x = torch.randn(2, 7, 12, device=device)
    key_mask = torch.rand(2, 7, device=device) > 0.3
    key_mask[:, 0] = True
    out, weights = mha(x, key_mask=key_mask, need_weights=True, average_weights=False)
    cross_out, cross_weights = cross(
        x, x.clone(), key_mask=key_mask, need_weights=True, average_weights=False
    )
    torch.testing.assert_close(cross_out, out)
    torch.testing.assert_close(cross_weights, weights)
    assert weights.shape == (2, 4, 7, 7)
    _, averaged = cross(x, x, key_mask=key_mask, need_weights=True)
    torch.testing.assert_close(averaged, weights.mean(dim=1))


@pytest.mark.parametrize("which", ["self", "cross"])
def test_dropout_applies_in_training_only_in_both_modules(which, device):
    module = (
        MultiHeadAttention(8, 8, None, 0.5, 2)
        if which == "self"
        else CrossAttention(8, 8, 8, 2, dropout=0.5)
    ).to(device)
    x = torch.randn(2, 6, 8, device=device)
    run = (lambda: module(x)) if which == "self" else (lambda: module(x, x))
    assert not torch.equal(run(), run())
    module.eval()
    assert torch.equal(run(), run())


@pytest.mark.parametrize("which", ["self", "cross"])
def test_a_cache_of_other_sizes_or_type_is_refused_naming_both(which, device):
    module = (
        MultiHeadAttention(8, 8, None, 0.0, 2, num_kv_heads=1)
        if which == "self"
        else CrossAttention(8, 8, 8, 2)
    ).to(device)
    heads = 1 if which == "self" else 2
    x = torch.randn(2, 3, 8, device=device)

    def call(cache):
        return module(x, cache=cache) if which == "self" else module(x, x, cache=cache)

    with torch.no_grad():
        with pytest.raises(TypeError, match=r"cache must be an attnkit\.KVCache, got dict"):
            call({})
        with pytest.raises(
            ValueError,
            match=rf"cache has \(batch_size, num_kv_heads, head_dim\) = \(2, {heads}, 8\), but "
            rf"this call needs \(2, {heads}, 4\)",
        ):
            call(KVCache(2, heads, 16, 8, device=device))
        call(KVCache(2, heads, 16, 4, device=device))  # the sizes it needs


@pytest.mark.parametrize("which", ["self", "cross"])
def test_a_cache_with_gradients_is_refused_in_both_modules(which):
    module = (
        MultiHeadAttention(8, 8, None, 0.0, 2) if which == "self" else CrossAttention(8, 8, 8, 2)
    )
    x = torch.randn(1, 3, 8)
    cache = KVCache(1, 2, 16, 4)
    with pytest.raises(ValueError, match="a KVCache stores keys and values without gradients"):
        module(x, cache=cache) if which == "self" else module(x, x, cache=cache)
