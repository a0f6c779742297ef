"""SelfAttention, CausalAttention and MultiHeadAttentionWrapper against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from attnkit import CausalAttention, MultiHeadAttentionWrapper, SelfAttention
from helpers.oracle import naive_attention


def single_head_reference(module, x, causal, weights64=None):
    """The module's forward in float64 from its weights (or from ``weights64``, float64 copies of
    W_query, W_key and W_value): (context, attention weights)."""
    x64 = x.double()
    if weights64 is None:
        weights64 = [W.weight.double() for W in (module.W_query, module.W_key, module.W_value)]
    q, k, v = (x64 @ W.T for W in weights64)
    out, _, weights = naive_attention(
        q[:, None], k[:, None], v[:, None], causal=causal, scale=module.scale
    )
    return out[:, 0], weights[:, 0]


@pytest.mark.parametrize("cls", [SelfAttention, CausalAttention])
@pytest.mark.parametrize(
    ("b", "t", "d_in", "d_out"),
    [(2, 6, 3, 2), (1, 1, 5, 4), (3, 13, 7, 40)],  # the chapter's sizes; t=1; odd sizes
)
def test_single_head_matches_float64_reference(cls, b, t, d_in, d_out, device):
    module = SelfAttention(d_in, d_out) if cls is SelfAttention else cls(d_in, d_out, 16, 0.5)
    module.eval().to(device)  # dropout off
    x = torch.randn(b, t, d_in, requires_grad=True, device=device)
    out, weights = module(x, need_weights=True)
    x64 = x.detach().double().requires_grad_()
    params = [module.W_query.weight, module.W_key.weight, module.W_value.weight]
    params64 = [p.detach().double().requires_grad_() for p in params]
    out64, weights64 = single_head_reference(module, x64, cls is CausalAttention, params64)
    torch.testing.assert_close(out, out64.float())
    torch.testing.assert_close(weights, weights64.float())
    assert weights.shape == (b, t, t) and weights.dtype == x.dtype

    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *params], dout)
    grads64 = torch.autograd.grad(out64, [x64, *params64], dout.double())
    for g, g64 in zip(grads, grads64):
        torch.testing.assert_close(g, g64.float())


def test_unbatched_input_matches_batched(device):
    module = SelfAttention(3, 2).to(device)
    x = torch.randn(6, 3, device=device)
    out, weights = module(x, need_weights=True)
    batched_out, batched_weights = module(x[None], need_weights=True)
    torch.testing.assert_close(out, batched_out[0])
    torch.testing.assert_close(weights, batched_weights[0])


def test_from_matrices_default_scale_is_inverse_sqrt_d_out():
    W = torch.randn(4, 9)
    assert SelfAttention.from_matrices(W, W, W).scale == pytest.approx(1 / 3)
    assert SelfAttention.from_matrices(W, W, W, scale=1.0).scale == 1.0


def test_causal_output_ignores_future_tokens(device):
    module = CausalAttention(5, 4, 10).eval().to(device)
    x = torch.randn(2, 8, 5, device=device)
    changed = x.clone()
    changed[:, 5] += 10.0  # perturb token 5
    out, out_changed = module(x), module(changed)
    torch.testing.assert_close(out[:, :5], out_changed[:, :5], rtol=0, atol=0)
    assert not torch.allclose(out[:, 5:], out_changed[:, 5:])


def test_dropout_acts_in_training_only(device):
    module = CausalAttention(4, 4, 10, dropout=0.5).to(device)
    x = torch.randn(2, 6, 4, device=device)
    module.train()
    assert not torch.equal(module(x), module(x))
    _, weights = module(x, need_weights=True)
    ones = torch.ones(2, 6, device=device)
    torch.testing.assert_close(weights.sum(-1), ones)  # weights are before dropout
    module.eval()
    torch.testing.assert_close(module(x), module(x), rtol=0, atol=0)


def test_trace_keeps_every_step(device):
    module = CausalAttention(3, 2, 6).eval().to(device)
    x = torch.randn(6, 3, device=device)
    trace = module.trace(x)
    torch.testing.assert_close(trace.scores, trace.queries @ trace.keys.T)
    torch.testing.assert_close(trace.context, module(x))
    torch.testing.assert_close(trace.context, trace.weights @ trace.values)
    assert torch.equal(trace.weights.triu(1), torch.zeros(6, 6, device=device))


def test_wrapper_concatenates_independent_causal_heads(device):
    wrapper = MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=3).eval().to(device)
    x = torch.randn(2, 6, 3, device=device)
    out, weights = wrapper(x, need_weights=True, average_weights=False)
    assert out.shape == (2, 6, 6) and weights.shape == (2, 3, 6, 6)
    for i, head in enumerate(wrapper.heads):
        expected, expected_weights = single_head_reference(head, x, causal=True)
        torch.testing.assert_close(out[..., 2 * i : 2 * i + 2], expected.float())
        torch.testing.assert_close(weights[:, i], expected_weights.float())
    _, averaged = wrapper(x, need_weights=True)
    torch.testing.assert_close(averaged, weights.mean(1))


def test_device_and_dtype_keywords(device):
    module = CausalAttention(3, 2, 6, dtype=torch.float64, device=device.type)
    assert module.W_query.weight.dtype == torch.float64
    assert module.W_query.weight.device.type == device.type
    out = module(torch.randn(1, 4, 3, dtype=torch.float64, device=device))
    assert out.dtype == torch.float64 and out.device.type == device.type


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: SelfAttention(3, 2)(torch.randn(2, 2, 4, 3)), ValueError, r"x must be \(batch, tokens, features\) or \(tokens, features\), got shape \(2, 2, 4, 3\) \(4 dims\)"),
        (lambda: SelfAttention(3, 2)(torch.randn(2, 4, 5)), ValueError, r"x has 5 features in its last dim, but d_in is 3"),
        (lambda: CausalAttention(3, 2, 4)(torch.randn(1, 5, 3)), ValueError, r"x has 5 tokens, longer than context_length \(4\)"),
        (lambda: CausalAttention(3, 2, 4, dropout=1.0), ValueError, r"dropout must be in \[0, 1\), got 1.0"),
        (lambda: CausalAttention(3, 2, 4, dropout=-0.1), ValueError, r"dropout must be in \[0, 1\), got -0.1"),
        (lambda: SelfAttention(0, 2), ValueError, "d_in must be >= 1, got 0"),
        (lambda: SelfAttention(3, 2)(torch.ones(2, 3, dtype=torch.long)), TypeError, "x must have a floating-point dtype, got torch.int64"),
        (lambda: SelfAttention.from_matrices(torch.ones(3, 2), torch.ones(3, 2), torch.ones(3, 3)), ValueError, r"W_q, W_k and W_v must have the same shape"),
        (lambda: MultiHeadAttentionWrapper(3, 2, 4, 0.0, 0), ValueError, "num_heads must be >= 1, got 0"),
    ],
)  # fmt: skip
def test_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_single_head_options_reach_the_kernel(device):
    module = CausalAttention(4, 3, 12, window=2, alibi=True, softcap=3.0).eval().to(device)
    x = torch.randn(2, 7, 4, device=device)
    out, weights = module(x, need_weights=True)
    assert module.window == (1, 0)
    ones = torch.ones(7, 7, device=device)
    assert torch.equal(weights[0] > 0, ones.tril().bool() & ones.triu(-1).bool())
    W = [w.weight.double() for w in (module.W_query, module.W_key, module.W_value)]
    q, k, v = (x.double() @ w.T for w in W)
    expected, _, _ = naive_attention(
        q[:, None], k[:, None], v[:, None], causal=True, window=(1, 0), softcap=3.0,
        alibi_slopes=torch.tensor([2.0**-8], dtype=torch.float64, device=device),
        scale=module.scale,
    )  # fmt: skip
    torch.testing.assert_close(out, expected[:, 0].float())
