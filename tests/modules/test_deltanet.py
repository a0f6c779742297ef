"""attnkit.modules.deltanet: GatedDeltaNet against the book's bonus loop written out with the same
weights (one beta per head, as the models have it), decoding with its state cache against the
whole sequence (with and without the short convolution), gradients reaching every parameter, value
heads sharing query and key heads, and bad arguments named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit import GatedDeltaNet


def books_loop(layer: GatedDeltaNet, x: torch.Tensor) -> torch.Tensor:
    """The bonus chapter's forward, token by token, with the layer's weights (no convolution)."""
    b, t, _ = x.shape
    h, d = layer.num_heads, layer.head_dim
    q = F.normalize(layer.W_query(x).view(b, t, h, d), dim=-1, eps=0) / d**0.5
    k = F.normalize(layer.W_key(x).view(b, t, h, d), dim=-1, eps=0)
    v = layer.W_value(x).view(b, t, h, d)
    beta = torch.sigmoid(layer.W_beta(x))  # (b, t, h)
    alpha = -layer.A_log.exp() * F.softplus(layer.W_alpha(x) + layer.dt_bias)
    s = x.new_zeros(b, h, d, d)
    outs = []
    for i in range(t):
        s = s * alpha[:, i].exp()[..., None, None]
        predicted = (s * k[:, i, :, :, None]).sum(dim=-2)
        delta = (v[:, i] - predicted) * beta[:, i, :, None]
        s = s + k[:, i, :, :, None] * delta[:, :, None, :]
        outs.append((s * q[:, i, :, :, None]).sum(dim=-2))
    context = torch.stack(outs, dim=1)  # (b, t, h, d)
    gate = layer.W_gate(x).view(b, t, h, d)
    context = (layer.norm(context) * F.silu(gate)).reshape(b, t, h * d)
    return layer.out_proj(context)


def test_it_is_the_books_loop_with_one_beta_per_head():
    layer = GatedDeltaNet(24, 32, num_heads=4, dtype=torch.float64)
    torch.nn.init.normal_(layer.A_log, std=0.5)
    x = torch.randn(2, 11, 24, dtype=torch.float64)
    # the only difference: attnkit adds 1e-6 under the root of the L2 norm (as transformers does)
    torch.testing.assert_close(layer(x), books_loop(layer, x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("conv_size", [None, 4], ids=["no convolution", "a convolution of 4"])
@pytest.mark.parametrize("prompt", [1, 7], ids=lambda n: f"a prompt of {n}")
def test_decoding_with_the_state_cache_gives_the_whole_sequences_outputs(conv_size, prompt):
    layer = GatedDeltaNet(16, 16, num_heads=2, num_key_heads=1, conv_size=conv_size).eval()
    x = torch.randn(2, 20, 16)
    cache = layer.new_cache(2)
    with torch.no_grad():
        whole = layer(x)
        steps = [layer(x[:, :prompt], cache=cache)]
        steps += [layer(x[:, i : i + 1], cache=cache) for i in range(prompt, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole)
    assert cache.position == 20
    cache.reset()
    with torch.no_grad():  # after a reset, the same as a fresh cache
        torch.testing.assert_close(layer(x[:, :5], cache=cache), whole[:, :5])


def test_every_parameter_gets_a_gradient():
    layer = GatedDeltaNet(16, 16, num_heads=4, num_key_heads=2, key_head_dim=6, conv_size=3)
    layer(torch.randn(2, 9, 16)).square().sum().backward()
    missing = [n for n, p in layer.named_parameters() if p.grad is None or not p.grad.any()]
    assert not missing, missing


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"d_out": 30}, r"d_out \(30\) must be divisible by num_heads \(4\)"),
        ({"num_key_heads": 3}, r"num_heads \(4\) must be a multiple of num_key_heads \(3\)"),
        ({"conv_size": 0}, r"conv_size must be >= 1"),
    ],
)
def test_bad_arguments_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        GatedDeltaNet(**{"d_in": 16, "d_out": 32, "num_heads": 4, **options})


def test_bad_input_and_a_cache_of_another_shape_are_named():
    layer = GatedDeltaNet(16, 16, num_heads=2)
    with pytest.raises(ValueError, match=r"x must be \(b, t, d_in=16\)"):
        layer(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match=r"need \(2, 2, 8, 8, 0, 0\)"):
        layer(torch.randn(2, 5, 16), cache=layer.new_cache(1))


def test_a_float64_layer_decodes_with_a_float64_state_and_a_cache_must_fit():
    layer = GatedDeltaNet(8, 8, num_heads=2, conv_size=3, dtype=torch.float64).eval()
    x = torch.randn(1, 9, 8, dtype=torch.float64)
    cache = layer.new_cache(1)
    assert cache.state.dtype == torch.float64
    with torch.no_grad():
        steps = [layer(x[:, :4], cache=cache)] + [
            layer(x[:, i : i + 1], cache=cache) for i in range(4, 9)
        ]
        torch.testing.assert_close(torch.cat(steps, dim=1), layer(x), atol=1e-12, rtol=1e-12)
    other = GatedDeltaNet(8, 8, num_heads=2).new_cache(1)  # no convolution
    with pytest.raises(ValueError, match=r"cache has \(batch_size, num_heads, key_head_dim"):
        layer(x, cache=other)
    with pytest.raises(TypeError, match=r"cache must be an attnkit\.StateCache"):
        layer(x, cache=object())


def test_the_gates_are_computed_in_float32_where_float16_would_overflow():
    layer = GatedDeltaNet(8, 8, num_heads=2).half()
    with torch.no_grad():
        layer.A_log.fill_(12.0)  # exp(12) * softplus(...) beyond float16's range
    out = layer(torch.randn(1, 20, 8).half())
    assert bool(out.isfinite().all())
