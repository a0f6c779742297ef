"""CrossAttention and AdditiveAttention (encoder-decoder attention) against float64 references."""

from __future__ import annotations

import pytest
import torch

from attnkit import AdditiveAttention, CrossAttention
from helpers.devices import CUDA
from helpers.oracle import projected_attention_reference


def on_devices(values, cuda):
    """``(value, device)`` parameters: every value on the CPU, those in ``cuda`` on CUDA too."""
    return [
        *(pytest.param(v, torch.device("cpu"), id=f"{v}-cpu") for v in values),
        *(pytest.param(v, torch.device("cuda"), id=f"{v}-cuda", marks=CUDA.marks) for v in cuda),
    ]


@pytest.mark.parametrize(
    ("b", "t", "s", "d_q", "d_kv", "d_out", "h"),
    [(2, 5, 9, 16, 24, 32, 4), (1, 1, 7, 8, 8, 8, 1), (3, 12, 3, 10, 6, 80, 2)],  # t<s, t=1, t>s
)
@pytest.mark.parametrize("masked", [False, True])
def test_cross_attention_matches_float64_reference(b, t, s, d_q, d_kv, d_out, h, masked, device):
    module = CrossAttention(d_q, d_kv, d_out, h, dropout=0.2, qkv_bias=True).eval().to(device)
    x = torch.randn(b, t, d_q, requires_grad=True, device=device)
    memory = torch.randn(b, s, d_kv, requires_grad=True, device=device)
    key_mask = torch.rand(b, s, device=device) > 0.4 if masked else None
    out, weights = module(x, memory, key_mask=key_mask, need_weights=True, average_weights=False)

    params64 = {n: p.detach().double().requires_grad_() for n, p in module.named_parameters()}
    x64, memory64 = (a.detach().double().requires_grad_() for a in (x, memory))
    out64, weights64 = projected_attention_reference(
        params64, x64, memory64, h, h, key_mask=key_mask
    )
    torch.testing.assert_close(out, out64.float())
    torch.testing.assert_close(weights, weights64.float())
    assert out.shape == (b, t, d_out) and weights.shape == (b, h, t, s)

    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, memory, *module.parameters()], dout)
    inputs64 = [x64, memory64, *(params64[n] for n, _ in module.named_parameters())]
    for g, g64 in zip(grads, torch.autograd.grad(out64, inputs64, dout.double())):
        torch.testing.assert_close(g, g64.float())


def test_cross_attention_unbatched(device):
    module = CrossAttention(4, 6, 8, 2).to(device)
    x, memory = torch.randn(3, 4, device=device), torch.randn(5, 6, device=device)
    out, weights = module(x, memory, need_weights=True)
    torch.testing.assert_close(out, module(x[None], memory[None])[0])
    assert out.shape == (3, 8) and weights.shape == (3, 5)


def additive_reference(module, query, keys, values, key_mask):
    """v^T tanh(W_q q + W_k k), masked softmax over keys, weighted sum of value rows; float64."""
    Wq, Wk, v = (m.weight.double() for m in (module.W_query, module.W_key, module.v))
    q = query.double() @ Wq.T  # (b, [t,] hidden)
    k = keys.double() @ Wk.T  # (b, s, hidden)
    if query.dim() == 2:
        scores = (torch.tanh(q[:, None, :] + k) @ v.T).squeeze(-1)  # (b, s)
        mask = key_mask
    else:
        scores = (torch.tanh(q[:, :, None, :] + k[:, None]) @ v.T).squeeze(-1)  # (b, t, s)
        mask = None if key_mask is None else key_mask[:, None, :]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return weights @ values.double() if query.dim() == 3 else (
        weights[:, None, :] @ values.double()
    ).squeeze(1), weights


@pytest.mark.parametrize("steps", [None, 4])
@pytest.mark.parametrize("separate_values", [False, True])
@pytest.mark.parametrize(("masked", "device"), on_devices([False, True], [True]))
def test_additive_attention_matches_float64_reference(steps, separate_values, masked, device):
    module = AdditiveAttention(6, 5, 7).to(device)
    b, s = 3, 8
    query = torch.randn(b, 6) if steps is None else torch.randn(b, steps, 6)
    query = query.to(device)
    keys = torch.randn(b, s, 5, device=device)
    values = torch.randn(b, s, 3, device=device) if separate_values else None
    key_mask = None
    if masked:
        key_mask = torch.rand(b, s, device=device) > 0.5
        key_mask[:, 0] = True
    context, weights = module(query, keys, values, key_mask=key_mask)
    expected, expected_weights = additive_reference(
        module, query, keys, keys if values is None else values, key_mask
    )
    torch.testing.assert_close(context, expected.float())
    torch.testing.assert_close(weights, expected_weights.float())
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1], device=device))


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: CrossAttention(4, 6, 8, 2)(torch.randn(2, 3, 4), torch.randn(3, 5, 6)), ValueError, "x and memory must both be batched with the same batch size"),
        (lambda: CrossAttention(4, 6, 8, 2)(torch.randn(2, 3, 4), torch.randn(2, 5, 4)), ValueError, "memory has 4 features in its last dim, but d_kv is 6"),
        (lambda: CrossAttention(4, 6, 8, 3), ValueError, r"d_out \(8\) must be divisible by num_heads \(3\)"),
        (lambda: CrossAttention(4, 6, 8, 2)(torch.randn(2, 3, 4), torch.randn(2, 5, 6), key_mask=torch.ones(2, 3, dtype=torch.bool)), ValueError, r"key_mask must have shape \(batch, key_length\) = \(2, 5\)"),
        (lambda: AdditiveAttention(4, 5, 6)(torch.randn(2, 3), torch.randn(2, 7, 5)), ValueError, "query has 3 features in its last dim, but d_query is 4"),
        (lambda: AdditiveAttention(4, 5, 6)(torch.randn(2, 4), torch.randn(3, 7, 5)), ValueError, "must agree in b and s"),
        (lambda: AdditiveAttention(4, 5, 6)(torch.randn(2, 4), torch.randn(2, 7, 5), key_mask=torch.ones(2, 7)), TypeError, "key_mask must be a bool tensor"),
    ],
)  # fmt: skip
def test_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_inputs_must_match_the_parameters(device):
    module = CrossAttention(4, 6, 8, 2).to(device)
    with pytest.raises(
        ValueError, match=f"memory is on meta but the module's parameters are on {device.type}"
    ):
        module(torch.randn(2, 3, 4, device=device), torch.randn(2, 5, 6, device="meta"))
    if device.type != "cpu":  # an input left on the CPU: named, never moved
        with pytest.raises(ValueError, match=r"x is on cpu but the module's parameters are on"):
            module(torch.randn(2, 3, 4), torch.randn(2, 5, 6, device=device))
    with pytest.raises(
        TypeError, match=r"x has dtype torch.float64 but the module's parameters are torch.float32"
    ):
        module(
            torch.randn(2, 3, 4, dtype=torch.float64, device=device),
            torch.randn(2, 5, 6, device=device),
        )
    with pytest.raises(
        ValueError, match=r"values must be \(batch, keys, d_v\), got shape \(7, 5\)"
    ):
        AdditiveAttention(4, 5, 6)(torch.randn(2, 4), torch.randn(2, 7, 5), torch.randn(7, 5))
