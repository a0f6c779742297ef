"""attnkit.modules.latent: MultiHeadLatentAttention against the decompressed computation written
out here in float64 from the layer's own weights (latent, up-projections, decoupled RoPE,
compressed queries or not, biases or not): the prefill, every absorbed decoding step, and every
gradient of the prefill; float32 within assert_close's defaults."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit.latent_cache import LatentCache
from attnkit.modules.latent import MultiHeadLatentAttention

SIZES = {"num_heads": 4, "latent_dim": 32, "head_dim": 12, "rope_dim": 8, "value_head_dim": 10}
SHAPES = ["one query projection", "compressed queries", "biases"]


def layer(shape: str, dtype=torch.float64) -> MultiHeadLatentAttention:
    torch.manual_seed(0)
    options = {"compressed queries": {"query_latent_dim": 24}, "biases": {"qkv_bias": True}}
    mla = MultiHeadLatentAttention(64, 48, **SIZES, **options.get(shape, {}))
    for norm in (mla.latent_norm, getattr(mla, "query_norm", None)):
        if norm is not None:  # away from ones, so that a missed norm weight shows
            torch.nn.init.normal_(norm.weight, 1.0, 0.3)
    return mla.to(dtype).eval()


def rope(x, positions, base=10000.0):
    """Rotate-half RoPE of x (..., t, d) at positions (t,), with cos and sin rounded to float32
    as attnkit's RotaryEmbedding keeps its tables (tests/test_positions.py holds those)."""
    d = x.shape[-1]
    angles = positions.double()[:, None] * base ** -(torch.arange(0, d, 2).double() / d)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = (f(angles).float().double() for f in (torch.cos, torch.sin))
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def decompressed(mla, x):
    """The layer written out: every head's keys and values from the latent, then softmax."""
    b, t, _ = x.shape
    h, n, r, v = mla.num_heads, mla.head_dim, mla.rope_dim, mla.value_head_dim
    if mla.query_latent_dim is None:
        q = mla.W_query(x)
    else:
        compressed = mla.W_DQ(x)
        q = mla.W_UQ(F.rms_norm(compressed, compressed.shape[-1:], mla.query_norm.weight, 1e-6))
    q = q.view(b, t, h, n + r).transpose(1, 2)
    positions = torch.arange(t)
    q = torch.cat([q[..., :n], rope(q[..., n:], positions)], dim=-1)
    latent = mla.W_DKV(x)
    latent = F.rms_norm(latent, latent.shape[-1:], mla.latent_norm.weight, 1e-6)
    k_rope = rope(mla.W_KR(x)[:, None], positions).expand(b, h, t, r)
    k = torch.cat([mla.W_UK(latent).view(b, t, h, n).transpose(1, 2), k_rope], dim=-1)
    values = mla.W_UV(latent).view(b, t, h, v).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / (n + r) ** 0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = scores.softmax(dim=-1) @ values
    return mla.out_proj(o.transpose(1, 2).reshape(b, t, h * v))


@pytest.mark.parametrize("shape", SHAPES)
def test_the_prefill_is_the_decompressed_computation(shape):
    mla = layer(shape)
    x = torch.randn(2, 11, 64, dtype=torch.float64)
    torch.testing.assert_close(mla(x), decompressed(mla, x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_every_absorbed_step_after_a_prompt_matches_the_whole_sequence(shape):
    mla = layer(shape)
    x = torch.randn(2, 11, 64, dtype=torch.float64)
    cache = mla.new_cache(2, max_len=16)
    steps = [mla(x[:, :6], cache=cache)]  # the prompt, decompressed
    steps += [mla(x[:, i : i + 1], cache=cache) for i in range(6, 11)]  # absorbed, one at a time
    torch.testing.assert_close(
        torch.cat(steps, dim=1), decompressed(mla, x), rtol=1e-12, atol=1e-12
    )
    assert cache.position == 11 and cache.keys().shape == (2, 1, 11, 32 + 8)


def test_an_absorbed_step_runs_the_decode_kernel_over_the_latent_rows():
    from attnkit.backends import decode
    from attnkit.functional import which_backend

    if not decode.KERNEL.usable()[0]:
        pytest.skip("no decode kernel here")
    mla = layer("one query projection", torch.float32)
    cache = mla.new_cache(1, max_len=8)
    mla(torch.randn(1, 8, 64), cache=cache)
    query = torch.randn(1, 4, 1, 32 + 8)
    assert which_backend(query, cache.keys(), cache.latents()).backend == "decode"


def test_an_absorbed_step_never_decompresses_the_cache(monkeypatch):
    mla = layer("one query projection")
    x = torch.randn(1, 7, 64, dtype=torch.float64)
    cache = mla.new_cache(1, max_len=8)
    mla(x[:, :6], cache=cache)
    seen = []
    mla.W_UK.register_forward_hook(lambda *_: seen.append("W_UK"))
    mla.W_UV.register_forward_hook(lambda *_: seen.append("W_UV"))
    mla(x[:, 6:], cache=cache)
    assert seen == []  # their weights were folded into the query and the output instead


@pytest.mark.parametrize("shape", SHAPES)
def test_every_gradient_of_the_prefill(shape):
    mla = layer(shape)
    x = torch.randn(2, 9, 64, dtype=torch.float64, requires_grad=True)
    leaves = [x, *mla.parameters()]
    d_out = torch.randn(2, 9, 48, dtype=torch.float64)
    got = torch.autograd.grad(mla(x), leaves, d_out)
    want = torch.autograd.grad(decompressed(mla, x), leaves, d_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_float32_within_the_defaults_of_the_float64_computation():
    exact = layer("compressed queries")
    mla = layer("compressed queries", torch.float32)
    x = torch.randn(2, 11, 64)
    cache = mla.new_cache(2, max_len=11)
    steps = [mla(x[:, :10], cache=cache), mla(x[:, 10:], cache=cache)]
    torch.testing.assert_close(torch.cat(steps, dim=1), decompressed(exact, x.double()).float())


def test_the_cache_holds_a_latent_and_a_rope_key_a_token():
    mla = layer("one query projection", torch.float32)
    cache = mla.new_cache(3, max_len=100)
    assert isinstance(cache, LatentCache) and cache.tokens.dtype == torch.float32
    assert cache.bytes_per_token() == (32 + 8) * 4  # not 2 x 4 heads x (12 + 8 or 10)
    assert "tokens" not in mla.state_dict() and not list(cache.state_dict())


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="x must be"):
        layer("biases")(torch.randn(2, 5, 63, dtype=torch.float64))
    with pytest.raises(ValueError, match="dropout"):
        MultiHeadLatentAttention(8, 8, 2, latent_dim=4, rope_dim=2, dropout=1.0)
    with pytest.raises(ValueError, match="rope_dim"):
        MultiHeadLatentAttention(8, 8, 2, latent_dim=4, rope_dim=0)
