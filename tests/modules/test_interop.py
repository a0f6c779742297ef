"""MultiHeadAttention.from_torch and to_torch (attnkit.modules.interop): the same weights in
torch.nn.MultiheadAttention, and what either cannot represent."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnkit import MultiHeadAttention

# torch.nn.MultiheadAttention equivalence: (b, t, e, num_heads, bias)
TORCH_CONFIGS = [
    (2, 5, 16, 4, True),
    (1, 1, 8, 2, True),
    (3, 11, 30, 3, False),
    (2, 7, 12, 1, True),
]


@pytest.mark.parametrize(("b", "t", "e", "h", "bias"), TORCH_CONFIGS)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_from_torch_matches_torch(b, t, e, h, bias, batch_first, padded):
    torch_mha = nn.MultiheadAttention(e, h, bias=bias, batch_first=batch_first).eval()
    ours = MultiHeadAttention.from_torch(torch_mha).eval()
    x = torch.randn(b, t, e)
    key_padding_mask = None
    if padded:
        key_padding_mask = torch.rand(b, t) > 0.6
        key_padding_mask[:, 0] = False  # no fully padded row: torch returns NaN there
    torch_x = x if batch_first else x.transpose(0, 1)
    expected, expected_weights = torch_mha(
        torch_x, torch_x, torch_x, key_padding_mask=key_padding_mask, need_weights=True
    )
    if not batch_first:
        expected = expected.transpose(0, 1)
    key_mask = None if key_padding_mask is None else ~key_padding_mask
    out, weights = ours(x, key_mask=key_mask, need_weights=True)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(weights, expected_weights)

    back = ours.to_torch().eval()
    assert back.batch_first
    for name, tensor in torch_mha.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    round_trip, _ = back(x, x, x, key_padding_mask=key_padding_mask)
    torch.testing.assert_close(round_trip, out)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"add_bias_kv": True}, "add_bias_kv=True is not supported"),
        ({"add_zero_attn": True}, "add_zero_attn=True is not supported"),
        ({"kdim": 4, "vdim": 4}, r"kdim/vdim \(4/4\) different from embed_dim \(8\)"),
    ],
)
def test_from_torch_refuses_what_it_cannot_represent(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, **kwargs))


def test_from_torch_needs_a_torch_module():
    with pytest.raises(TypeError, match=r"m must be a torch\.nn\.MultiheadAttention, got Linear"):
        MultiHeadAttention.from_torch(nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (MultiHeadAttention(8, 8, None, 0.0, 2), "causal=True cannot be stored"),
        (MultiHeadAttention(8, 8, None, 0.0, 2, causal=False, num_kv_heads=1), r"num_kv_heads \(1\) != num_heads \(2\)"),
        (MultiHeadAttention(4, 8, None, 0.0, 2, causal=False), r"d_in \(4\) != d_out \(8\)"),
        (MultiHeadAttention(8, 8, None, 0.0, 2, causal=False, qkv_bias=True, out_bias=False), r"qkv_bias \(True\) and out_bias \(False\) differ"),
    ],
)  # fmt: skip
def test_to_torch_refuses_what_torch_cannot_represent(module, message):
    with pytest.raises(ValueError, match=message):
        module.to_torch()
